"""Exchanges that hold under NCCL's rules, and payloads that are checked.

On CPU every plane is gloo, which forgives what NCCL hangs on; the collective probe
(tests/collective_probe.py) replays what each rank posted under NCCL's rules. Every
kind of change, snapshots with two and three instances, a join, and (tests/
test_copies_live.py, whose workers run under the probe too) recoveries from snapshots
post their traffic so that NCCL completes it. Messages that arrive damaged or short
(tests/hooks/damaged.py) are never used: the change or the snapshot's exchange is taken again,
and training goes on exactly as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from collective_probe import _replay, read_findings
from helpers import (ITERS, REPO, SMALL_GPT, Run, assert_close, assert_same_state, child_env, computed_folder,
                     layout_flags, losses, paced_while, shared_losses, torchrun, wait_for, with_hooks, worker_events)
from megatron_parcae import events
from megatron_parcae.events import CopiesKept, LayoutChange, logged_steps, read_events

SCHEDULED_ITERS = 12


def _post(ident: int, op: str, peer: int, plane: str = "data", n: int = 10, batch: int | None = None) -> dict:
    record = {"post": ident, "op": op, "peer": peer, "plane": plane, "n": n, "tag": 0}
    return record if batch is None else {**record, "batch": batch}


def _segments(*ranks: list[dict]) -> dict[int, list[dict]]:
    return {r: [{"open": len(ranks)}, *events, {"close": True}] for r, events in enumerate(ranks)}


def test_facing_unbatched_sends_are_a_violation():
    facing = _segments([_post(0, "send", 1), _post(1, "recv", 1), {"wait": 0}, {"wait": 1}],
                       [_post(0, "send", 0), _post(1, "recv", 0), {"wait": 0}, {"wait": 1}])
    assert any("both first send on pair 0-1" in v for v in _replay("w", facing))
    ordered = _segments([_post(0, "send", 1), _post(1, "recv", 1), {"wait": 0}, {"wait": 1}],
                        [_post(0, "recv", 0), _post(1, "send", 0), {"wait": 0}, {"wait": 1}])
    assert _replay("w", ordered) == []
    facing_receives = _segments([_post(0, "recv", 1), _post(1, "send", 1)], [_post(0, "recv", 0), _post(1, "send", 0)])
    assert any("both first recv" in v for v in _replay("w", facing_receives))


def test_batches_need_a_collective_first_and_then_match_by_order():
    collective = {"collective": "all_reduce", "plane": "data"}
    both_ways = [[collective, _post(0, "send", 1, batch=0), _post(1, "recv", 1, batch=0), {"wait": 0}, {"wait": 1}],
                 [collective, _post(0, "send", 0, batch=0), _post(1, "recv", 0, batch=0), {"wait": 0}, {"wait": 1}]]
    assert _replay("w", _segments(*both_ways)) == []
    unset = _segments(*[events[1:] for events in both_ways])
    assert any("before any collective" in v for v in _replay("w", unset))
    sizes_differ = _segments(both_ways[0], [collective, _post(0, "send", 0, n=9, batch=0),
                                            _post(1, "recv", 0, batch=0), {"wait": 0}, {"wait": 1}])
    assert any("is matched (by order)" in v for v in _replay("w", sizes_differ))


def test_a_wait_before_the_matching_post_is_a_violation():
    control = {"collective": "all_reduce", "plane": "control"}
    stalled = _segments([_post(0, "recv", 1, plane="control"), {"wait": 0}, control],
                        [control, _post(0, "send", 0, plane="control"), {"wait": 0}])
    assert any("a wait before the matching post" in v for v in _replay("w", stalled))
    tagged = _segments([_post(0, "send", 1, plane="control"), _post(1, "recv", 1, plane="control"), {"wait": 1}],
                       [_post(0, "send", 0, plane="control"), _post(1, "recv", 0, plane="control"), {"wait": 1}])
    assert _replay("w", tagged) == []  # gloo buffers sends and matches by tag


@pytest.mark.slow
def test_the_probe_catches_the_send_send_pair_of_the_old_exchange(tmp_path):
    """T1P2D1 -> T2P1D1 posted as the executor did before reconfig/transfer.py: both
    workers send first (tests/nccl_rules/old_exchange.py). gloo completes it."""
    import subprocess
    import sys

    env = {**child_env(), "PARCAE_PROBE_ALSO": str(REPO / "tests" / "nccl_rules") + os.sep}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "collective_probe.py"), str(tmp_path / "probe"),
                           str(REPO / "tests" / "nccl_rules" / "old_exchange.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _, violations = read_findings(tmp_path / "probe")
    assert any("NCCL would hang" in v and "both first send on pair 0-1" in v for v in violations), violations


@pytest.fixture(scope="module")
def reference_run(tiny_data, tmp_path_factory) -> tuple[dict[int, float], Path]:
    """tests/test_reconfig_live.py's uninterrupted run (computed once for both)."""
    def run(folder: Path) -> dict[int, float]:
        return losses(torchrun("pretrain_gpt.py", 1, SMALL_GPT + ["--train-iters", str(SCHEDULED_ITERS), "--save",
                                                                  str(folder / "checkpoints")]))

    return shared_losses(tmp_path_factory, "reconfig-reference", run), \
        computed_folder(tmp_path_factory, "reconfig-reference") / "checkpoints"


