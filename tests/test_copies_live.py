"""Sudden losses recovered from the buddies' snapshots (reconfig/copies.py), with real
worker processes killed in layouts that keep no replica of a stage: a worker lost while a
change is applied has the change retried without it, its stage refilled from its buddy's
copy and the others rolled back; a worker lost with its buddy falls back to the
checkpoint. A joiner lost while the change that adds it is applied needs no snapshot: the
old layout's workers kept their state through the failed change. Every run trains exactly
what an uninterrupted one does."""

from __future__ import annotations

import json
import signal

import pytest

from helpers import ITERS, REPO, assert_close, paced_while, wait_for, with_hooks, worker_events
from megatron_parcae.events import CopiesKept, Iteration, LayoutChange, PlanPublished, Save, logged_steps, read_events

pytestmark = pytest.mark.slow

COPY_INTERVAL = 10  # --parcae-copy-interval's default, which the live_job workers use


def _pipeline_job(live_job, workers: int):
    """`workers` registered workers and a coordinator whose profile fits the model only in
    three or more pipeline stages and prices data parallelism high: every layout keeps a
    single copy of each layer (no replica)."""
    store, coordinator, worker, tmp_path = live_job
    profile = json.loads((REPO / "configs/profiles/gpt-tiny-cpu.json").read_text())
    (tmp_path / "profile.json").write_text(json.dumps({**profile, "max_tensor_parallel": 1,
                                                       "gpu_memory_bytes": 4e7, "link_bytes_per_second": 1e6}))
    config = tmp_path / "coordinator.yaml"
    config.write_text("\n".join(f"profile: {tmp_path / 'profile.json'}" if line.startswith("profile:") else line
                                for line in config.read_text().splitlines()))
    processes = {w: worker(w) for w in range(workers)}
    wait_for(lambda: len(store.members()) == workers, 120, f"{workers} workers to register")
    coordinator("a")
    wait_for(lambda: any(isinstance(e, CopiesKept) for e in worker_events(tmp_path))
             and max((r.iteration for r in store.step_reports().values()), default=0) >= 3, 180,
             "the first snapshots and 3 iterations")
    layout = store.latest_plan().layout
    assert layout["dp"] == 1 and layout["pp"] >= 3, layout
    return processes, layout["slots"]


def _check(live_job, processes: dict, survivors: list[int], uninterrupted: dict) -> tuple[list, list]:
    """Every survivor ended well, every iteration trained as the uninterrupted run did
    (also those trained twice), and the repeated ones are the lost steps reported."""
    store, _, _, logs = live_job
    for w in survivors:
        assert processes[w].wait(timeout=300) == 0, (logs / f"worker-{w}.log").read_text()[-3000:]
    assert store.done() is not None and store.done().iteration == ITERS
    events = worker_events(logs)
    trained = logged_steps(events)
    assert sorted({e.iteration for e in trained}) == list(range(1, ITERS + 1))
    for e in trained:
        assert_close({e.iteration: e.losses["lm loss"]}, {e.iteration: uninterrupted[e.iteration]})
    changes = [e for e in events if isinstance(e, LayoutChange)]
    assert len(trained) - ITERS == sum(c.lost_steps for c in changes)
    plans = [e for e in read_events(logs / "coordinator-a.events.jsonl") if isinstance(e, PlanPublished)]
    return changes, plans


def _between_saves(logs) -> bool:
    """Whether the job is one or two steps past a completed save (of --save-interval 4),
    so that a kill soon after seldom meets one: a survivor inside an asynchronous save's
    planning collectives when its peers die waits six usual timeouts there
    (test_checkpointing.py), which the tests here need not spend. Nor is a snapshot due
    within two steps or being taken: a worker lost while they are replaced leaves no
    snapshot whole, and the job goes back to its checkpoint (reconfig/copies.py)."""
    events = worker_events(logs)
    saved = max((e.iteration for e in events if isinstance(e, Save)), default=None)
    newest = max((e.iteration for e in events if isinstance(e, Iteration)), default=0)
    return saved is not None and saved < newest <= saved + 2 and 0 < newest % COPY_INTERVAL < COPY_INTERVAL - 2


@pytest.mark.extended
def test_a_worker_lost_with_its_buddy_falls_back_to_the_checkpoint(live_job, uninterrupted):
    processes, slots = _pipeline_job(live_job, 5)
    wait_for(lambda: _between_saves(live_job[3]), 180, "a checkpoint, no save or snapshot near")
    lost = slots[0], slots[1]  # slot 1 keeps slot 0's copy
    for w in lost:
        processes[w].send_signal(signal.SIGKILL)
    changes, plans = _check(live_job, processes, [w for w in processes if w not in lost], uninterrupted)
    recovered = [p for p in plans if set(lost) & set(p.lost)]
    assert recovered and recovered[-1].recovery == "checkpoint", plans
    assert any(c.kind == "restart" and c.source != "the seed" for c in changes if c.generation > 1)


