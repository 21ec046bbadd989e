"""Snapshots kept by buddies (reconfig/copies.py) and plans that recover from them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import SHAPE
from reconfig.copies import Snapshot
from reconfig.execute import Counters, HeldState
from reconfig.layout import Layout, Parallelism
from reconfig.placement import ONE_GPU, Placement, copy_holders
from reconfig.plan import Copies, LostStateError, MigrationPlan, MigrationRequest, plan_migration
from reconfig.tensors import ParamShard


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


def _data_parallel(workers: tuple[int, ...]) -> Layout:
    return Layout(Parallelism.even(SHAPE.num_layers, 1, 1, len(workers)), workers)


def _in_domains(gpus: int, domains: str, workers: tuple[int, ...]) -> Placement:
    """Instance k holds the k-th G of `workers` and is in failure domain domains[k] ("-": unknown)."""
    instance = {w: f"node-{r // gpus}" for r, w in enumerate(workers)}
    domain = {w: domains[r // gpus] for r, w in enumerate(workers) if domains[r // gpus] != "-"}
    return Placement(gpus, instance, domain)


def _shared(holders: dict[int, int], placement: Placement) -> int:
    """How many workers' copies are held in their own failure domain."""
    return sum(placement.domain(w) is not None and placement.domain(w) == placement.domain(h)
               for w, h in holders.items())


def test_buddies_are_in_the_other_failure_domain_of_two():
    workers = (5, 6, 7, 8)
    placement = _in_domains(1, "aabb", workers)  # in rank order, each buddy would share its domain once
    holders = copy_holders(_data_parallel(workers), placement)
    assert holders == {5: 7, 7: 6, 6: 8, 8: 5}
    assert _shared(holders, placement) == 0
    two_gpus = _in_domains(2, "aabb", tuple(range(8)))  # instances node-0 .. node-3
    holders = copy_holders(_data_parallel(tuple(range(8))), two_gpus)
    assert holders == {0: 4, 1: 5, 4: 2, 5: 3, 2: 6, 3: 7, 6: 0, 7: 1}  # each worker's G-th next, in a b a b
    assert _shared(holders, two_gpus) == 0


def test_uneven_failure_domains_share_buddies_only_past_half():
    workers = tuple(range(6))
    for domains, shared in [("aabbbc", 0), ("aaabbc", 0), ("aaaabc", 2), ("aaaaab", 4)]:
        placement = _in_domains(1, domains, workers)
        holders = copy_holders(_data_parallel(workers), placement)
        assert sorted(holders) == sorted(holders.values()) == list(workers)
        assert _shared(holders, placement) == shared, domains  # 2 * largest - instances, at least 0
    # the most populous domain first, rank order within a domain: a b a b a c
    assert copy_holders(_data_parallel(workers), _in_domains(1, "aaabbc", workers)) == \
        {0: 3, 3: 1, 1: 4, 4: 2, 2: 5, 5: 0}


def test_without_failure_domains_buddies_follow_the_ranks():
    workers = (9, 2, 7, 4, 0, 5)
    for gpus in (1, 2, 3):
        placement = _in_domains(gpus, "-" * 6, workers)
        assert not placement.domain_of and placement.to_dict().keys() == {"gpus_per_instance", "instances"}
        assert copy_holders(_data_parallel(workers), placement) == \
            {w: workers[(r + gpus) % len(workers)] for r, w in enumerate(workers)}
    # all in one domain, or unknown ones beside one named: the ranks' order still
    assert copy_holders(_data_parallel(workers), _in_domains(1, "aaaaaa", workers)) == \
        copy_holders(_data_parallel(workers), ONE_GPU)
    assert copy_holders(_data_parallel(workers), _in_domains(2, "-a-", workers)) == \
        copy_holders(_data_parallel(workers), _in_domains(2, "---", workers))


@given(st.integers(1, 3), st.lists(st.sampled_from("-abc"), min_size=2, max_size=9))
def test_buddies_are_a_rotation_across_as_many_domains_as_can_be(gpus, domains):
    workers = tuple(range(100, 100 + gpus * len(domains)))
    placement = _in_domains(gpus, "".join(domains), workers)
    holders = copy_holders(_data_parallel(workers), placement)
    assert sorted(holders) == sorted(holders.values()) == list(workers)  # one ward each
    assert all(placement.instance(w) != placement.instance(h) for w, h in holders.items())
    named = [d for d in domains if d != "-"]
    largest = max(map(named.count, named), default=0)
    assert _shared(holders, placement) == gpus * max(0, 2 * largest - len(domains))


def test_failure_domains_are_validated_and_travel_with_the_placement():
    placement = Placement(2, {0: "x", 1: "x", 2: "y"}, {0: "rack-1", 2: "rack-2"})
    assert Placement.from_dict(placement.to_dict()) == placement
    assert placement.domain(1) is None  # named on its instance's other worker only
    with pytest.raises(ValueError, match=r"instance\(s\) x are named in more than one failure domain"):
        Placement(2, {0: "x", 1: "x"}, {0: "rack-1", 1: "rack-2"})
    with pytest.raises(ValueError, match="placement.domains\\[3\\]: expected a failure domain name"):
        Placement(1, {}, {3: ""})
    with pytest.raises(ValueError, match="placement.domains: key 'a' is not a worker id"):
        Placement.from_dict({**placement.to_dict(), "domains": {"a": "rack-1"}})
    with pytest.raises(ValueError, match="unknown field"):
        Placement.from_dict({**placement.to_dict(), "zones": {}})


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


def test_a_snapshot_counts_a_dp_peers_copy_once_and_a_tensor_peers_twice():
    def held(tp_rank: int) -> HeldState:  # one parameter's shard of a T=2 layout, four fp32 values a key
        tensors = {"w": {key: torch.full((4,), float(tp_rank)) for key in ("param", "exp_avg", "exp_avg_sq")}}
        return HeldState({"w": ParamShard("w", tensors["w"]["param"], 0, 1)}, tensors, tp_rank, 2, Counters(3, 3, None))

    own = held(0)
    assert Snapshot(1, 10, 320, own, 5, own).nbytes() == 48  # the ward is a DP peer: its copy is this one
    assert Snapshot(1, 10, 320, own, 5, held(1)).nbytes() == 96  # the other tensor rank's shard, same names
    assert Snapshot(1, 10, 320, own, None, None).nbytes() == 48
