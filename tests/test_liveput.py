"""Liveput optimizer, throughput and cost models (issue 5, acceptance 3)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

from megatron_parcae.control.coordinator import ConfigError, CoordinatorConfig
from megatron_parcae.liveput.cost import (
    DEFAULT_CONSTANTS,
    CostConstants,
    CostConstantsError,
    MigrationCostModel,
    ParcaeCostModel,
    rank_groups,
)
from megatron_parcae.liveput.factory import build_liveput
from megatron_parcae.liveput.optimizer import OVERRUN_GRID, LiveputOptimizer, outlook, overrun
from megatron_parcae.liveput.scenarios import (
    ScenarioCosts,
    StepOutlook,
    SuddenLosses,
    canonical_placement,
    copies_recovery_probability,
    instances_used,
    preemption_distribution,
    victims_distribution,
    wipe_probability,
)
from megatron_parcae.liveput.throughput import ForModels, OnInstances, PipelineModel, ProfileError, ProfileTable
from predictor.forecast import AvailabilityForecast
from reconfig.layout import Layout, ModelShape, Parallelism, balanced_partition
from reconfig.placement import copy_holders
from reconfig.plan import Copies, LostStateError, MigrationRequest, plan_migration

import helpers

ANCHORS = str(helpers.ANCHORS)
CONSTANTS = CostConstants.load()
GPT_1_5B = CONSTANTS.model("gpt-1.5b")
TINY = ModelShape("gpt", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128,
                  max_position_embeddings=32)
# (T, P, D) -> samples/s: a small table with replicas and pipelines to choose between
TINY_RATES = {(1, 1, 1): 1.0, (1, 2, 1): 1.7, (1, 1, 2): 1.9, (1, 4, 1): 2.6, (1, 2, 2): 3.3,
              (1, 1, 3): 2.7, (1, 2, 3): 4.4, (1, 4, 2): 4.1}


def tiny_table() -> ProfileTable:
    return ProfileTable(TINY_RATES, "tiny", 12, TINY)


def certain_forecast(counts: list[int], preemptions: list[int]) -> AvailabilityForecast:
    counts_f = np.array(counts, dtype=float)
    return AvailabilityForecast(60.0, counts_f, {0.1: counts_f, 0.5: counts_f, 0.9: counts_f},
                                np.array(preemptions, dtype=float), np.zeros(len(counts)))


# ---- throughput models -------------------------------------------------------------------

def test_profile_table_reads_parcae_table():
    table = ProfileTable.load(f"{ANCHORS}/gpt-1.5b.csv", GPT_1_5B)
    assert table.model == "gpt-1.5b" and table.global_batch_size == 128
    best = table.best(32)
    assert (best.tp, best.pp, best.dp) == (1, 8, 4)
    assert table.samples_per_second(best) == pytest.approx(43.468)
    assert table.best(5) is None  # GPT-1.5B needs at least 6 stages in Parcae's table
    assert all(sum(p.stage_layers) == 48 for p in table.layouts())


@pytest.mark.parametrize("text, message", [
    ("data_parallel,pipeline_stages,iteration_ms\n1,2,3\n", "lacks column(s) samples_per_s"),
    ("data_parallel,pipeline_stages,iteration_ms,samples_per_s\n1,two,3,4\n",
     ":2: column pipeline_stages: expected a positive integer, got 'two'"),
    ("data_parallel,pipeline_stages,iteration_ms,samples_per_s\n1,2,abc,4\n", ":2: column iteration_ms: expected a positive"),
    ("data_parallel,pipeline_stages,iteration_ms,samples_per_s\n1,2,3,-4\n", ":2: column samples_per_s: expected"),
    ("data_parallel,pipeline_stages,iteration_ms,samples_per_s\n1,2,3,4\n1,2,3,5\n", ":3: configuration"),
    ("data_parallel,pipeline_stages,iteration_ms,samples_per_s\n1,2,3\n", ":2: 3 fields"),
    ("# only a comment\n", "no configurations"),
])
def test_profile_table_rejects_malformed_rows(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ProfileError, match=re.escape(message)):
        ProfileTable.load(path, GPT_1_5B)


def tiny_layer_profile(**overrides) -> dict:
    unit = {"forward_ms": 2.0, "backward_ms": 4.0, "optimizer_ms": 0.5, "activation_bytes": 1e6, "output_bytes": 1e5}
    profile = {"format": "megatron-parcae-layer-profile", "version": 1, "model": "tiny", "device": "test",
               "micro_batch_size": 1, "global_batch_size": 8, "gpu_memory_bytes": 1e9,
               "link_bytes_per_second": 1.25e9, "tensor_parallel_bytes_per_second": 1e11, "max_tensor_parallel": 4,
               "memory_bytes_per_param": 16, "gradient_bytes_per_param": 2, "model_shape": TINY.to_dict(),
               "embedding": dict(unit), "layers": [dict(unit) for _ in range(4)], "head": dict(unit)}
    profile.update(overrides)
    return profile


def test_pipeline_model_excludes_infeasible_layouts():
    model = PipelineModel(tiny_layer_profile(), max_workers=16)
    layouts = model.layouts()
    assert layouts, "some layout must fit"
    # D must split the global batch of 8 into whole micro-batches; T must divide 4 heads
    assert all(8 % p.dp == 0 and 4 % p.tp == 0 and p.world_size <= 16 for p in layouts)
    assert Parallelism(1, 1, 3, (4,)) not in layouts
    assert model.samples_per_second(Parallelism(1, 1, 3, (4,))) == 0.0
    # more replicas train faster on this compute-bound profile
    assert model.samples_per_second(Parallelism(1, 1, 2, (4,))) > model.samples_per_second(Parallelism(1, 1, 1, (4,)))
    # a GPU too small for the whole model's activations needs them split over stages or TP ranks
    small = PipelineModel(tiny_layer_profile(gpu_memory_bytes=3.5e6), max_workers=16)
    assert small.layouts() and all(p.tp * p.pp >= 2 for p in small.layouts())
    assert small.samples_per_second(Parallelism(1, 1, 1, (4,))) == 0.0


def test_a_table_keeps_the_layouts_the_workers_models_can_be_built_in():
    table = ProfileTable({(1, 1, 2): 1.0, (2, 1, 1): 2.0, (4, 1, 1): 3.0}, "tiny", 8, TINY)
    two_groups = dataclasses.replace(TINY, num_query_groups=2)
    assert ForModels(table, ()).layouts() == ForModels(table, [TINY]).layouts() == table.layouts()
    kept = ForModels(table, [TINY, two_groups])
    assert [(p.tp, p.dp) for p in kept.layouts()] == [(1, 2), (2, 1)]
    assert kept.samples_per_second(Parallelism(2, 1, 1, (4,))) == 2.0
    assert kept.samples_per_second(Parallelism(4, 1, 1, (4,))) == 0.0 and kept.best(4).tp == 2
    deeper = dataclasses.replace(TINY, num_layers=6, num_query_groups=1)
    with pytest.raises(ProfileError, match=re.escape(
            "profile of tiny: no layout of it can train the workers' model: layers per stage: sums to 4, the model "
            "has 6 layers; --num-query-groups 1 is not divisible by tensor-parallel size 2; --num-query-groups 1 is "
            "not divisible by tensor-parallel size 4")):
        ForModels(table, [deeper])


def test_pipeline_model_rejects_bad_profile(tmp_path):
    with pytest.raises(ProfileError, match="layers: expected a list of 4"):
        PipelineModel(tiny_layer_profile(layers=[]), max_workers=4)
    with pytest.raises(ProfileError, match="gpu_memory_bytes: expected a positive number"):
        PipelineModel(tiny_layer_profile(gpu_memory_bytes=-1), max_workers=4)
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        PipelineModel.load(path, 4)


# ---- cost model ----------------------------------------------------------------------------

def test_cost_constants_validate_and_interpolate(tmp_path):
    c = CONSTANTS
    assert c.interval_seconds == 60
    assert c.transfer_seconds(1048576) == pytest.approx(1428.108e-6)
    between = c.transfer_seconds(1.5 * 1048576)
    assert 1428.108e-6 < between < 3006.771e-6
    assert c.transfer_seconds(4 * 1073741824) == pytest.approx(4 * 1198255.9e-6)
    data = json.loads(DEFAULT_CONSTANTS.read_text())
    data["rendezvous_seconds"] = "six"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CostConstantsError, match="rendezvous_seconds: expected a non-negative number"):
        CostConstants.load(path)


def test_a_measured_network_times_messages_between_instances_and_leaves_a_table_be():
    """The network the workers measured replaces the p2p table: each message takes the
    latency plus its bytes at the rate, at every size a change sends; a throughput table,
    measured on its own network, has no link to replace."""
    measured = CONSTANTS.on_network(2e-4, 5e8)
    for nbytes in (1, 4096, 2**20, 2**30, 2**42):
        assert measured.transfer_seconds(nbytes) == pytest.approx(2e-4 + nbytes / 5e8, rel=1e-6)
    assert measured.transfer_seconds(0) == 0.0
    assert dataclasses.replace(measured, p2p_bytes=CONSTANTS.p2p_bytes, p2p_seconds=CONSTANTS.p2p_seconds) == CONSTANTS
    table = tiny_table()
    assert table.with_link(1e6) is table and table.link_bytes_per_second is None


def gpt_layout(tp: int, pp: int, dp: int) -> Layout:
    p = Parallelism(tp, pp, dp, balanced_partition(48, pp))
    return Layout(p, tuple(range(p.world_size)))


def test_intra_stage_change_moves_nothing_but_rebuilds_every_chunk():
    """The executor drops the old layout and builds the new one on every worker, drawing
    each weight whole whatever its TP rank; the parts happen one after another."""
    costs = MigrationCostModel(CONSTANTS, GPT_1_5B)
    old = gpt_layout(1, 8, 4)
    lost = old.worker_at(old.parallelism.slot(5))
    request = MigrationRequest(old, old.workers - {lost}, frozenset(), frozenset())
    plan = plan_migration(request, Parallelism(1, 8, 3, old.stage_layers), GPT_1_5B)
    cost = costs.plan_cost(plan)
    layer = GPT_1_5B.unit("layer.0").params
    assert plan.kind == "intra-stage"
    assert cost.transfer_seconds == 0 and not cost.restart
    assert cost.build_seconds == pytest.approx(6 * layer * CONSTANTS.model_build_seconds_per_param)
    assert cost.seconds == pytest.approx(cost.world_seconds + cost.groups_seconds + cost.staging_seconds
                                         + cost.build_seconds)
    assert costs.layer_params(Parallelism(5, 8, 1, old.stage_layers), 0) == 6 * layer


def test_pipeline_change_costs_build_and_transfer_and_restart_costs_more():
    costs = MigrationCostModel(CONSTANTS, GPT_1_5B)
    old = gpt_layout(1, 8, 4)
    request = MigrationRequest(old, old.workers, frozenset(), frozenset())
    target = Parallelism(1, 10, 3, balanced_partition(48, 10))
    cost = costs.plan_cost(plan_migration(request, target, GPT_1_5B))
    assert cost.build_seconds > 0 and cost.transfer_seconds > 0
    restart = costs.restart_cost(target, joining=False)
    assert restart.restart and restart.seconds > cost.seconds + CONSTANTS.checkpoint_save_load_seconds


def test_phases_add_up_to_the_cost_and_their_rates_are_fitted_on_measured_phases():
    """What a job measures of its changes (phase seconds, as LayoutChange reports them)
    gives back the per-byte, per-change, per-group and per-parameter rates they were
    made with, whatever the kinds; the fitted model prices whole changes by them."""
    costs = MigrationCostModel(CONSTANTS, GPT_1_5B)
    old, small = gpt_layout(1, 8, 4), gpt_layout(1, 4, 5)
    lost = old.worker_at(old.parallelism.slot(5))
    everyone = MigrationRequest(old, old.workers, frozenset(), frozenset())
    plans = [plan_migration(MigrationRequest(old, old.workers - {lost}, frozenset(), frozenset()),
                            Parallelism(1, 8, 3, old.stage_layers), GPT_1_5B),
             plan_migration(everyone, Parallelism(1, 10, 3, balanced_partition(48, 10)), GPT_1_5B),
             plan_migration(everyone, Parallelism(1, 4, 8, balanced_partition(48, 4)), GPT_1_5B),
             plan_migration(MigrationRequest(small, small.workers, frozenset(), frozenset()),
                            Parallelism(5, 4, 1, small.stage_layers), GPT_1_5B)]
    assert {p.kind for p in plans} == {"intra-stage", "pipeline", "tensor"}
    for plan in plans:
        assert sum(costs.phase_seconds(plan).values()) == pytest.approx(costs.plan_cost(plan).seconds)
    rates = {"export": {"bytes": 1e-9}, "world": {"changes": 0.2}, "exchange": {"bytes": 3e-9},
             "build": {"groups": 0.05, "parameters": 2e-8}, "import": {"bytes": 4e-10}}
    truth = MigrationCostModel(CONSTANTS, GPT_1_5B, rates)
    fitted = costs.fitted([(plan, truth.phase_seconds(plan)) for plan in plans])
    for phase, quantities in rates.items():
        assert fitted.phase_rates[phase] == pytest.approx(quantities, rel=1e-6)
    for plan in plans:
        assert fitted.plan_cost(plan).seconds == pytest.approx(truth.plan_cost(plan).seconds)
        assert fitted.plan_cost(plan).seconds != pytest.approx(costs.plan_cost(plan).seconds, rel=0.01)
    world_only = costs.fitted([(plans[0], {"world": 1.5})])  # a phase none reports keeps its price
    assert world_only.phase_seconds(plans[1]) == {**costs.phase_seconds(plans[1]), "world": pytest.approx(1.5)}


def test_parcae_charges_a_change_as_an_engine_restart():
    """(1,6) -> (1,7) with a joiner, as Parcae's artifact charges it: rendezvous, its
    engine's 16 groups at the new-worker rate, a process start, the 7-layer build and the
    bytes the last new stage lacks; an intra-stage shrink pays the groups at the
    survivors' rate and a process start, nothing else."""
    c, layer = CONSTANTS, GPT_1_5B.unit("layer.0").params
    costs = ParcaeCostModel(CONSTANTS, GPT_1_5B)
    old = gpt_layout(1, 6, 1)
    plan = plan_migration(MigrationRequest(old, old.workers, frozenset(), frozenset({6})),
                          Parallelism(1, 7, 1, balanced_partition(48, 7)), GPT_1_5B)
    cost = costs.plan_cost(plan)
    assert not cost.restart and cost.staging_seconds == 0
    assert cost.world_seconds == pytest.approx(c.rendezvous_seconds + c.world_init_seconds + c.process_start_seconds)
    assert cost.groups_seconds == pytest.approx(16 * c.group_create_seconds_with_new_worker)
    assert cost.build_seconds == pytest.approx(7 * layer * c.model_build_seconds_per_param
                                               + c.transfer_seconds(50257 * 1024 * 4))
    assert cost.transfer_seconds > 0
    assert 18 < cost.seconds < 23  # the artifact charges 20.6 s (its stages split the model a little apart)
    assert cost.seconds > 2 * MigrationCostModel(CONSTANTS, GPT_1_5B).plan_cost(plan).seconds
    old = gpt_layout(1, 8, 2)
    plan = plan_migration(MigrationRequest(old, old.workers - {15}, frozenset({15}), frozenset()),
                          Parallelism(1, 8, 1, old.stage_layers), GPT_1_5B)
    cost = costs.plan_cost(plan)
    assert plan.kind == "intra-stage" and cost.build_seconds == cost.transfer_seconds == 0
    assert cost.seconds == pytest.approx(c.world_init_seconds + c.process_start_seconds
                                         + 18 * c.group_create_seconds_survivors_only)


