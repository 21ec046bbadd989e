"""Workers, coordinator and etcd as separate real processes: the coordinator is killed
mid-run and started again, while a worker gets a notice and another arrives."""

from __future__ import annotations

import signal

from collective_probe import read_findings
from helpers import ITERS, assert_close, trained_losses, wait_for, worker_events
from megatron_parcae.events import Iteration, LayoutChange, MigrationCostLearned, read_events

def test_coordinator_restart_mid_run_applies_every_plan_once(live_job, uninterrupted):
    store, coordinator, worker, logs = live_job
    first = coordinator("a")
    workers = {w: worker(w) for w in (0, 1)}

    def iteration() -> int:
        return max((r.iteration for r in store.step_reports().values()), default=0)

    wait_for(lambda: iteration() >= 5, 180, "5 iterations under the first coordinator")
    first.send_signal(signal.SIGKILL)
    first.wait()
    generation_at_kill = store.current_generation()
    workers[1].send_signal(signal.SIGTERM)  # a notice, and an arrival, while no coordinator runs
    workers[2] = worker(2)
    at_kill = iteration()
    wait_for(lambda: iteration() >= at_kill + 3, 60, "training to go on without a coordinator")
    assert store.current_generation() == generation_at_kill

    second = coordinator("b")
    assert second.wait(timeout=300) == 0, (logs / "coordinator-b.log").read_text()[-3000:]
    for w, p in workers.items():
        assert p.wait(timeout=60) == 0, (logs / f"worker-{w}.log").read_text()[-3000:]

    # The second coordinator went on from etcd: generations continue without a gap,
    # and it published what the notice and the arrival asked for.
    plans = store.plans()
    assert sorted(plans) == list(range(1, max(plans) + 1)) and max(plans) > generation_at_kill
    assert 1 not in {w for g in plans if g > generation_at_kill for w in plans[g].layout["slots"]}
    assert store.done() is not None and store.done().iteration == ITERS

    # Each plan was applied once: its layout change is logged once, by the new rank 0
    # (the newest may come too late to apply before training ends).
    events = worker_events(logs)
    applied = [e.generation for e in events if isinstance(e, LayoutChange)]
    assert sorted(applied) == sorted(set(applied)), applied
    assert generation_at_kill + 1 in applied and max(applied) <= max(plans)
    # The second coordinator refitted its migration costs on the phases that change took.
    learned = [e.generation for e in read_events(logs / "coordinator-b.events.jsonl")
               if isinstance(e, MigrationCostLearned)]
    assert generation_at_kill + 1 in learned, learned

    # Every iteration once, and the same model as without any of this.
    trained = [e.iteration for e in events if isinstance(e, Iteration)]
    assert sorted(trained) == list(range(1, ITERS + 1))
    assert_close(trained_losses(events), uninterrupted)
    # The plan agreement of every boundary ran on the control plane (the fixture checks
    # that no collective broke the planes).
    sites, _ = read_findings(logs / "probe")
    assert ("megatron_parcae/training/hooks/live.py:_agree:all_reduce", "control") in sites, sites
