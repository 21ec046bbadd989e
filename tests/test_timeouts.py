"""Timeouts by purpose (reconfig/timeouts.py) and the watch that aborts WORLD when a peer
fails during a long wait (reconfig.world.World.watch): a layout's first step may take
many lease periods on one rank without breaking it, and a worker lost mid-exchange is
still dropped within two lease periods."""

from __future__ import annotations

import json
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from helpers import ITERS, paced_while, wait_for, with_hooks
from megatron_parcae.events import Iteration, PlanPublished, read_events
from reconfig import compat
from reconfig.timeouts import EXCHANGE_FLOOR, exchange_timeout
from reconfig.world import World, WorldBroken, is_peer_failure, longest_timeout, patient, set_timeouts

STEADY = timedelta(seconds=5)
LONG = timedelta(minutes=10)



@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:42377: Connection reset by peer",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation",
    # What an operation in flight hears once another one on its context timed out.
    "Application timeout caused pair closure",
])
def test_what_gloo_says_of_a_lost_or_silent_peer_is_a_peer_failure(message):
    assert is_peer_failure(RuntimeError(message))


def test_an_error_of_this_process_is_not_a_peer_failure():
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"))
    assert not is_peer_failure(ValueError("Application timeout caused pair closure"))

def test_an_exchange_waits_its_bytes_over_the_link_with_a_margin_and_at_least_the_floor():
    assert exchange_timeout(0, 1e9) == EXCHANGE_FLOOR
    assert exchange_timeout(10**9, 1e9) == EXCHANGE_FLOOR  # 4 s of transfer: the floor is longer
    assert exchange_timeout(10**11, 1e8) == timedelta(seconds=4 * 1000)
    assert exchange_timeout(10**11, 1e8, margin=2) == timedelta(seconds=2 * 1000)
    assert exchange_timeout(10**6, 1e6, floor=timedelta(0)) == timedelta(seconds=4)


@pytest.mark.parametrize("nbytes, rate, margin", [(-1, 1e9, 4), (1, 0, 4), (1, float("nan"), 4), (1, 1e9, 0.5)])
def test_an_exchange_timeout_refuses_impossible_figures(nbytes, rate, margin):
    with pytest.raises(ValueError):
        exchange_timeout(nbytes, rate, margin)


@pytest.fixture
def alone():
    """A WORLD of one gloo member (generation 3) on an in-memory store; left at the end."""
    store = dist.HashStore()
    reasons: list[str] = []
    waits: list[float] = []

    def abandon(peers, waited):
        waits.append(waited)
        return reasons[-1] if reasons else ""

    w = World(0, (), store, "gloo", collective_timeout=STEADY, abandon=abandon)
    w.reform((0,), "g3")
    yield w, store, reasons, waits
    w.close()
    w.leave()


def test_a_block_inside_a_longer_wait_keeps_the_longer_timeout(alone):
    set_timeouts(LONG)  # a layout's first step
    with patient(None, timedelta(minutes=1), STEADY):  # a save in it
        assert longest_timeout() == LONG
    with patient(None, timedelta(minutes=30), STEADY):
        assert longest_timeout() == timedelta(minutes=30)
    assert longest_timeout() == LONG
    set_timeouts(STEADY)
    with patient(None, timedelta(minutes=1), STEADY):
        assert longest_timeout() == timedelta(minutes=1)
    assert longest_timeout() == STEADY


def _never_destroyed(monkeypatch) -> list:
    """Make a graceful destroy fail the test; returns the groups aborted."""
    aborted = []

    def destroy(group=None):
        raise AssertionError("a broken WORLD's groups were destroyed gracefully")

    abort_group = compat.abort_group
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    monkeypatch.setattr(compat, "abort_group", lambda g: (aborted.append(g), abort_group(g)))
    return aborted


def test_the_watch_aborts_a_long_wait_once_a_peer_breaks_the_generation(alone, monkeypatch):
    w, store, _, _ = alone
    aborted = _never_destroyed(monkeypatch)
    w.watch(0.05)
    store.set("parcae/g3/broken", b"1")
    time.sleep(0.5)  # ten periods: collectives wait one lease period, which notices a failed peer
    assert not w.aborted and not aborted
    set_timeouts(LONG)
    wait_for(lambda: w.aborted, 30, "the watch to abort WORLD")
    assert "a peer broke generation 3" in w.aborted
    assert dist.group.WORLD in aborted
    with pytest.raises(WorldBroken, match="cannot meet"):
        w.sync("g3/built")
    w.leave()  # by abort
    assert not dist.is_initialized() and not w.aborted


def test_the_watch_aborts_a_long_wait_that_abandon_finds_in_vain(alone, monkeypatch):
    w, _, reasons, waits = alone
    _never_destroyed(monkeypatch)
    set_timeouts(LONG)
    w.watch(0.05)
    wait_for(lambda: len(waits) >= 3, 30, "the watch to ask")
    assert not w.aborted
    assert waits == sorted(waits) and waits[0] < 1  # the time waited, from the start of the long wait
    reasons.append("workers [1] are no longer members of the job")
    wait_for(lambda: w.aborted, 30, "the watch to abort WORLD")
    assert w.aborted == "workers [1] are no longer members of the job"