def test_parcae_cost_model_is_chosen_by_name_and_has_no_tensor_parallelism():
    def stack(model, rates):
        return build_liveput(ProfileTable(rates, "tiny", 12, TINY), CONSTANTS, lookahead=2,
                             distributed_optimizer=False, gpus_per_instance=2, cost_model=model)

    assert type(stack("parcae", TINY_RATES).costs) is ParcaeCostModel
    assert type(stack("megatron-parcae", TINY_RATES).costs) is MigrationCostModel
    with pytest.raises(ValueError, match="no tensor parallelism"):
        stack("parcae", {**TINY_RATES, (2, 1, 1): 1.5})
    with pytest.raises(ValueError, match="unknown cost model 'deepspeed'"):
        stack("deepspeed", TINY_RATES)


def test_lost_stage_without_notice_means_restart():
    shape_costs = ScenarioCosts(tiny_table(), MigrationCostModel(CONSTANTS, TINY))
    old = Layout(Parallelism(1, 2, 1, (2, 2)), (0, 1))
    cost = shape_costs.change_cost(old, frozenset({1}), frozenset(), Parallelism(1, 2, 1, (2, 2)))
    assert cost.restart
    with_notice = shape_costs.change_cost(old, frozenset(), frozenset({1}), Parallelism(1, 2, 1, (2, 2)))
    assert not with_notice.restart and with_notice.seconds < cost.seconds


