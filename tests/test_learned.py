"""The throughput prior computed from a model's shape, and what the coordinator learns
from step reports (megatron_parcae/liveput/{analytic,learned}.py)."""

import math
import statistics

import pytest

from megatron_parcae.liveput.analytic import DeviceRates, analytic_profile, layer_matmul_flops
from megatron_parcae.liveput.learned import UNSEEN_SPREAD, ThroughputLearner
from megatron_parcae.liveput.throughput import OnInstances, PipelineModel
from reconfig.layout import ModelShape

SHAPE = ModelShape("gpt", 4, 128, 4, 512, 384, 64)
DEVICE = DeviceRates("test", matmul_flops_per_second=1e10, memory_bytes_per_second=1e10, memory_bytes=1e10)


def _profile(device: DeviceRates = DEVICE) -> dict:
    return analytic_profile(SHAPE, model="tiny", micro_batch_size=4, global_batch_size=32, seq_length=64,
                            value_bytes=4, device=device, link_bytes_per_second=1e9,
                            tensor_parallel_bytes_per_second=1e9, max_tensor_parallel=4)


def _prior(device: DeviceRates = DEVICE) -> PipelineModel:
    return PipelineModel(_profile(device), max_workers=4)


def test_analytic_layer_time_is_its_flops_at_the_device_rate_plus_its_traffic():
    layer = _profile()["layers"][0]
    flops = layer_matmul_flops(SHAPE, 4 * 64, 64)
    assert flops == 2 * 256 * (4 * 128 * 128 + 2 * 128 * 512) + 4 * 256 * 64 * 128
    assert layer["forward_ms"] > 1000 * flops / DEVICE.matmul_flops_per_second
    assert layer["backward_ms"] == pytest.approx(2 * layer["forward_ms"])
    assert layer["output_bytes"] == 256 * 128 * 4


def test_a_faster_device_gives_a_faster_prior_and_the_same_layouts():
    slow, fast = _prior(), _prior(DeviceRates("fast", 1e11, 1e11, 1e10))
    assert slow.layouts() == fast.layouts()
    for p in slow.layouts():
        assert fast.samples_per_second(p) > slow.samples_per_second(p)


def test_a_layout_that_ran_is_priced_by_its_median_and_others_by_the_shared_correction():
    prior = _prior()
    learner = ThroughputLearner(prior)
    ran, other = prior.layouts()[0], prior.layouts()[1]
    prior_seconds = 32 / prior.samples_per_second(ran)
    for factor in (2.9, 3.0, 3.1, 10.0, 3.0):  # one outlier: the median ignores it
        learner.observe(ran, factor * prior_seconds)
    model = learner.model()
    assert model.iteration_seconds(ran) == pytest.approx(3.0 * prior_seconds)
    assert model.correction == pytest.approx(3.0) and model.spread == UNSEEN_SPREAD
    assert model.samples_per_second(other) == pytest.approx(prior.samples_per_second(other) / 3.0
                                                            * math.exp(-UNSEEN_SPREAD))


def test_unseen_layouts_get_the_geometric_mean_correction_discounted_by_the_disagreement():
    prior = _prior()
    learner = ThroughputLearner(prior)
    a, b, unseen = prior.layouts()[:3]
    learner.observe(a, 2.0 * 32 / prior.samples_per_second(a))
    learner.observe(b, 8.0 * 32 / prior.samples_per_second(b))
    model = learner.model()
    assert model.correction == pytest.approx(4.0)
    assert model.spread == pytest.approx(statistics.stdev([math.log(2.0), math.log(8.0)]))
    assert model.samples_per_second(unseen) < prior.samples_per_second(unseen) / 4.0


def test_replan_only_when_a_price_moved():
    prior = _prior()
    learner = ThroughputLearner(prior)
    ran = prior.layouts()[0]
    seconds = 32 / prior.samples_per_second(ran)
    assert learner.replan() is None  # nothing learned
    learner.observe(ran, 2 * seconds)
    assert learner.replan() is not None
    learner.observe(ran, 2.01 * seconds)
    assert learner.replan() is None  # within CHANGE_TO_REPLAN
    for _ in range(4):
        learner.observe(ran, 3 * seconds)
    assert learner.replan().iteration_seconds(ran) == pytest.approx(3 * seconds)


def test_reports_of_layouts_the_prior_cannot_run_or_nonsense_are_ignored():
    prior = _prior()
    learner = ThroughputLearner(prior)
    ran = prior.layouts()[0]
    for bad in (0.0, -1.0, math.inf, math.nan):
        learner.observe(ran, bad)
    assert learner.estimates() == []


def test_a_measured_network_reprices_the_prior_and_the_reports_correct_the_new_one():
    """The coordinator swaps the prior's link for the one the workers measured: layouts
    that talk over it get faster, the others stay, and the step reports already kept now
    correct the new prior (a layout that ran keeps its own median)."""
    prior = OnInstances(_prior(), 1)
    learner = ThroughputLearner(prior)
    ran = next(p for p in prior.layouts() if p.dp == 2 and p.pp == 1)
    alone = next(p for p in prior.layouts() if p.world_size == 1)
    measured = 3.0 * 32 / prior.samples_per_second(ran)
    learner.observe(ran, measured)
    faster = learner.prior.with_link(1e11)
    assert faster.link_bytes_per_second == 1e11 and prior.link_bytes_per_second == 1e9
    assert faster.layouts() == prior.layouts()
    assert faster.samples_per_second(ran) > prior.samples_per_second(ran)
    assert faster.samples_per_second(alone) == prior.samples_per_second(alone)
    model = learner.reprice(faster)
    assert learner.prior is faster and model.link_bytes_per_second == 1e11
    assert model.iteration_seconds(ran) == pytest.approx(measured)
    assert model.correction == pytest.approx(measured * faster.samples_per_second(ran) / 32)
    assert learner.replan() is None  # the optimizer plans with the model reprice gave