def _under_probe(tmp_path: Path, nproc: int, pp: int, schedule: str, *extra: str) -> Run:
    return torchrun("pretrain_gpt.py", nproc, SMALL_GPT + layout_flags(1, pp) + list(extra) + [
        "--train-iters", str(SCHEDULED_ITERS), "--parcae", "--parcae-layout-schedule", schedule],
        timeout=400, probe=tmp_path / "probe")


# Under the probe an exchange moves 65536 elements per rank and step (collective_probe.py),
# and the distributed optimizer sums 4096 elements of two moments at a time.
CHUNK_MIB = (65536 * 4 + 4096 * 8) / 2**20


def _within_one_chunk(change: LayoutChange) -> None:
    """The device held at most the larger of the old and the new layout's state plus one
    chunk in flight (10% for rounding): the old layout is gone before the new is built."""
    assert change.device_peak_mib <= (max(change.steady_device_peak_mib, change.new_device_mib) + CHUNK_MIB) * 1.1, \
        change


@pytest.mark.slow
def test_every_kind_of_change_keeps_to_nccls_rules(reference_run, tmp_path):
    """Tensor, T and P together, pipeline and intra-stage changes on four processes, then
    a grace hand-over of a whole stage and a join on six."""
    reference, _ = reference_run
    run = _under_probe(tmp_path / "four", 4, 2, "3:2,2,1;5:1,4,1;7:1,2,2;9:1,2,1:leave=1,3")
    assert_close(losses(run), reference)
    assert [c.kind for c in run.of(LayoutChange)] == ["tensor", "tensor", "pipeline", "intra-stage"]
    for change in run.of(LayoutChange):
        _within_one_chunk(change)
    sites, violations = read_findings(tmp_path / "four" / "probe")
    assert not violations, violations
    assert any(site.startswith("reconfig/transfer.py:_exchange:batch_isend_irecv") for site, _ in sites), sites
    run = _under_probe(tmp_path / "six", 6, 2, "3:1,2,1:leave=2,3;6:1,2,2:join=2;9:2,2,1",
                       "--use-distributed-optimizer")
    assert_close(losses(run), reference)
    assert [c.kind for c in run.of(LayoutChange)] == ["inter-stage", "inter-stage", "tensor"]
    for change in run.of(LayoutChange):
        _within_one_chunk(change)
    _, violations = read_findings(tmp_path / "six" / "probe")
    assert not violations, violations


def _damaging(monkeypatch, tmp_path: Path, damage: str) -> None:
    (tmp_path / "damage").mkdir()
    with_hooks(monkeypatch, "damaged", PARCAE_TEST_DAMAGE=damage, PARCAE_TEST_DAMAGE_DIR=str(tmp_path / "damage"))


@pytest.mark.slow
def test_a_damaged_migration_is_taken_again(reference_run, tmp_path, monkeypatch):
    """T1P2D1 -> T2P1D1: one payload arrives with a flipped byte, one cut short (in one
    attempt or two); the change is taken again until it moves everything whole, and the
    job trains and ends as an uninterrupted one, parameters and moments included."""
    reference, reference_save = reference_run
    _damaging(monkeypatch, tmp_path, "migration:flip,migration:truncate")
    run = _under_probe(tmp_path, 2, 2, "3:2,1,1", "--save", str(tmp_path / "ckpt"))
    assert_close(losses(run), reference)
    retried = run.of(events.ChangeRetried)
    assert [r.attempt for r in retried] == list(range(1, len(retried) + 1)) and retried, retried
    found = [re.search(r"(\d+) message\(s\) arrived damaged or short", r.reason) for r in retried]
    assert all(found) and sum(int(f.group(1)) for f in found) == 2, retried  # both, each noticed
    assert sorted(p.name for p in (tmp_path / "damage").iterdir()) == ["migration-flip", "migration-truncate"]
    _, violations = read_findings(tmp_path / "probe")
    assert not violations, violations
    assert_same_state(tmp_path / "ckpt", reference_save, SMALL_GPT + ["--train-iters", str(SCHEDULED_ITERS)])