def megatron_groups(p: Parallelism) -> list[list[int]]:
    """The groups a training step of `p` communicates over, as megatron-core's
    initialize_model_parallel forms them (its rank generator, its default order)."""
    ranks = RankGenerator(tp=p.tp, ep=1, dp=p.dp, pp=p.pp, cp=1, order="tp-cp-ep-dp-pp")
    pipelines = ranks.get_ranks("pp")
    return [*ranks.get_ranks("tp"), *pipelines, *ranks.get_ranks("dp"), *map(default_embedding_ranks, pipelines),
            *ranks.get_ranks("tp-pp"), list(range(p.world_size))]


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.data())
@settings(max_examples=60, deadline=None)
def test_each_rank_counts_the_groups_megatron_core_puts_it_in(tp, pp, dp, data):
    p = Parallelism(tp, pp, dp, balanced_partition(8, pp))
    joined = np.array(data.draw(st.lists(st.booleans(), min_size=p.world_size, max_size=p.world_size)), dtype=bool)
    groups = [g for g in megatron_groups(p) if len(g) > 1]
    counts, with_new = rank_groups(p, joined)
    for rank in range(p.world_size):
        mine = [g for g in groups if rank in g]
        assert counts[rank] == len(mine)
        assert with_new[rank] == sum(bool(joined[g].any()) for g in mine)


