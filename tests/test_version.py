"""What a user looks for around the code: `parcae --version` (one version, the package's),
the licence, how to cite, and help that describes every flag and shows its default."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import yaml

from helpers import REPO
from megatron_parcae import __version__, cli


def test_parcae_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"parcae {__version__}\n"


@pytest.mark.slow
def test_setup_publishes_the_package_version_and_licence():
    done = subprocess.run([sys.executable, "setup.py", "--version", "--license"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == [__version__, "Apache-2.0"]


def test_licence_is_apache_2():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_citation_names_this_project_and_cites_parcae():
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert {"cff-version", "title", "authors", "message"} <= citation.keys()
    assert citation["cff-version"] == "1.2.0" and "megatron-parcae" in citation["title"]
    assert citation["version"] == __version__ and citation["license"] == "Apache-2.0"
    assert citation["authors"] and all(a.get("name") or a.get("family-names") for a in citation["authors"])
    (parcae,) = [r for r in citation["references"] if r["title"].startswith("Parcae:")]
    assert parcae["year"] == 2024 and "NSDI" in parcae["collection-title"]
    assert [a["family-names"] for a in parcae["authors"]] == ["Duan", "Song", "Miao", "Xi", "Lin", "Xu", "Zhang",
                                                              "Jia"]


def _parsers(parser: argparse.ArgumentParser):
    """`parser` and the parsers of its own sub-commands (parcae slurm submit)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_describes_every_flag_and_shows_defaults(name):
    for parser in _parsers(cli.command_parser(name)):
        formatter = parser._get_formatter()
        assert isinstance(formatter, cli.HelpFormatter)
        for action in parser._actions:
            assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help"
            default = action.default
            if action.option_strings and action.nargs != 0 and not (default is None or default is False
                                                                     or default == argparse.SUPPRESS):
                assert "default" in formatter._get_help_string(action), \
                    f"{parser.prog} {action.option_strings[0]}: default {action.default!r} not shown"
        parser.format_help()  # every help string formats
