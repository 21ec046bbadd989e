"""Imports the test hooks named in PARCAE_TEST_HOOKS ("paced,damaged"), in that order, in
every Python process a test starts with this folder on PYTHONPATH (Python imports
`sitecustomize` at start). Each hook changes the process's behaviour where its own
environment variables say how; helpers.with_hooks sets both. multiprocessing's helper
interpreters (a spawned child, the resource tracker) train nothing and import none: the
hooks would cost each of them torch's import."""

import importlib
import os
import sys

_HELPER = "--multiprocessing-fork" in sys.orig_argv \
    or any(arg.startswith("from multiprocessing.resource_tracker import") for arg in sys.orig_argv)

if not _HELPER:
    for _name in filter(None, os.environ.get("PARCAE_TEST_HOOKS", "").split(",")):
        importlib.import_module(_name)