def test_groups_form_side_by_side_so_the_slowest_rank_sets_the_time():
    """A rank creates the communicators of its own groups, one after another; those of
    other ranks form at the same time, so more replicas take no longer."""
    costs = MigrationCostModel(CONSTANTS, GPT_1_5B)
    new, old = CONSTANTS.group_create_seconds_with_new_worker, CONSTANTS.group_create_seconds_survivors_only
    for dp in (2, 4, 16):
        p = Parallelism(4, 8, dp, balanced_partition(48, 8))
        # a first-stage rank: tensor-, pipeline-, data-parallel, embedding, model-parallel groups and the world
        assert costs.groups_seconds(p, np.ones(p.world_size, dtype=bool)) == pytest.approx(6 * new)
        assert costs.groups_seconds(p, np.zeros(p.world_size, dtype=bool)) == pytest.approx(6 * old)
    one_gpu = Parallelism(1, 8, 4, balanced_partition(48, 8))
    assert costs.restart_cost(one_gpu, joining=True, cold=True).groups_seconds == pytest.approx(5 * new)
    p = Parallelism(1, 3, 2, (16, 16, 16))  # rank = replica + 2 * stage
    # a worker joins the middle stage: no embedding group, its four others form with a new peer; a
    # first-stage rank of its pipeline has five groups, but only three hold the newcomer
    joined = np.arange(6) == 2
    assert costs.groups_seconds(p, joined) == pytest.approx(4 * new)
    assert costs.groups_seconds(p, np.arange(6) == 0) == pytest.approx(5 * new)


# ---- scenarios ------------------------------------------------------------------------------

@given(st.integers(1, 40), st.integers(0, 40), st.integers(0, 40))
@settings(max_examples=60, deadline=None)
def test_victims_distribution_is_a_distribution(instances, used, preempted):
    used = min(used, instances)
    dist = victims_distribution(instances, used, preempted)
    assert math.isclose(sum(p for p, _ in dist), 1.0, rel_tol=1e-9)
    assert all(0 <= j <= min(used, preempted) for _, j in dist)


