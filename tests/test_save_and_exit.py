"""A whole job preempted at once (a SLURM job: every step gets SIGTERM), as real processes:
its workers save a checkpoint of the iteration they are at within the grace period and
exit, and new workers resume from it without losing a step."""

from __future__ import annotations

import argparse
import signal
import time

import pytest

from helpers import ITERS, assert_close, trained_losses, wait_for, worker_events
from megatron_parcae.control.etcd.keys import SAVE_AND_EXIT
from megatron_parcae.events import LayoutChange, Save, logged_steps
from megatron_parcae.training.checkpointing import read_progress
from megatron_parcae.training.hooks.live import LiveJobError, LiveReconfiguration

GRACE_S = 20.0  # the workers' (conftest.live_job)


@pytest.mark.extended
def test_job_noticed_at_once_saves_exits_and_resumes_losing_no_step(live_job, uninterrupted):
    store, coordinator, worker, logs = live_job
    coordinating = coordinator("a")
    first = {w: worker(w) for w in (0, 1)}
    wait_for(lambda: max((r.iteration for r in store.step_reports().values()), default=0) >= 5, 180,
             "5 iterations")
    noticed_at = time.time()
    for p in first.values():
        p.send_signal(signal.SIGTERM)
    for w, p in first.items():
        assert p.wait(timeout=GRACE_S) == 0, (logs / f"worker-{w}.log").read_text()[-3000:]
    assert time.time() < noticed_at + GRACE_S

    # The coordinator asked them to save and exit; they saved the iteration the job got to.
    generation = store.current_generation()
    assert store.plan(generation).action == SAVE_AND_EXIT
    decided = wait_for(lambda: next((d for d in store.coordinator_state().decisions if d["generation"] == generation),
                                    None), 30, "the coordinator's saved decision")  # saved just after the plan
    assert decided["kind"] == SAVE_AND_EXIT and "save a checkpoint and exit" in decided["reason"]
    reached = store.progress().iteration
    saved = [e for e in worker_events(logs) if isinstance(e, Save)][-1]
    assert saved.iteration == reached and saved.time < noticed_at + GRACE_S
    assert read_progress(str(logs / "checkpoints"))[1]["iteration"] == reached

    # New processes (a requeued job) resume from that checkpoint.
    second = {w: worker(w) for w in (2, 3)}
    for w, p in second.items():
        assert p.wait(timeout=300) == 0, (logs / f"worker-{w}.log").read_text()[-3000:]
    assert coordinating.wait(timeout=60) == 0
    assert store.done() is not None and store.done().iteration == ITERS
    events = worker_events(logs)
    resumed = next(e for e in events if isinstance(e, LayoutChange) and e.generation == generation + 1)
    assert (resumed.kind, resumed.iteration, resumed.lost_steps) == ("restart", reached, 0)
    trained = [e.iteration for e in logged_steps(events)]
    assert sorted(trained) == list(range(1, ITERS + 1))
    assert_close(trained_losses(events), uninterrupted)


def test_worker_without_save_directory_refuses_a_save_and_exit_plan_clearly():
    """The coordinator asks only workers whose member records say they save; a plan that
    reaches one that does not (written by hand, say) ends it with a clear error."""
    hook = LiveReconfiguration.__new__(LiveReconfiguration)  # no etcd, no WORLD: it fails before either
    hook.args = argparse.Namespace(save=None)
    with pytest.raises(LiveJobError, match="generation 7 asks the job to save a checkpoint and exit .* without --save"):
        hook._save_and_exit(7, runtime=object(), consumed_samples=256)