def test_a_worker_lost_mid_change_has_the_change_retried_without_it(live_job, uninterrupted):
    store = live_job[0]
    processes, slots = _pipeline_job(live_job, 5)
    wait_for(lambda: _between_saves(live_job[3]), 180, "a checkpoint, no save or snapshot near")
    generation = store.current_generation()
    processes[slots[2]].send_signal(signal.SIGTERM)  # a notice: the layout changes without it
    new = wait_for(lambda: store.current_generation() > generation and store.latest_plan(), 60, "the change")
    victim = next(w for w in new.layout["slots"] if w in slots)  # killed while the change is applied
    processes[victim].send_signal(signal.SIGKILL)
    changes, plans = _check(live_job, processes, [w for w in processes if w not in (victim, slots[2])],
                            uninterrupted)
    assert processes[slots[2]].wait(timeout=60) == 0  # the noticed worker left in time
    retried = [p for p in plans if p.generation > new.generation]
    assert retried and victim not in retried[0].workers, plans
    # no stage has a replica: the victim's came from its buddy's copy, the others rolled back
    assert retried[0].recovery == "copies", retried[0]
    change = next(c for c in changes if c.generation == retried[0].generation)
    assert change.kind != "restart" and change.source.startswith("snapshots of generation")
    assert 0 <= change.lost_steps <= COPY_INTERVAL
    assert not any(c.kind == "restart" for c in changes if c.generation > 1)


@pytest.mark.extended
def test_a_joiner_lost_mid_change_has_the_change_retried_from_the_state_kept(live_job, uninterrupted, monkeypatch):
    """The first layout, one worker, grows onto a joiner that dies as it reaches the new
    WORLD's meeting point (tests/hooks/lost_before_meeting.py): the old worker kept its state through
    the failed change, so the change is retried from it without the joiner, losing no step.
    With the distributed optimizer no plan from the grown layout can do without the
    joiner's shard: the coordinator holds back a restart for the old worker's report, and
    the old worker, waiting for the joiner, must see that it is no longer a member. Steps
    are paced (tests/hooks/paced.py) until the growth is published, so that worker 0 cannot
    end training alone however slowly the second coordinator starts."""
    store, coordinator, worker, tmp_path = live_job
    pace = paced_while(monkeypatch, tmp_path, 1)
    profile = json.loads((REPO / "configs/profiles/gpt-tiny-cpu.json").read_text())
    (tmp_path / "profile.json").write_text(json.dumps({**profile, "max_tensor_parallel": 1}))  # replicas only
    config = tmp_path / "coordinator.yaml"
    config.write_text("\n".join(f"profile: {tmp_path / 'profile.json'}" if line.startswith("profile:")
                                else "min-workers: 1" if line.startswith("min-workers:")
                                else "max-workers: 1" if line.startswith("max-workers:") else line
                                for line in config.read_text().splitlines()) + "\ndistributed-optimizer: true\n")
    processes = {0: worker(0, "--use-distributed-optimizer")}
    with_hooks(monkeypatch, "lost_before_meeting", PARCAE_TEST_LOST_BEFORE_MEETING="1")
    processes[1] = worker(1, "--use-distributed-optimizer")
    wait_for(lambda: len(store.members()) == 2, 120, "two workers to register")
    first = coordinator("a")  # plans one worker: worker 1 waits on standby
    wait_for(lambda: store.members()[0].generation >= 1, 120, "the first layout")
    assert store.plan(1).layout["slots"] == [0]
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    config.write_text(config.read_text().replace("max-workers: 1", "max-workers: 2"))
    coordinator("b")  # grows the layout onto worker 1
    grown = wait_for(lambda: store.current_generation() > 1 and store.latest_plan(), 60, "the growth")
    pace.unlink()
    assert 1 in grown.layout["slots"]
    assert processes[1].wait(timeout=60) == -signal.SIGKILL, (tmp_path / "worker-1.log").read_text()[-3000:]
    changes, _ = _check(live_job, processes, [0], uninterrupted)
    plans = [e for e in read_events(tmp_path / "coordinator-b.events.jsonl") if isinstance(e, PlanPublished)]
    after = [p for p in plans if p.generation > grown.generation]
    retried = [p for p in after if "retried from the state the workers kept" in p.reason]
    assert retried and retried[0].recovery == "replicas", plans
    assert all(1 not in p.workers and p.recovery in ("", "replicas") for p in after), plans
    assert not any(c.kind == "restart" for c in changes if c.generation > 1)
    assert not any(c.lost_steps for c in changes)
    assert "workers [1] are no longer members of the job" in (tmp_path / "worker-0.log").read_text()