def test_wipe_probability_matches_sampling():
    rng = random.Random(1)
    columns, replicas, victims = 4, 2, 3
    hits = 0
    trials = 20000
    for _ in range(trials):
        chosen = rng.sample(range(columns * replicas), victims)
        counts = [sum(1 for s in chosen if s // replicas == c) for c in range(columns)]
        hits += any(count == replicas for count in counts)
    assert wipe_probability(columns, replicas, victims) == pytest.approx(hits / trials, abs=0.015)
    assert wipe_probability(4, 3, 2) == 0.0


SUDDEN = SuddenLosses(0.5, copy_interval=10, save_interval=100)


@pytest.mark.parametrize("gpus, grace, model, sudden, distributed", [
    (1, 120, MigrationCostModel, SuddenLosses(), False), (2, 120, MigrationCostModel, SuddenLosses(), False),
    (2, 0, MigrationCostModel, SuddenLosses(), False), (1, 120, ParcaeCostModel, SuddenLosses(), False),
    (1, 0, ParcaeCostModel, SuddenLosses(), False), (1, 120, MigrationCostModel, SUDDEN, False),
    (2, 120, MigrationCostModel, SUDDEN, True)])
def test_change_floor_is_below_every_priced_change(gpus, grace, model, sudden, distributed):
    """The optimizer skips a change by its floor, so no priced change may cost less."""
    sizes = [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 2, 2),
             (1, 4, 2), (2, 4, 1)]
    if model is ParcaeCostModel:
        sizes = [s for s in sizes if s[0] == 1] + [(1, 1, 3), (1, 2, 3), (1, 1, 4)]
    table = OnInstances(ProfileTable({key: float(i + 1) for i, key in enumerate(sizes)}, "tiny", 12, TINY), gpus)
    constants = dataclasses.replace(CONSTANTS, grace_period_seconds=grace)
    scenarios = ScenarioCosts(table, model(constants, TINY), gpus, sudden, distributed)
    for old, new in itertools.product(table.layouts(), repeat=2):
        floor = scenarios.change_floor(old, new)
        assert scenarios.change_floor(None, new) <= floor
        used = instances_used(old, gpus)
        for instances, preempted in itertools.product((used, used + 1), range(used + 1)):
            if old != new or (preempted and instances == used):  # staying costs nothing unless hit
                assert scenarios.preempted_seconds(old, new, instances, preempted) >= floor - 1e-9


def test_preemption_distribution():
    assert preemption_distribution(2.0, 0, certain=True) == ((1.0, 2),)
    dist = preemption_distribution(1.5, 1, certain=False)
    assert math.isclose(sum(p for p, _ in dist), 1.0) and min(k for _, k in dist) == 1


@given(st.sampled_from(sorted(TINY_RATES)), st.integers(0, 3))
@settings(max_examples=30, deadline=None)
def test_liveput_without_preemptions_equals_throughput(key, spare):
    table = tiny_table()
    layout = next(p for p in table.layouts() if (p.tp, p.pp, p.dp) == key)
    scenarios = ScenarioCosts(table, MigrationCostModel(CONSTANTS, TINY))
    instances = layout.world_size + spare
    calm = StepOutlook(instances, ((1.0, 0),))
    assert scenarios.liveput(layout, instances, calm) == table.samples_per_second(layout)
    stormy = StepOutlook(instances, ((1.0, min(2, instances)),))
    assert scenarios.liveput(layout, instances, stormy) <= table.samples_per_second(layout)


# ---- the dynamic program ------------------------------------------------------------------------

def brute_force(optimizer: LiveputOptimizer, current: Layout | None, available: frozenset[int],
                leaving: frozenset[int], forecast, busy: float) -> float:
    """Best expected samples over every sequence of feasible layouts (no pruning), booked
    as the simulator books them: a change longer than an interval stalls the next one(s),
    and what is still running after the last step stalls the last layout (overruns on the
    optimizer's grid)."""
    table, scenarios, interval = optimizer.throughput, optimizer.scenarios, optimizer.interval
    lost = frozenset() if current is None else current.workers - available - leaving
    steps = outlook(forecast, len(available), optimizer.horizon - 1)
    counts = [len(available)] + [s.instances for s in steps]
    choices = [table.fitting(n) for n in counts]
    best = -np.inf
    for sequence in itertools.product(*choices):
        first = sequence[0]
        if current is None:
            seconds = optimizer.costs.restart_cost(first, joining=True, cold=True).seconds
        elif first == current.parallelism and not (lost or leaving):
            seconds = 0.0
        else:
            seconds = scenarios.change_cost(current, lost, leaving, first).seconds
        late = busy + seconds
        value = table.samples_per_second(first) * max(0.0, interval - late)
        for h, p in enumerate(sequence[1:]):
            late = overrun(late, interval) + scenarios.expected_seconds(sequence[h], p, counts[h], steps[h])
            value += table.samples_per_second(p) * max(0.0, interval - late)
        best = max(best, value - table.samples_per_second(sequence[-1]) * overrun(late, interval))
    return best


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_dynamic_program_equals_brute_force(data):
    table = tiny_table()
    horizon = data.draw(st.integers(1, 3), label="horizon")
    # at 2 s a restart (about 21 s) stalls several intervals, and some changes one
    interval = data.draw(st.sampled_from([60, 2]), label="interval")
    constants = dataclasses.replace(CONSTANTS, interval_seconds=interval)
    optimizer = LiveputOptimizer(table, MigrationCostModel(constants, TINY), horizon, candidates=len(TINY_RATES))
    start = data.draw(st.sampled_from(table.layouts()), label="current")
    cold = data.draw(st.booleans(), label="cold start")
    workers = list(range(start.world_size + data.draw(st.integers(0, 2), label="spares")))
    current = Layout(start, tuple(workers[:start.world_size]))
    preempted = data.draw(st.lists(st.sampled_from(workers), unique=True, max_size=2), label="preempted")
    arrived = list(range(100, 100 + data.draw(st.integers(0, 2), label="arrived")))
    available = frozenset(workers) - set(preempted) | set(arrived)
    if not available:
        return
    leaving = frozenset(preempted) & current.workers if data.draw(st.booleans(), label="notice") else frozenset()
    counts = data.draw(st.lists(st.integers(1, 6), min_size=horizon - 1, max_size=horizon - 1), label="counts")
    drops = [max(0, a - b) for a, b in zip([len(available)] + counts, counts)]
    forecast = certain_forecast(counts, [d + data.draw(st.integers(0, 1)) for d in drops]) if counts else None
    busy = data.draw(st.sampled_from([0.0, 10.0]), label="busy")
    if cold:
        current, leaving = None, frozenset()
    decision = optimizer.decide(current, available, forecast, leaving, busy)
    expected = brute_force(optimizer, current, frozenset(available), leaving, forecast, busy)
    assert decision.expected_samples == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert len(decision.path) == horizon
    assert decision.horizon_samples >= max(0.0, decision.expected_samples) - 1e-9


@pytest.mark.parametrize("interval", [2, 60])
def test_horizon_samples_leave_out_the_stall_after_the_horizon(interval):
    # A cold start (about 21 s) outlasts a horizon of one 2 s interval: the program charges
    # the stall after it, so its value is negative; what trains in the horizon is nothing.
    constants = dataclasses.replace(CONSTANTS, interval_seconds=interval)
    optimizer = LiveputOptimizer(tiny_table(), MigrationCostModel(constants, TINY), horizon=1)
    decision = optimizer.decide(None, range(4))
    rate = optimizer.throughput.samples_per_second(decision.layout.parallelism)
    trained = rate * max(0.0, interval - decision.cost.seconds)
    assert decision.horizon_samples == pytest.approx(trained)
    if interval == 2:
        assert decision.expected_samples < 0 == decision.horizon_samples
    else:
        assert decision.expected_samples == pytest.approx(trained) and trained > 0


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=8), st.integers(1, 4))
@settings(max_examples=30, deadline=None)
def test_infeasible_layouts_are_never_chosen(events, horizon):
    # the table leaves out (1, 1, 4), (1, 4, 3), ...: they must never be picked
    table = tiny_table()
    optimizer = LiveputOptimizer(table, MigrationCostModel(CONSTANTS, TINY), horizon)
    rng = random.Random(7)
    available, next_id, layout = set(range(4)), 4, None
    for lose, gain in events:
        gone = set(rng.sample(sorted(available), min(lose, len(available))))
        available = available - gone | set(range(next_id, next_id + gain))
        next_id += gain
        leaving = gone & layout.workers if layout else set()
        decision = optimizer.decide(layout, available, None, leaving)
        if decision.layout is None:
            assert not table.fitting(len(available))
            continue
        p = decision.layout.parallelism
        assert table.samples_per_second(p) > 0 and p in table.layouts()
        assert decision.layout.workers <= available and p.world_size <= len(available)
        layout = decision.layout


