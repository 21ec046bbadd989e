"""Workers, coordinator and etcd as separate real processes: the coordinator is killed
mid-run and started again, while a worker gets a notice and another arrives."""

from __future__ import annotations

import signal

from collective_probe import read_findings
from helpers import ITERS, assert_close, paced_while, trained_losses, wait_for, worker_events
import pytest

from megatron_parcae.events import LayoutChange, MigrationCostLearned, NetworkMeasured, logged_steps, read_events

def test_coordinator_restart_mid_run_applies_every_plan_once(live_job, uninterrupted, monkeypatch):
    """Steps are paced (tests/hooks/paced.py) until the second coordinator's first plan is applied,
    so that training cannot end before it however slowly that coordinator starts."""
    store, coordinator, worker, logs = live_job
    first = coordinator("a")
    pace = paced_while(monkeypatch, logs, 0.6)
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
    wait_for(lambda: any(isinstance(e, LayoutChange) and e.generation == generation_at_kill + 1
                         for e in worker_events(logs)), 180, "the second coordinator's first plan applied")
    pace.unlink()
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
    trained = [e.iteration for e in logged_steps(events)]
    assert sorted(trained) == list(range(1, ITERS + 1))
    assert_close(trained_losses(events), uninterrupted)
    # The plan agreement of every boundary ran on the control plane (the fixture checks
    # that no collective broke the planes).
    sites, _ = read_findings(logs / "probe")
    assert ("megatron_parcae/training/hooks/live.py:_post_agreement:all_reduce", "control") in sites, sites


def test_the_first_layout_on_two_instances_measures_the_network_the_coordinator_plans_with(live_job):
    store, coordinator, worker, logs = live_job
    # With 10 s intervals the first plan starts on both workers (two instances, as each
    # process started without torchrun is one), rather than on one that grows to two.
    config = logs / "coordinator.yaml"
    config.write_text(config.read_text().replace("interval-seconds: 2\n", "interval-seconds: 10\n"))
    coordinator("a")
    for w in (0, 1):
        worker(w)
    network = wait_for(store.network, 180, "the workers' network record")
    assert network.generation == 1 and network.instance != network.peer_instance
    events = logs / "coordinator-a.events.jsonl"
    (measured,) = wait_for(lambda: [e for e in read_events(events) if isinstance(e, NetworkMeasured)]
                           if events.exists() else [], 30, "the coordinator to plan with the network")
    # Its throughput prior's link and its cost model's messages between instances now
    # take the measured rate, where the profile and the cost constants assumed others.
    assert (measured.bytes_per_second, measured.latency_seconds) == (network.bytes_per_second, network.latency_seconds)
    assert (measured.link_bytes_per_second, measured.prior_link_bytes_per_second) == (network.bytes_per_second, 1.25e9)
    assert measured.transfer_bytes_per_second == pytest.approx(
        2**30 / (network.latency_seconds + 2**30 / network.bytes_per_second))
    assert measured.prior_transfer_bytes_per_second == pytest.approx(2**30 / 1198255.9e-6)  # the p2p table's
    # Rank 0 told the other rank on the control plane; the two measured on the data plane.
    sites, _ = read_findings(logs / "probe")
    assert {("megatron_parcae/training/network.py:measure_network:broadcast", "control"),
            ("megatron_parcae/training/network.py:_round_trip:send", "data"),
            ("megatron_parcae/training/network.py:_round_trip:recv", "data")} <= sites, sites
