"""Paces training in the processes of a test, where PARCAE_TEST_STEP_SECONDS is set: the
rank that reports each iteration (megatron_parcae.events.report) sleeps that long after
it, and the other ranks wait for it at the next step, as on a slower machine. A list
("0.2,0") paces each run of a SLURM job element its own way: the i-th value for
SLURM_RESTART_COUNT=i (unset on the first run), the last for later runs.

tests/test_slurm_elastic.py puts this folder on PYTHONPATH for its SLURM job (Python
imports `sitecustomize` at start): SLURM's fixed delays (a 30 s grace timer, an 11 s
requeue hold) then fit in the same few hundred iterations however fast the machine is.
"""

import os
import time

_PACE = [float(s) for s in os.environ.get("PARCAE_TEST_STEP_SECONDS", "0").split(",")]
_SECONDS = _PACE[min(int(os.environ.get("SLURM_RESTART_COUNT") or 0), len(_PACE) - 1)]

if _SECONDS > 0:
    from megatron_parcae import events

    _report = events.report

    def _paced_report(event):
        _report(event)
        if isinstance(event, events.Iteration):
            time.sleep(_SECONDS)

    events.report = _paced_report
