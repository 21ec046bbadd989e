"""Paces training in the processes of a test, where PARCAE_TEST_STEP_SECONDS is set: the
rank that reports each iteration (megatron_parcae.events.report) sleeps that long after
it, and the other ranks wait for it at the next step, as on a slower machine.

tests/test_slurm_elastic.py puts this folder on PYTHONPATH for its SLURM job (Python
imports `sitecustomize` at start): SLURM's fixed delays (a 30 s grace timer, an 11 s
requeue hold) then fit in the same few hundred iterations however fast the machine is.
"""

import os
import time

_SECONDS = float(os.environ.get("PARCAE_TEST_STEP_SECONDS", "0"))

if _SECONDS > 0:
    from megatron_parcae import events

    _report = events.report

    def _paced_report(event):
        _report(event)
        if isinstance(event, events.Iteration):
            time.sleep(_SECONDS)

    events.report = _paced_report
