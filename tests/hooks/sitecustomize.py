"""Imports the test hooks named in PARCAE_TEST_HOOKS ("paced,damaged"), in that order, in
every Python process a test starts with this folder on PYTHONPATH (Python imports
`sitecustomize` at start). Each hook changes the process's behaviour where its own
environment variables say how; helpers.with_hooks sets both."""

import importlib
import os

for _name in filter(None, os.environ.get("PARCAE_TEST_HOOKS", "").split(",")):
    importlib.import_module(_name)