def _no_replicas(tmp_path: Path, memory: float, max_workers: int) -> None:
    """Point the live job's coordinator at a profile that fits GPT-tiny only in at least
    two (4.4e7 bytes) or three (4e7) pipeline stages and prices data parallelism high:
    every worker's snapshot then has a copy on another instance."""
    profile = json.loads((REPO / "configs/profiles/gpt-tiny-cpu.json").read_text())
    (tmp_path / "profile.json").write_text(json.dumps({**profile, "max_tensor_parallel": 1,
                                                       "gpu_memory_bytes": memory, "link_bytes_per_second": 1e6}))
    config = tmp_path / "coordinator.yaml"
    config.write_text("\n".join(f"profile: {tmp_path / 'profile.json'}" if line.startswith("profile:")
                                else f"max-workers: {max_workers}" if line.startswith("max-workers:") else line
                                for line in config.read_text().splitlines()) + "\n")


@pytest.mark.slow
def test_snapshots_of_two_and_three_instances_and_damaged_copies(live_job, uninterrupted, monkeypatch):
    """Two workers, one pipeline stage each, keep each other's snapshots every 2 steps;
    then a third joins and the three keep them in a ring, in host blocks allocated once
    per layout. The first copy exchanged
    arrives with a flipped byte, one after the join cut short: neither is committed,
    each exchange is taken again, and every step trains as in an uninterrupted run. The
    probe (live_job) checks NCCL's rules throughout. Steps are paced (tests/hooks/paced.py)
    until the layout of three is applied, so that training cannot end before it however
    slowly the second coordinator starts."""
    store, coordinator, worker, tmp_path = live_job
    _no_replicas(tmp_path, 4.4e7, 2)
    _damaging(monkeypatch, tmp_path, "snapshot:flip")
    pace = paced_while(monkeypatch, tmp_path, 4)
    processes = {w: worker(w, "--parcae-copy-interval", "2") for w in (0, 1)}
    monkeypatch.setenv("PARCAE_TEST_DAMAGE", "snapshot:truncate")
    processes[2] = worker(2, "--parcae-copy-interval", "2")  # on standby until the second coordinator
    wait_for(lambda: len(store.members()) == 3, 120, "three workers to register")
    first = coordinator("a")
    wait_for(lambda: any(isinstance(e, CopiesKept) and e.has_ward for e in worker_events(tmp_path)), 240,
             "a snapshot with copies on two instances")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    assert len(store.latest_plan().layout["slots"]) == 2
    _no_replicas(tmp_path, 4e7, 3)
    coordinator("b")
    grown = wait_for(lambda: store.current_generation() > 1 and len(store.latest_plan().layout["slots"]) == 3
                     and store.latest_plan(), 240, "the layout of three")
    wait_for(lambda: any(isinstance(e, CopiesKept) and e.generation == grown.generation and e.has_ward
                         for e in worker_events(tmp_path)), 240, "a snapshot with copies on three instances")
    pace.unlink()
    for w, p in processes.items():
        assert p.wait(timeout=400) == 0, (tmp_path / f"worker-{w}.log").read_text()[-3000:]
    kept = [e for e in worker_events(tmp_path) if isinstance(e, CopiesKept)]
    assert all(e.committed and e.has_ward for e in kept), kept
    assert sum(e.damaged for e in kept) == 2, kept
    # each layout allocates its own and its ward's host blocks once, retries included, and
    # they hold the snapshot and nothing else
    layouts = {e.generation for e in kept}
    for path in tmp_path.glob("worker-*.events.jsonl"):  # a layout's rank 0 reports its own
        mine = [e for e in read_events(path) if isinstance(e, CopiesKept)]
        assert not mine or mine[-1].allocations <= 2 * len(layouts), mine
    assert all(e.host_mib <= e.mib + CHUNK_MIB for e in kept), kept
    assert len([e for e in kept if e.generation == grown.generation]) >= 2, kept  # reused at least once
    assert sorted(p.name for p in (tmp_path / "damage").iterdir()) == ["snapshot-flip", "snapshot-truncate"]
    assert store.done() is not None and store.done().iteration == ITERS
    trained = logged_steps(worker_events(tmp_path))
    assert sorted({e.iteration for e in trained}) == list(range(1, ITERS + 1))
    for e in trained:
        assert_close({e.iteration: e.losses["lm loss"]}, {e.iteration: uninterrupted[e.iteration]})
