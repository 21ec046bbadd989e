"""megatron-core's warnings that Transformer Engine or Apex is not installed: the first only.

Each megatron-core module with a torch fallback warns when it is imported, from a line of
its own, so Python's once-per-line default prints about eight of them at every process
start. They all say the same thing; the first is shown and the others are dropped. Every
other warning, megatron-core's included, is shown as before.
"""

from __future__ import annotations

import os
import re
import warnings

_MISSING = re.compile(r"\b(Transformer Engine|Apex)\b.*\bnot installed")
_FROM_MEGATRON_CORE = f"{os.sep}megatron{os.sep}core{os.sep}"
_installed = False


def show_first_missing_kernel_warning() -> None:
    """Wrap `warnings.showwarning` (its documented hook) once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    show = warnings.showwarning
    shown = False

    def showwarning(message, category, filename, lineno, file=None, line=None):
        nonlocal shown
        if _FROM_MEGATRON_CORE in filename and _MISSING.search(str(message)):
            if shown:
                return
            shown = True
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
