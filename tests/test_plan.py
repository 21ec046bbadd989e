"""reconfig.plan: property tests against an independent cell-by-cell model of who holds what."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconfig.layout import Layout, ModelShape, Parallelism
from reconfig.placement import Placement
from reconfig.plan import (
    OPTIMIZER,
    PARAMS,
    PARAMS_AND_OPTIMIZER,
    LostStateError,
    MigrationPlan,
    MigrationRequest,
    Transfer,
    plan_migration,
    plan_transfers,
)

# T and D are drawn from {1, 2, 4}: every slice is a whole number of cells of this grid.
CELLS = 4
# Sizes chosen so every slice of every unit is a whole number of bytes (no rounding).
SIZES = dict(num_attention_heads=4, hidden_size=48, ffn_hidden_size=192, vocab_size=96, max_position_embeddings=48)


def shape_of(kind: str, layers: int, tied: bool) -> ModelShape:
    return ModelShape(kind, layers, tied_embeddings=tied, **SIZES)


def state_names(distributed: bool) -> tuple[tuple[str, bool, int], ...]:
    """(state, sharded over DP, bytes per param) as the executor must treat them."""
    return ((PARAMS, False, 4), (OPTIMIZER, True, 8)) if distributed else ((PARAMS_AND_OPTIMIZER, False, 12),)


def holdings(layout: Layout, shape: ModelShape, worker: int, distributed: bool) -> dict:
    """{(unit, state): (split cells [axis0, axis1], replicated cells [axis1])} held in `layout`."""
    slot = layout.slot_of(worker)
    held = {}
    for unit in layout.parallelism.stage_units(shape, slot.pp):
        for state, sharded, _ in state_names(distributed):
            a0 = np.zeros(CELLS, bool)
            a0[slot.tp * CELLS // layout.tp:(slot.tp + 1) * CELLS // layout.tp] = True
            a1 = np.ones(CELLS, bool)
            if sharded:
                a1[:] = False
                a1[slot.dp * CELLS // layout.dp:(slot.dp + 1) * CELLS // layout.dp] = True
            held[unit.name, state] = (np.outer(a0, a1), a1.copy())
    return held


def cells(r: tuple[Fraction, Fraction]) -> np.ndarray:
    out = np.zeros(CELLS, bool)
    lo, hi = r[0] * CELLS, r[1] * CELLS
    assert lo.denominator == 1 and hi.denominator == 1, r
    out[int(lo):int(hi)] = True
    return out


def region(t: Transfer) -> tuple[np.ndarray, np.ndarray]:
    a1 = cells(t.shard_range)
    split = np.outer(cells(t.split_range), a1) if t.split_range is not None else np.zeros((CELLS, CELLS), bool)
    return split, (a1 if t.replicated else np.zeros(CELLS, bool))


def check_plan(plan: MigrationPlan, shape: ModelShape) -> None:
    """Every needed cell of every destination is kept or received exactly once, from a live
    holder, leaving workers only when no survivor holds it, with exact byte counts."""
    request, distributed = plan.request, plan.request.distributed_optimizer
    old = request.old
    old_held = {w: holdings(old, shape, w, distributed) for w in old.slots}
    received = {w: {} for w in plan.new.slots}
    bpp = {state: b for state, _, b in state_names(distributed)}
    for t in plan.transfers:
        assert t.src != t.dst and t.dst in plan.new.workers
        assert t.src in request.survivors or t.src in request.leaving
        split, repl = region(t)
        assert split.any() or repl.any()
        src_split, src_repl = old_held[t.src][t.unit, t.state]  # KeyError: source does not hold the unit
        assert not (split & ~src_split).any() and not (repl & ~src_repl).any(), "source lacks the slice"
        if t.src in request.leaving:
            for w in request.survivors:
                s_split, s_repl = old_held[w].get((t.unit, t.state), (None, None))
                assert s_split is None or (split & ~s_split).any() or (repl & ~s_repl).any(), \
                    "leaving worker sends what a survivor holds"
        unit = shape.unit(t.unit)
        exact = bpp[t.state] * (Fraction(unit.split_params * int(split.sum()), CELLS * CELLS)
                                + Fraction(unit.replicated_params * int(repl.sum()), CELLS))
        assert exact.denominator == 1 and t.nbytes == exact, (t, exact)
        got = received[t.dst].setdefault((t.unit, t.state), [np.zeros((CELLS, CELLS), int), np.zeros(CELLS, int)])
        got[0] += split
        got[1] += repl
    for w in plan.new.slots:
        need = holdings(plan.new, shape, w, distributed)
        kept = old_held.get(w, {}) if w in request.survivors else {}
        assert set(received[w]) <= set(need), "received a unit the slot does not need"
        for key, (n_split, n_repl) in need.items():
            unit = shape.unit(key[0])
            k_split, k_repl = kept.get(key, (np.zeros_like(n_split), np.zeros_like(n_repl)))
            r_split, r_repl = received[w].get(key, (np.zeros(n_split.shape, int), np.zeros(n_repl.shape, int)))
            if unit.split_params:
                assert ((r_split + (k_split & n_split)) == n_split).all(), (w, key)
            else:
                assert not r_split.any()
            if unit.replicated_params:
                assert ((r_repl + (k_repl & n_repl)) == n_repl).all(), (w, key)
            else:
                assert not r_repl.any()
    if plan.kind in ("none", "intra-stage"):
        assert plan.bytes_total() == 0
    assert plan.uses_grace_period == any(t.src in request.leaving for t in plan.transfers)


def lost_units(request: MigrationRequest, shape: ModelShape) -> dict[str, set[str]]:
    """Per state, units with some cell that no survivor or leaving worker holds."""
    covered: dict = {}
    for w in request.survivors | request.leaving:
        for key, (split, repl) in holdings(request.old, shape, w, request.distributed_optimizer).items():
            c = covered.setdefault(key, [np.zeros((CELLS, CELLS), bool), np.zeros(CELLS, bool)])
            c[0] |= split
            c[1] |= repl
    lost: dict[str, set[str]] = {state: set() for state, _, _ in state_names(request.distributed_optimizer)}
    for unit in shape.units():
        for state, sharded, _ in state_names(request.distributed_optimizer):
            split, repl = covered.get((unit.name, state), (np.zeros((CELLS, CELLS), bool), np.zeros(CELLS, bool)))
            if (unit.split_params and not split.all()) or (unit.replicated_params and not repl.all()):
                lost[state].add(unit.name)
    return lost


def partitions(layers: int, pp: int) -> list[tuple[int, ...]]:
    """Every stage_layers megatron-core can build: first and last free, the rest equal."""
    if pp == 1:
        return [(layers,)]
    out = []
    for middle in range(1, layers + 1) if pp > 2 else [0]:
        for first in range(1, layers):
            last = layers - first - middle * (pp - 2)
            if last >= 1:
                out.append((first,) + (middle,) * (pp - 2) + (last,))
    return out


@st.composite
def parallelisms(draw, layers: int, max_world: int = 32) -> Parallelism:
    while True:
        tp, pp, dp = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, min(4, layers))), draw(
            st.sampled_from([1, 2, 4]))
        if tp * pp * dp <= max_world:
            return Parallelism(tp, pp, dp, draw(st.sampled_from(partitions(layers, pp))))


@st.composite
def requests(draw) -> tuple[MigrationRequest, ModelShape, Parallelism]:
    layers = draw(st.integers(2, 6))
    shape = shape_of(draw(st.sampled_from(["gpt", "bert"])), layers, draw(st.booleans()))
    old_p = draw(parallelisms(layers))
    workers = draw(st.permutations(range(old_p.world_size)))
    old = Layout(old_p, tuple(workers))
    fates = draw(st.lists(st.sampled_from(["survive"] * 6 + ["leave", "lost"]), min_size=old_p.world_size,
                          max_size=old_p.world_size))
    survivors = {w for w, f in zip(workers, fates) if f == "survive"}
    leaving = {w for w, f in zip(workers, fates) if f == "leave"}
    joining = set(range(100, 100 + draw(st.integers(0, 6))))
    request = MigrationRequest(old, frozenset(survivors), frozenset(leaving), frozenset(joining),
                               draw(st.booleans()))
    target = draw(parallelisms(layers, max_world=max(1, len(survivors) + len(joining))))
    return request, shape, target


def identity_like(request: MigrationRequest, target: Parallelism) -> Layout:
    """Survivors keep their old rank where it exists; the rest fill remaining ranks in order."""
    old = request.old.slots
    slots = [old[r] if r < len(old) and old[r] in request.survivors else None for r in range(target.world_size)]
    spare = iter(sorted(request.survivors - set(slots)) + sorted(request.joining))
    return Layout(target, tuple(w if w is not None else next(spare) for w in slots))


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(requests())
def test_plans_cover_exactly_from_live_holders(case) -> None:
    request, shape, target = case
    if len(request.available) < target.world_size:
        with pytest.raises(ValueError, match="workers, only"):
            plan_migration(request, target, shape)
        return
    lost = lost_units(request, shape)
    first_lost = next((state for state, units in lost.items() if units), None)
    if first_lost is not None:
        with pytest.raises(LostStateError) as info:
            plan_migration(request, target, shape)
        assert info.value.state == first_lost and set(info.value.lost_units) == lost[first_lost]
        return
    plan = plan_migration(request, target, shape)
    check_plan(plan, shape)
    identity = plan_transfers(request, identity_like(request, target), shape)
    check_plan(identity, shape)
    assert plan.bytes_total() <= identity.bytes_total()
    assert plan.standby == request.available - plan.new.workers
    # survivors never wait on standby while a joining worker takes a slot
    assert len(plan.new.workers & request.survivors) == min(len(request.survivors), target.world_size)


def needed_bytes(request: MigrationRequest, shape: ModelShape, worker: int, target: Layout, rank: int) -> int:
    """Bytes `worker` lacks for rank `rank` of `target`, from the cell model alone."""
    probe = Layout(target.parallelism, tuple(range(10_000, 10_000 + target.parallelism.world_size)))
    need = holdings(probe, shape, probe.slots[rank], request.distributed_optimizer)
    kept = holdings(request.old, shape, worker, request.distributed_optimizer) if worker in request.survivors else {}
    bpp = {state: b for state, _, b in state_names(request.distributed_optimizer)}
    total = Fraction(0)
    for (name, state), (n_split, n_repl) in need.items():
        unit = shape.unit(name)
        k_split, k_repl = kept.get((name, state), (np.zeros_like(n_split), np.zeros_like(n_repl)))
        total += bpp[state] * (Fraction(unit.split_params * int((n_split & ~k_split).sum()), CELLS * CELLS)
                               + Fraction(unit.replicated_params * int((n_repl & ~k_repl).sum()), CELLS))
    return int(total)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_matching_is_optimal_on_small_cases(case) -> None:
    """Brute force over every assignment of available workers to the (at most 4) slots."""
    request, shape, target = case
    if target.world_size > min(4, len(request.available)) or any(lost_units(request, shape).values()):
        return
    plan = plan_migration(request, target, shape)
    candidates = sorted(request.available)
    probe = Layout(target, tuple(range(10_000, 10_000 + target.world_size)))
    cost = {(w, r): needed_bytes(request, shape, w, probe, r) for w in candidates for r in range(target.world_size)}
    best = min(sum(cost[w, r] for r, w in enumerate(p))
               for p in itertools.permutations(candidates, target.world_size))
    assert plan.bytes_total() == best


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.sampled_from([1, 2, 4]), st.integers(1, 3), st.sampled_from([2, 4]), st.data())
def test_intra_stage_moves_no_model_state(layers: int, tp: int, pp: int, dp: int, data) -> None:
    """A D-replicated layout that keeps a replica of every (stage, tp) column needs no bytes
    to shrink D to the fewest survivors of any column (plain optimizer)."""
    shape = shape_of("gpt", layers, True)
    pp = min(pp, layers)
    old_p = Parallelism.even(layers, tp, pp, dp) if layers % pp == 0 else Parallelism(
        tp, pp, dp, partitions(layers, pp)[0])
    old = Layout(old_p, tuple(range(old_p.world_size)))
    lost = set()
    per_column = []
    for stage in range(pp):
        for t in range(tp):
            column = [old.slots[t + tp * (d + dp * stage)] for d in range(dp)]
            gone = data.draw(st.lists(st.sampled_from(column), max_size=dp - 1, unique=True))
            lost.update(gone)
            per_column.append(dp - len(gone))
    request = MigrationRequest(old, frozenset(old.slots) - lost, frozenset(), frozenset())
    plan = plan_migration(request, Parallelism(tp, pp, min(per_column), old_p.stage_layers), shape)
    check_plan(plan, shape)
    assert plan.transfers == () and plan.bytes_total() == 0
    assert plan.kind == ("intra-stage" if lost else "none")


GPT = shape_of("gpt", 4, True)


def grid(tp: int, pp: int, dp: int, layers: int = 4, first: int = 0) -> Layout:
    p = Parallelism.even(layers, tp, pp, dp)
    return Layout(p, tuple(range(first, first + p.world_size)))


def test_lost_layers_are_named() -> None:
    old = grid(1, 2, 2)  # stage 1 (layers 2-3, head) on workers 2 and 3
    request = MigrationRequest(old, frozenset({0, 1}), frozenset(), frozenset({8, 9}))
    with pytest.raises(LostStateError, match=r"^layers 2-3, head lost \(params\+optimizer\): no surviving replica "
                                             r"and no notice \(workers lost without notice: 2, 3\)$") as info:
        plan_migration(request, Parallelism.even(4, 1, 2, 2), GPT)
    assert info.value.lost_units == ("layer.2", "layer.3", "head")


def test_distributed_optimizer_loses_a_column_with_one_member() -> None:
    old = grid(1, 2, 2)
    request = MigrationRequest(old, frozenset({0, 1, 2}), frozenset(), frozenset(), distributed_optimizer=True)
    with pytest.raises(LostStateError, match=r"layers 2-3, head lost \(optimizer\)"):
        plan_migration(request, Parallelism.even(4, 1, 2, 1), GPT)
    # With notice the leaving member hands its shard over: a grace-period, inter-stage plan.
    request = MigrationRequest(old, frozenset({0, 1, 2}), frozenset({3}), frozenset(), distributed_optimizer=True)
    plan = plan_migration(request, Parallelism.even(4, 1, 2, 1), GPT)
    check_plan(plan, GPT)
    assert plan.kind == "inter-stage" and plan.uses_grace_period
    assert {t.state for t in plan.transfers} == {OPTIMIZER}


def test_grace_period_hand_over() -> None:
    old = grid(1, 2, 2)
    request = MigrationRequest(old, frozenset({0, 1}), frozenset({2, 3}), frozenset({7}))
    plan = plan_migration(request, Parallelism.even(4, 1, 2, 1), GPT)
    check_plan(plan, GPT)
    assert plan.uses_grace_period and plan.kind == "inter-stage"
    stage1 = plan.new.worker_at(plan.new.parallelism.slot(1))
    assert {t.src for t in plan.transfers if t.dst == stage1} <= {2, 3}
    # a stage-0 survivor takes stage 1: it already holds the tied word embedding the last stage needs
    assert stage1 in {0, 1} and plan.standby == {7}
    assert {t.unit for t in plan.transfers if t.dst == stage1} == {"layer.2", "layer.3", "head"}


def test_senders_are_balanced() -> None:
    old = grid(1, 1, 4)
    request = MigrationRequest(old, frozenset(range(4)), frozenset(), frozenset(range(10, 14)))
    plan = plan_migration(request, Parallelism.even(4, 1, 1, 8), GPT)
    sent = {w: 0 for w in range(4)}
    for t in plan.transfers:
        sent[t.src] += t.nbytes
    largest = max(t.nbytes for t in plan.transfers)
    assert max(sent.values()) - min(sent.values()) <= largest
    assert plan.new.slots[:4] == (0, 1, 2, 3)  # survivors keep their ranks


@pytest.mark.parametrize("old, target, kind", [
    (grid(2, 2, 1), Parallelism.even(4, 2, 2, 1), "none"),
    (grid(2, 2, 1), Parallelism.even(4, 1, 2, 2), "tensor"),
    (grid(2, 2, 1), Parallelism.even(4, 4, 1, 1), "tensor"),  # T and P both change
    (grid(2, 2, 1), Parallelism.even(4, 2, 1, 2), "pipeline"),
    (grid(1, 2, 2), Parallelism(1, 2, 2, (1, 3)), "pipeline"),
])
def test_classification(old: Layout, target: Parallelism, kind: str) -> None:
    request = MigrationRequest(old, old.workers, frozenset(), frozenset())
    plan = plan_migration(request, target, GPT)
    check_plan(plan, GPT)
    assert plan.kind == kind
    assert (plan.bytes_total() == 0) == (kind == "none")


def test_too_few_workers() -> None:
    old = grid(1, 2, 1)
    request = MigrationRequest(old, frozenset({0, 1}), frozenset(), frozenset())
    with pytest.raises(ValueError, match=r"target 1x2x2 \(tp x pp x dp\) needs 4 workers, only 2 are available"):
        plan_migration(request, Parallelism.even(4, 1, 2, 2), GPT)


def test_plan_transfers_rejects_unavailable_worker() -> None:
    old = grid(1, 2, 1)
    request = MigrationRequest(old, frozenset({0}), frozenset({1}), frozenset({5}))
    with pytest.raises(ValueError, match=r"worker\(s\) \[1\] are neither survivors nor joining"):
        plan_transfers(request, Layout(Parallelism.even(4, 1, 2, 1), (0, 1)), GPT)


def sample_plan() -> MigrationPlan:
    old = grid(2, 2, 1)
    request = MigrationRequest(old, frozenset({0, 1, 2}), frozenset({3}), frozenset({4}), distributed_optimizer=True)
    return plan_migration(request, Parallelism.even(4, 1, 2, 2), GPT)


def test_plan_json_round_trip() -> None:
    plan = sample_plan()
    assert plan.transfers and plan.uses_grace_period
    data = json.loads(json.dumps(plan.to_dict()))
    assert MigrationPlan.from_dict(data) == plan
    assert MigrationPlan.from_dict(data).bytes_by_link() == plan.bytes_by_link()
    assert sum(plan.bytes_by_link().values()) == plan.bytes_total()


def mutated(path: list, value) -> dict:
    data = json.loads(json.dumps(sample_plan().to_dict()))
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    (["kind"], "sideways", "plan.kind: expected one of none, intra-stage"),
    (["uses_grace_period"], False, "plan.uses_grace_period: is False, the transfers say True"),
    (["transfers", 0, "src"], 2.5, r"plan.transfers\[0\].src: expected an integer"),
    (["transfers", 0, "src"], 42, r"plan.transfers\[0\].src: worker 42 is neither a survivor nor leaving"),
    (["transfers", 0, "dst"], 3, r"plan.transfers\[0\].dst: worker 3 has no slot in the new layout"),
    (["transfers", 0, "state"], "weights", r"plan.transfers\[0\].state: expected one of"),
    (["transfers", 0, "shard_range"], ["1/2", "1/0"], r"plan.transfers\[0\].shard_range: expected"),
    (["transfers", 0, "shard_range"], ["1/2", "3/2"], r"plan.transfers\[0\].shard_range: 1/2..3/2 is not"),
    (["transfers", 0, "shard_range"], ["__import__('os')", "1"], r"plan.transfers\[0\].shard_range: expected"),
    (["transfers", 0, "nbytes"], -1, r"plan.transfers\[0\].nbytes: must be >= 0"),
    (["request", "survivors"], [0, 1, 2, 3], r"request: worker\(s\) \[3\] both survive and leave"),
    (["request", "joining"], [0, 4], r"request.joining: worker\(s\) \[0\] hold a slot in the old layout"),
    (["request", "leaving"], [17], r"request.leaving: worker\(s\) \[17\] have no slot in the old layout"),
    (["request", "survivors"], "012", "request.survivors: expected a list of worker ids"),
    (["request", "distributed_optimizer"], 1, "request.distributed_optimizer: expected true or false"),
    (["new", "slots"], [0, 1, 2, 9], r"new layout: worker\(s\) \[9\] are neither survivors nor joining"),
])
def test_plan_validation_names_the_field(path: list, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MigrationPlan.from_dict(mutated(path, value))


def test_transfer_must_send_something() -> None:
    data = sample_plan().transfers[0].to_dict()
    with pytest.raises(ValueError, match="transfer: sends neither split nor replicated params"):
        Transfer.from_dict({**data, "split_range": None, "replicated": False})


# -- instances of several GPUs -------------------------------------------------------

def on_instances(*instances: tuple[int, ...]) -> Placement:
    """Instances of two GPUs named a, b, c, ... holding the given workers."""
    return Placement(2, {w: "abcdefgh"[i] for i, workers in enumerate(instances) for w in workers})


def blocks_of(plan: MigrationPlan) -> list[set[str]]:
    placement = plan.request.placement
    return [{placement.instance(plan.new.slots[r]) for r in block}
            for block in placement.blocks(plan.new.parallelism.world_size)]


def test_an_instance_preempted_with_notice_hands_its_block_to_an_arriving_instance() -> None:
    old = grid(2, 2, 1)  # ranks 0-1 (stage 0) on instance a, ranks 2-3 (stage 1) on b
    placement = on_instances((0, 1), (2, 3), (4, 5))
    request = MigrationRequest(old, frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}), placement=placement)
    plan = plan_migration(request, old.parallelism, GPT)
    check_plan(plan, GPT)
    assert plan.new.slots[:2] == (0, 1) and set(plan.new.slots[2:]) == {4, 5}
    assert blocks_of(plan) == [{"a"}, {"c"}]
    assert plan.uses_grace_period and {t.src for t in plan.transfers if t.unit.startswith("layer")} == {2, 3}


def test_tensor_parallel_groups_never_cross_an_instance() -> None:
    old = grid(1, 1, 4)
    placement = on_instances((0, 2), (1, 3))  # worker ids interleaved over the instances
    request = MigrationRequest(old, old.workers, frozenset(), frozenset(), placement=placement)
    plan = plan_migration(request, Parallelism.even(4, 2, 1, 2), GPT)
    check_plan(plan, GPT)
    assert blocks_of(plan) == [{"a"}, {"b"}] or blocks_of(plan) == [{"b"}, {"a"}]
    with pytest.raises(ValueError, match="tensor-parallel size 4 does not divide the 2 GPUs of an instance"):
        plan_migration(request, Parallelism.even(4, 4, 1, 1), GPT)


def test_a_block_needs_an_instance_with_enough_workers() -> None:
    old = grid(1, 1, 4)
    placement = on_instances((0, 1), (2,), (3,))  # b and c each lost a worker without notice
    request = MigrationRequest(old, old.workers, frozenset(), frozenset(), placement=placement)
    assert blocks_of(plan_migration(request, Parallelism.even(4, 1, 1, 3), GPT))[0] == {"a"}
    with pytest.raises(ValueError, match="needs 2 instances with up to 2 live workers each"):
        plan_migration(request, Parallelism.even(4, 2, 1, 2), GPT)


def test_senders_on_the_receivers_instance_come_first() -> None:
    old = grid(2, 1, 2)  # replica 0 (TP halves) on instance a, replica 1 on b
    placement = on_instances((0, 1), (2, 3))
    request = MigrationRequest(old, old.workers, frozenset(), frozenset(), placement=placement)
    plan = plan_migration(request, Parallelism.even(4, 1, 1, 4), GPT)  # everyone needs the other half
    check_plan(plan, GPT)
    assert plan.transfers
    assert all(placement.instance(t.src) == placement.instance(t.dst) for t in plan.transfers)


def test_placement_is_validated_and_travels_with_the_plan() -> None:
    with pytest.raises(ValueError, match=r"instance\(s\) a run more than 2 workers"):
        Placement(2, {0: "a", 1: "a", 2: "a"})
    with pytest.raises(ValueError, match="placement.gpus_per_instance: must be >= 1"):
        Placement(0)
    old = grid(2, 2, 1)
    placement = on_instances((0, 1), (2, 3), (4, 5))
    request = MigrationRequest(old, frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}), placement=placement)
    plan = plan_migration(request, old.parallelism, GPT)
    data = json.loads(json.dumps(plan.to_dict()))
    assert MigrationPlan.from_dict(data) == plan
    data["new"]["slots"] = [0, 4, 1, 5]  # blocks split over instances
    with pytest.raises(ValueError, match=r"ranks 0-1 are placed on several instances \(a, c\)"):
        MigrationPlan.from_dict(data)
    data["request"]["placement"]["instances"] = {"x": "a"}
    with pytest.raises(ValueError, match="placement.instances: key 'x' is not a worker id"):
        MigrationPlan.from_dict(data)


def test_fresh_layouts_are_placed_a_block_per_instance() -> None:
    placement = on_instances((0, 1), (2,), (3, 4))
    assert placement.assign(Parallelism.even(4, 2, 1, 2), [0, 1, 2, 3, 4]) == (0, 1, 3, 4)
    assert placement.assign(Parallelism.even(4, 1, 1, 5), [0, 1, 2, 3, 4]) == (0, 1, 3, 4, 2)
    with pytest.raises(ValueError, match="needs 3 instances"):
        placement.assign(Parallelism.even(4, 2, 1, 3), [0, 1, 2, 3, 4])
