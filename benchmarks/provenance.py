"""Which checkout a benchmark's figures come from: every results file names its commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's short commit, with " plus uncommitted changes" where its tree differs."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    return head.stdout.strip() + (" plus uncommitted changes" if dirty.stdout.strip() else "")