def test_decision_moves_to_best_layout_when_nothing_changes():
    table = ProfileTable.load(f"{ANCHORS}/gpt-1.5b.csv", GPT_1_5B)
    optimizer = LiveputOptimizer(table, MigrationCostModel(CONSTANTS, GPT_1_5B), horizon=8)
    first = optimizer.decide(None, range(32))
    assert (first.layout.pp, first.layout.dp) == (8, 4) and first.plan is None and first.cost.restart  # cold start
    again = optimizer.decide(first.layout, range(32), certain_forecast([32] * 7, [0] * 7))
    assert again.layout == first.layout and again.cost.seconds == 0
    # three leave with notice: the job keeps going on the survivors, paying for the change
    gone = {first.layout.slots[0], first.layout.slots[9], first.layout.slots[17]}
    after = optimizer.decide(first.layout, set(range(32)) - gone, certain_forecast([29] * 7, [0] * 7), gone)
    assert after.layout.workers.isdisjoint(gone) and 0 < after.cost.seconds < 15
    assert after.plan is not None and after.plan.new == after.layout


def replayed_samples(optimizer: LiveputOptimizer, path: tuple[Parallelism, ...], start_seconds: float) -> float:
    """Samples of `path` from a cold start on constant availability, as the simulator books
    them: a change longer than an interval stalls the following interval(s); what is still
    running at the end of the path stalls its last layout."""
    interval, rate = optimizer.interval, optimizer.throughput.samples_per_second
    samples, busy, previous = 0.0, 0.0, None
    for p in path:
        busy += start_seconds if previous is None else optimizer.scenarios.expected_seconds(
            previous, p, p.world_size, StepOutlook(p.world_size, ((1.0, 0),)))
        samples += rate(p) * max(0.0, interval - busy)
        busy, previous = max(0.0, busy - interval), p
    return samples - rate(path[-1]) * busy


