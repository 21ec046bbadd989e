"""Workers lost without notice, as real processes: one stalls (SIGSTOP) past its lease,
then another is SIGKILLed; a rank 0 dies between applying a step and logging it. The
others go on (in place, or from their snapshots), train the same model and log every
step."""

from __future__ import annotations

import json
import os
import signal

import pytest

from helpers import ITERS, REPO, assert_close, trained_losses, wait_for, with_hooks, worker_events
from megatron_parcae.control.agent import FENCED_EXIT
from megatron_parcae.events import LayoutChange, logged_steps

LOST_BEFORE_LOGGING = 10  # two steps past a save (--save-interval 4), none in flight


def _start_three(live_job, distributed_optimizer: bool = False) -> tuple[dict, callable]:
    """Three registered workers, then the coordinator; returns them and an iteration probe.

    The coordinator's profile allows no tensor parallelism, so that the layout keeps a
    replica of every layer (data parallel): losing one worker loses no state, unless the
    distributed optimizer shards it.
    """
    store, coordinator, worker, tmp_path = live_job
    profile = json.loads((REPO / "configs/profiles/gpt-tiny-cpu.json").read_text())
    (tmp_path / "profile.json").write_text(json.dumps({**profile, "max_tensor_parallel": 1}))
    config = tmp_path / "coordinator.yaml"
    config.write_text("\n".join(f"profile: {tmp_path / 'profile.json'}" if line.startswith("profile:") else line
                                for line in config.read_text().splitlines())
                      + ("\ndistributed-optimizer: true\n" if distributed_optimizer else ""))
    flags = ["--use-distributed-optimizer"] if distributed_optimizer else []
    workers = {w: worker(w, *flags) for w in (0, 1, 2)}
    wait_for(lambda: len(store.members()) == 3, 120, "three workers to register")
    coordinator("a")

    def iteration() -> int:
        return max((r.iteration for r in store.step_reports().values()), default=0)

    wait_for(lambda: iteration() >= 5, 180, "5 iterations")
    return workers, iteration


def _check_training(live_job, workers: dict, survivors: list[int], uninterrupted: dict) -> str:
    """Every survivor ended well, every iteration was trained, those trained twice are the
    steps the changes say were lost, the model is the same."""
    store, _, _, logs = live_job
    for w in survivors:
        assert workers[w].wait(timeout=240) == 0, (logs / f"worker-{w}.log").read_text()[-3000:]
    text = "".join((logs / f"worker-{w}.log").read_text() for w in workers)
    assert store.done() is not None and store.done().iteration == ITERS
    events = worker_events(logs)
    trained = [e.iteration for e in logged_steps(events)]
    assert sorted(set(trained)) == list(range(1, ITERS + 1))
    assert len(trained) - ITERS == sum(e.lost_steps for e in events if isinstance(e, LayoutChange))
    assert_close(trained_losses(events), uninterrupted)
    return text


def test_stalled_then_killed_workers_are_left_behind_in_place(live_job, uninterrupted):
    store, _, _, logs = live_job
    workers, iteration = _start_three(live_job)
    generation = store.current_generation()
    stalled = store.plan(generation).layout["slots"][-1]
    os.kill(workers[stalled].pid, signal.SIGSTOP)
    before = iteration()
    # while it is stopped: the collective it stalled is given up, its lease ends too
    wait_for(lambda: iteration() > before + 1, 120, "the others to train again")
    assert stalled not in store.members()
    os.kill(workers[stalled].pid, signal.SIGCONT)
    assert workers[stalled].wait(timeout=60) == FENCED_EXIT
    stalled_log = (logs / f"worker-{stalled}.log").read_text()
    assert "lost its membership" in stalled_log and "saved checkpoint" not in stalled_log

    # then a worker of the new layout is SIGKILLed: a replica of every layer is left
    wait_for(lambda: store.current_generation() > generation and iteration() > before + 4, 120, "a new layout")
    generation = store.current_generation()
    killed = store.plan(generation).layout["slots"][-1]
    workers[killed].send_signal(signal.SIGKILL)
    text = _check_training(live_job, workers, [w for w in workers if w not in (stalled, killed)], uninterrupted)
    assert f"generation {generation} broke" in text and "keeping its state" in text
    # the next change moved the survivors' state: nothing was lost, nothing restarted
    after = [e for e in worker_events(logs) if isinstance(e, LayoutChange) and e.generation > generation]
    assert after and after[0].kind != "restart" and not after[0].lost_steps
    coordinator_log = (logs / "coordinator-a.log").read_text()
    assert f"lost workers [{stalled}]" in coordinator_log and f"lost workers [{killed}]" in coordinator_log
    assert "WORLD broke under workers" in coordinator_log


@pytest.mark.parametrize("distributed_optimizer", [pytest.param(False, marks=pytest.mark.extended), True],
                         ids=["kept", "rolled-back"])
def test_a_step_whose_rank_0_died_before_logging_it_is_logged_by_a_rank_that_trained_it(
        live_job, uninterrupted, monkeypatch, distributed_optimizer):
    """The layout's rank 0 is killed once the step is applied everywhere, before its log line
    (tests/hooks/lost_before_logging.py): the first of the new layout's ranks that trained it,
    finding no record of it in etcd, logs it (flagged `relogged`). The survivors keep the
    step; with the distributed optimizer they lost rank 0's shard and roll back to their
    snapshots, so the step is trained again and, logged twice, counted as lost."""
    with_hooks(monkeypatch, "lost_before_logging", PARCAE_TEST_LOST_BEFORE_LOGGING=str(LOST_BEFORE_LOGGING))
    store, _, _, logs = live_job
    monkeypatch.setenv("PARCAE_TEST_LOST_MARK", str(logs / "lost-before-logging"))
    workers, _ = _start_three(live_job, distributed_optimizer)
    [lost] = wait_for(lambda: [w for w, p in workers.items() if p.poll() is not None], 180,
                      f"the rank 0 of iteration {LOST_BEFORE_LOGGING} to die")
    assert workers[lost].returncode == -signal.SIGKILL, (logs / f"worker-{lost}.log").read_text()[-3000:]
    _check_training(live_job, workers, [w for w in workers if w != lost], uninterrupted)
    steps = logged_steps(worker_events(logs))
    relogged = [e for e in steps if e.relogged]
    assert [e.iteration for e in relogged] == [LOST_BEFORE_LOGGING], relogged
    if distributed_optimizer:
        changes = [e for e in worker_events(logs) if isinstance(e, LayoutChange)]
        assert any((c.source or "").startswith("snapshots of generation") and c.lost_steps for c in changes), changes
    else:
        assert [e.iteration for e in steps] == list(range(1, ITERS + 1))