def test_groups_released_while_a_peer_failure_is_handled_are_aborted(alone, monkeypatch):
    w, _, _, _ = alone
    aborted = _never_destroyed(monkeypatch)
    dropped = []
    drop = compat.drop_aborted_group
    monkeypatch.setattr(compat, "drop_aborted_group", lambda g=None: (dropped.append(g), drop(g)))
    try:
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
    except RuntimeError:
        w.leave()
    assert dropped == [None] and not aborted and not dist.is_initialized()


def _live_job(live_job, workers: int) -> None:
    """The live_job's coordinator config, for exactly `workers` workers."""
    config = live_job[3] / "coordinator.yaml"
    config.write_text("\n".join(f"min-workers: {workers}" if line.startswith("min-workers:")
                                else f"max-workers: {workers}" if line.startswith("max-workers:") else line
                                for line in config.read_text().splitlines()) + "\n")


@pytest.mark.slow
def test_a_first_step_three_lease_periods_long_on_one_rank_breaks_nothing(live_job, monkeypatch):
    """A lease of 10 s keeps a loaded machine's scheduling noise small beside it."""
    store, coordinator, worker, logs = live_job
    lease = 10.0
    flags = ("--parcae-lease-seconds", str(lease))
    _live_job(live_job, 2)
    processes = {0: worker(0, *flags)}
    with monkeypatch.context() as m:
        with_hooks(m, "slow_first_step", PARCAE_TEST_FIRST_STEP_SECONDS=str(3 * lease))
        processes[1] = worker(1, *flags)
    wait_for(lambda: len(store.members()) == 2, 120, "two workers to register")
    coordinator("a")
    for w, p in processes.items():
        assert p.wait(timeout=300) == 0, (logs / f"worker-{w}.log").read_text()[-3000:]
    assert store.done() is not None and store.done().iteration == ITERS
    plans = [e for e in read_events(logs / "coordinator-a.events.jsonl") if isinstance(e, PlanPublished)]
    assert plans and all(not p.broken and not p.lost for p in plans), plans
    # Worker 1's first step in a layout (the one that adds it, or the first) held its peer up.
    steps = [e for path in logs.glob("worker-*.events.jsonl") for e in read_events(path) if isinstance(e, Iteration)]
    assert max(e.ms_per_iteration for e in steps) >= 3 * lease * 1000, steps


@pytest.mark.slow
def test_a_worker_killed_mid_exchange_is_dropped_within_two_lease_periods(live_job, monkeypatch):
    """Worker 0 trains alone, then a change grows the layout onto worker 1, which is
    SIGKILLed (tests/hooks/killed_mid_exchange.py) as it comes to the exchange that brings it the
    state. A lease of 10 s keeps scheduling noise on a loaded machine small beside it.
    Steps are paced (tests/hooks/paced.py) until the growth is published, so that worker 0
    cannot end training alone however slowly the second coordinator starts."""
    store, coordinator, worker, logs = live_job
    lease = 10.0
    flags = ("--parcae-lease-seconds", str(lease))
    _live_job(live_job, 1)
    config = logs / "coordinator.yaml"
    pace = paced_while(monkeypatch, logs, 1)
    processes = {0: worker(0, *flags)}
    killed_at = logs / "killed-at.json"
    with monkeypatch.context() as m:
        with_hooks(m, "killed_mid_exchange", PARCAE_TEST_KILLED_AT=str(killed_at))
        processes[1] = worker(1, *flags)
    wait_for(lambda: len(store.members()) == 2, 120, "two workers to register")
    first = coordinator("a")  # plans one worker: worker 1 waits on standby
    wait_for(lambda: store.members()[0].generation >= 1, 120, "the first layout")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    config.write_text(config.read_text().replace("max-workers: 1", "max-workers: 2"))
    coordinator("b")  # grows the layout onto worker 1
    grown = wait_for(lambda: store.current_generation() > 1 and store.latest_plan(), 60, "the growth")
    pace.unlink()
    assert sorted(grown.layout["slots"]) == [0, 1], grown
    assert processes[1].wait(timeout=60) == -signal.SIGKILL, (logs / "worker-1.log").read_text()[-3000:]
    killed = json.loads(killed_at.read_text())["killed_at"]

    def dropped() -> PlanPublished | None:
        plans = [e for e in read_events(logs / "coordinator-b.events.jsonl") if isinstance(e, PlanPublished)]
        return next((p for p in plans if p.generation > grown.generation and 1 in p.lost), None)

    plan = wait_for(dropped, 120, "a plan without worker 1")
    assert 1 not in plan.workers and 0 in plan.workers, plan
    assert plan.time - killed <= 2 * lease, (plan.time - killed, plan)
    assert processes[0].wait(timeout=300) == 0, (logs / "worker-0.log").read_text()[-3000:]
    assert store.done() is not None and store.done().iteration == ITERS