@pytest.mark.parametrize("workers, best", [(2, (1, 1, 2)), (3, (1, 3, 1))])
def test_a_change_longer_than_an_interval_stalls_the_next_layouts(workers, best):
    # The coordinator tests' profile at 5 s intervals: every cold start (about 7-8 s) runs
    # into the next interval, so what it stalls is the layout run there, not the one started.
    unit = {"forward_ms": 20.0, "backward_ms": 40.0, "optimizer_ms": 0.5, "activation_bytes": 1e6,
            "output_bytes": 1e5}
    table = PipelineModel(tiny_layer_profile(max_tensor_parallel=1, embedding=unit, layers=[unit] * 4, head=unit),
                          max_workers=8)
    constants = dataclasses.replace(CONSTANTS, interval_seconds=5, grace_period_seconds=20)
    optimizer = LiveputOptimizer(table, MigrationCostModel(constants, TINY), horizon=4)
    decision = optimizer.decide(None, range(workers))
    assert (decision.layout.tp, decision.layout.pp, decision.layout.dp) == best
    assert decision.cost.seconds > constants.interval_seconds
    # the program counts each step's overrun on a grid (hundredths of an interval), rounded up
    replayed = replayed_samples(optimizer, decision.path, decision.cost.seconds)
    grid_loss = OVERRUN_GRID * constants.interval_seconds * len(decision.path) * max(
        table.samples_per_second(p) for p in decision.path)
    assert replayed - grid_loss <= decision.expected_samples <= replayed
    # the smallest layout, started and then grown, is worth less when booked the same way
    smallest = next(p for p in table.layouts() if p.world_size == 1)
    grown = (smallest,) + decision.path[1:]
    start = optimizer.costs.restart_cost(smallest, joining=True, cold=True).seconds
    assert replayed_samples(optimizer, grown, start) < decision.expected_samples


# ---- preemptions without notice ------------------------------------------------------------------

def all_scenario_seconds(scenarios: ScenarioCosts) -> list[float]:
    layouts = scenarios.throughput.layouts()
    return [scenarios.preempted_seconds(old, new, instances, preempted)
            for old, new in itertools.product(layouts, repeat=2)
            for instances in (old.world_size, old.world_size + 1) for preempted in range(3)]


@pytest.mark.parametrize("grace", [120, 0])
def test_no_sudden_share_prices_every_scenario_as_before(grace):
    """share 0: the snapshot and save intervals and the optimizer's kind change nothing."""
    costs = MigrationCostModel(dataclasses.replace(CONSTANTS, grace_period_seconds=grace), TINY)
    before = all_scenario_seconds(ScenarioCosts(tiny_table(), costs))
    assert all_scenario_seconds(ScenarioCosts(tiny_table(), costs, 1, SuddenLosses(0.0, 10, 100), True)) == before
    assert max(before) > 0


def liveput_drop(sudden: SuddenLosses, key: tuple[int, int, int], distributed: bool = False) -> float:
    """Share of a layout's throughput lost to one expected preemption of its instances."""
    table = tiny_table()
    layout = next(p for p in table.layouts() if (p.tp, p.pp, p.dp) == key)
    scenarios = ScenarioCosts(table, MigrationCostModel(CONSTANTS, TINY), 1, sudden, distributed)
    step = StepOutlook(layout.world_size, ((1.0, 1),))
    return 1 - scenarios.liveput(layout, layout.world_size, step) / table.samples_per_second(layout)


def test_sudden_losses_cost_a_layout_without_replicas_most_and_snapshots_less():
    noticed = {key: liveput_drop(SuddenLosses(), key) for key in ((1, 2, 1), (1, 1, 2))}
    sudden = {key: liveput_drop(SuddenLosses(0.5, 0, 100), key) for key in ((1, 2, 1), (1, 1, 2))}
    # a lost stage of a pipeline restarts from the checkpoint and retrains 50 steps; a replica saves D = 2
    assert sudden[1, 2, 1] - noticed[1, 2, 1] > sudden[1, 1, 2] - noticed[1, 1, 2] + 0.5
    with_copies = liveput_drop(SuddenLosses(0.5, 10, 100), (1, 2, 1))
    assert noticed[1, 2, 1] < with_copies < sudden[1, 2, 1]


def test_the_distributed_optimizer_loses_state_with_any_sudden_loss():
    """Its shards exist once, so even D = 2 restarts (no snapshots) and retrains half a
    save interval, steps of 12 samples at 1.9 samples/s."""
    table = tiny_table()
    replicated = next(p for p in table.layouts() if (p.tp, p.pp, p.dp) == (1, 1, 2))
    costs = MigrationCostModel(CONSTANTS, TINY)
    sudden = SuddenLosses(1.0, 0, 100)
    plain = ScenarioCosts(table, costs, 1, sudden).preempted_seconds(replicated, replicated, 2, 1)
    sharded = ScenarioCosts(table, costs, 1, sudden, True).preempted_seconds(replicated, replicated, 2, 1)
    restart = costs.restart_cost(replicated, joining=True).seconds
    assert sharded == pytest.approx(restart + 50 * 12 / 1.9)
    lost = ScenarioCosts(table, costs).change_cost(Layout(replicated, (0, 1)), frozenset({1}), frozenset(), replicated)
    assert plain == pytest.approx(lost.seconds) and plain < restart
    with_copies = ScenarioCosts(table, costs, 1, SuddenLosses(1.0, 10, 100), True)
    assert with_copies.preempted_seconds(replicated, replicated, 2, 1) < sharded


