"""Kills the process that is about to log iteration PARCAE_TEST_LOST_BEFORE_LOGGING (the
layout's rank 0), after the step was applied everywhere and before its line is written:
the first of the recovering layout's ranks that trained it must log it. Only the first
process to get there dies (it creates the file PARCAE_TEST_LOST_MARK): one that trains
the step again after a rollback logs it."""

import os
import signal

_ITERATION = int(os.environ.get("PARCAE_TEST_LOST_BEFORE_LOGGING", "0"))

if _ITERATION > 0:
    from megatron_parcae import events

    _report = events.report

    def _first() -> bool:
        try:
            os.close(os.open(os.environ["PARCAE_TEST_LOST_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _report_or_die(event):
        if isinstance(event, events.Iteration) and event.iteration == _ITERATION and not event.relogged \
                and _first():
            os.kill(os.getpid(), signal.SIGKILL)
        _report(event)

    events.report = _report_or_die
