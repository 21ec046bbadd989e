"""Snapshots kept by buddies (reconfig/copies.py) and plans that recover from them."""

from __future__ import annotations

import pytest

from helpers import SHAPE
from reconfig.layout import Layout, Parallelism
from reconfig.placement import ONE_GPU, Placement, copy_holders
from reconfig.plan import Copies, LostStateError, MigrationPlan, MigrationRequest, plan_migration


def _pipeline(workers: tuple[int, ...]) -> Layout:
    return Layout(Parallelism.even(SHAPE.num_layers, 1, len(workers), 1), workers)


def test_each_worker_has_one_buddy_on_another_instance():
    layout = _pipeline((5, 6, 7, 8))
    holders = copy_holders(layout, ONE_GPU)
    assert holders == {5: 6, 6: 7, 7: 8, 8: 5}
    two_gpus = Placement(2, {5: "a", 6: "a", 7: "b", 8: "b"})
    holders = copy_holders(layout, two_gpus)
    assert sorted(holders.values()) == [5, 6, 7, 8]
    assert all(two_gpus.instance(w) != two_gpus.instance(h) for w, h in holders.items())
    assert copy_holders(_pipeline((5, 6)), Placement(2, {5: "a", 6: "a"})) == {}  # one instance: none


def test_a_stage_without_replica_is_refilled_from_its_buddys_copy():
    old = _pipeline((0, 1))
    lost_one = dict(survivors={0}, leaving=set(), joining={2})
    with pytest.raises(LostStateError):
        plan_migration(MigrationRequest(old, **lost_one), old.parallelism, SHAPE)
    copies = Copies(3, copy_holders(old, ONE_GPU))
    plan = plan_migration(MigrationRequest(old, **lost_one, copies=copies), old.parallelism, SHAPE)
    assert plan.new.slots == (0, 2)
    # stage 1 from worker 1's copy; the tied word embedding also from worker 0's own
    assert {(t.src, t.dst) for t in plan.transfers} == {(0, 2)}
    assert {t.unit for t in plan.transfers if t.copy_of == 1} >= {"layer.2", "layer.3"}
    assert all(t.src != t.dst for t in plan.transfers)
    again = MigrationPlan.from_dict(plan.to_dict())
    assert again == plan and again.request.copies == copies
    # a transfer may come only from the holder of the lost worker's copy
    bad = plan.to_dict()
    bad["transfers"][0]["copy_of"] = 0
    with pytest.raises(ValueError, match="holds no copy"):
        MigrationPlan.from_dict(bad)


def test_a_worker_lost_with_its_buddy_is_lost_state():
    old = _pipeline((0, 1, 2, 3))
    copies = Copies(1, copy_holders(old, ONE_GPU))  # 0 -> 1 -> 2 -> 3 -> 0
    request = MigrationRequest(old, {2, 3}, set(), {4, 5}, copies=copies)  # 0 and its holder 1 both gone
    with pytest.raises(LostStateError, match="layer"):
        plan_migration(request, old.parallelism, SHAPE)


def test_distributed_optimizer_shards_of_a_lost_replica_come_from_any_snapshot_of_its_column():
    old = Layout(Parallelism.even(SHAPE.num_layers, 1, 1, 2), (0, 1))
    request = dict(survivors={0}, leaving=set(), joining={2}, distributed_optimizer=True)
    with pytest.raises(LostStateError, match="optimizer"):
        plan_migration(MigrationRequest(old, **request), old.parallelism, SHAPE)
    plan = plan_migration(MigrationRequest(old, **request, copies=Copies(2, copy_holders(old, ONE_GPU))),
                          old.parallelism, SHAPE)
    assert plan.transfers and all(t.dst == 2 for t in plan.transfers)
    assert all(t.src != t.dst for t in plan.transfers)
    # the survivor's snapshot is its column's whole state: it keeps its own shard and
    # sends the lost one's, its own copy (not from the copy of worker 1, also its)
    assert {t.src for t in plan.transfers} == {0}


def test_copies_are_checked_when_read():
    with pytest.raises(ValueError, match="own copy"):
        Copies(1, {3: 3})
    with pytest.raises(ValueError, match="generation"):
        Copies(0, {3: 4})
    with pytest.raises(ValueError, match="pairs"):
        Copies.from_dict({"generation": 1, "holder": {"3": 4}})
