"""Paces training in the processes of a test, where PARCAE_TEST_STEP_SECONDS is set: the
seconds a step takes on one process. The rank that reports each iteration
(megatron_parcae.events.report) sleeps that long divided by the layout's world size after
it, and the other ranks wait for it at the next step, as on a slower machine where more
workers train faster: a coordinator that learns step times from the workers' reports then
still prefers more of them. A list ("0.4,0") paces each run of a SLURM job element its own
way: the i-th value for SLURM_RESTART_COUNT=i (unset on the first run), the last for later runs.

With PARCAE_TEST_PACE_WHILE set to a path, steps are paced only while that file exists:
the test removes it once what it waits for has happened (a requeued element rejoined),
and the job then trains at full speed.

In tests/test_slurm_elastic.py SLURM's fixed delays (a 30 s grace timer, an 11 s requeue
hold) then fit in the same few hundred iterations however fast the machine is.
"""

import os
import time

_PACE = [float(s) for s in os.environ.get("PARCAE_TEST_STEP_SECONDS", "0").split(",")]
_SECONDS = _PACE[min(int(os.environ.get("SLURM_RESTART_COUNT") or 0), len(_PACE) - 1)]
_WHILE = os.environ.get("PARCAE_TEST_PACE_WHILE")

if _SECONDS > 0:
    from megatron_parcae import events

    _report = events.report

    def _paced_report(event):
        _report(event)
        if isinstance(event, events.Iteration) and (_WHILE is None or os.path.exists(_WHILE)):
            import torch.distributed as dist

            time.sleep(_SECONDS / (dist.get_world_size() if dist.is_initialized() else 1))

    events.report = _paced_report