@pytest.mark.parametrize("key, gpus", [((1, 2, 1), 1), ((1, 4, 1), 1), ((1, 2, 2), 1), ((1, 2, 3), 1),
                                       ((1, 1, 3), 1), ((1, 4, 2), 2), ((2, 2, 2), 2), ((1, 2, 3), 4)])
def test_copies_recovery_probability_is_what_the_planner_recovers(key, gpus):
    """Over every set of lost instances of a canonical layout that the survivors cannot
    make up for: the share from which plan.Copies (each worker's copy on its buddy) can."""
    p = Parallelism(*key, balanced_partition(4, key[1]))
    used = instances_used(p, gpus)
    layout = Layout(p, tuple(range(p.world_size)))
    holders = copy_holders(layout, canonical_placement(gpus, used * gpus))
    checked = 0
    for distributed in (False, True):
        for victims in range(1, used + 1):
            placement = canonical_placement(gpus, (used + victims) * gpus)
            joining = frozenset(range(p.world_size, (used + victims) * gpus))

            def planned(survivors: frozenset[int], copies: Copies | None) -> bool:
                request = MigrationRequest(layout, survivors, frozenset(), joining, distributed, placement, copies)
                try:
                    plan_migration(request, p, TINY)
                except LostStateError:
                    return False
                return True

            lost = recovered = 0
            for gone in itertools.combinations(range(used), victims):
                survivors = frozenset(r for r in range(p.world_size) if r // gpus not in gone)
                if not planned(survivors, None):
                    lost += 1
                    recovered += planned(survivors, Copies(1, holders))
            if lost:  # with the plain optimizer, the survivors of a few instances still hold every stage
                assert copies_recovery_probability(p, gpus, victims, distributed) == pytest.approx(recovered / lost)
                checked += 1
    assert checked > used  # every count of victims with the distributed optimizer, and some without


def test_sudden_losses_reject_bad_values(tmp_path):
    for share in (-0.1, 1.5, math.nan, True, "0.2"):
        with pytest.raises(ValueError, match="sudden share: expected a probability from 0 to 1"):
            SuddenLosses(share)
    for steps in (-1, 2.5, True):
        with pytest.raises(ValueError, match="copy interval: expected a whole number of steps"):
            SuddenLosses(0.5, steps)
        with pytest.raises(ValueError, match="save interval: expected a whole number of steps"):
            SuddenLosses(0.5, 10, steps)
    unbatched = ProfileTable(TINY_RATES, "tiny", 0, TINY)
    with pytest.raises(ValueError, match="needs the global batch size; the tiny profile names none"):
        build_liveput(unbatched, CONSTANTS, lookahead=2, distributed_optimizer=False, sudden=SUDDEN)
    ScenarioCosts(unbatched, MigrationCostModel(CONSTANTS, TINY), 1, SuddenLosses(0.5, 0, 0))  # prices no step
    profile = f"{ANCHORS}/gpt-1.5b.csv"
    for key, value, message in [("sudden-share", 2, "expected a probability from 0 to 1, got 2"),
                                ("sudden-share", "half", "expected a probability from 0 to 1, got 'half'"),
                                ("copy-interval", -1, "expected a number of steps from 0"),
                                ("save-interval", 1.5, "expected a number of steps from 0")]:
        with pytest.raises(ConfigError, match=f"^cfg: {key}: {message}"):
            CoordinatorConfig.from_dict({"profile": profile, key: value}, "cfg", tmp_path)
    config = CoordinatorConfig.from_dict({"profile": profile, "sudden-share": 0.25, "copy-interval": 0,
                                          "save-interval": 200}, "cfg", tmp_path)
    assert config.optimizer().scenarios.sudden == SuddenLosses(0.25, 0, 200)
    assert CoordinatorConfig.from_dict({"profile": profile}, "cfg", tmp_path).optimizer().scenarios.sudden == \
        SuddenLosses()


def test_sudden_losses_turn_the_decision_toward_replicas():
    """Two workers, a preemption each coming interval (and a replacement): a pipeline
    (1, 2, 1) trains a little faster than two replicas (1, 1, 2); when most preemptions
    come without notice a lost stage restarts from the checkpoint, so replicas win."""
    table = ProfileTable({(1, 1, 1): 1.0, (1, 2, 1): 2.0, (1, 1, 2): 1.9}, "tiny", 12, TINY)
    forecast = certain_forecast([2, 2], [1, 1])
    chosen = {}
    for share in (0.0, 0.9):
        optimizer = LiveputOptimizer(table, MigrationCostModel(CONSTANTS, TINY), 3,
                                     sudden=SuddenLosses(share, 10, 100))
        layout = optimizer.decide(None, range(2), forecast).layout.parallelism
        chosen[share] = (layout.tp, layout.pp, layout.dp)
    assert chosen == {0.0: (1, 2, 1), 0.9: (1, 1, 2)}
