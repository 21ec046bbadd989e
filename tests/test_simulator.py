"""`parcae simulate` and `parcae plan` (issue 5): replay fidelity against Parcae's
published figures, policy sanity, CLI output and errors, cluster sizing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest
import yaml

from megatron_parcae.cli import main
from megatron_parcae.control.coordinator import CoordinatorConfig
from megatron_parcae.liveput.cost import CostConstants, ParcaeCostModel
from megatron_parcae.liveput.factory import build_liveput
from megatron_parcae.liveput.scenarios import SuddenLosses
from megatron_parcae.tools import simulate
from megatron_parcae.tools.simulate import Replay, Simulation
from megatron_parcae.tools.plan import Sizer, cycled
from predictor.traces import AvailabilityTrace
from reconfig.layout import Parallelism, balanced_partition, layer_unit

import helpers

P3 = str(helpers.TRACES / "aws-p3" / "p3-trace.csv")
GPT = str(helpers.ANCHORS / "gpt-1.5b.csv")
BERT = str(helpers.ANCHORS / "bert.csv")
# Parcae's artifact on aws-p3, GPT-1.5B, global batch 128 (benchmarks/anchors/parcae/README.md)
PARCAE_IDEAL = {"hh": 143547.3, "hl": 149501.6, "lh": 108432.9, "ll": 103787.5}
PARCAE_THROUGHPUT = {"hh": 107545.2, "hl": 124158.5, "lh": 73255.3, "ll": 98820.4}
PARCAE_LIVEPUT = {"hh": 134663.7, "hl": 139415.4, "lh": 100321.9, "ll": 101884.6}  # true availability
SEGMENTS = {"hh": (5.5, 6.5), "hl": (1.5, 2.5), "lh": (8.0, 9.0), "ll": (10.0, 11.0)}


def simulation(segment: str, lookahead: int = 8, cost_model: str = "megatron-parcae") -> Simulation:
    constants = CostConstants.load()
    replay = Replay.load(P3, constants.interval_seconds, *SEGMENTS[segment])
    return Simulation(replay, build_liveput(GPT, constants, model="gpt-1.5b", lookahead=lookahead,
                                            distributed_optimizer=False, cost_model=cost_model))


@pytest.mark.parametrize("segment", sorted(SEGMENTS))
def test_ideal_and_reactive_baseline_reproduce_parcae(segment):
    sim = simulation(segment)
    assert sim.replay.intervals == 60 and sim.replay.start == int(SEGMENTS[segment][0] * 60)
    assert sim.run("ideal").samples == pytest.approx(PARCAE_IDEAL[segment], abs=0.1)
    # same trace cut, same table, Parcae's own restart pricing: within half a percent
    assert sim.run("throughput").samples == pytest.approx(PARCAE_THROUGHPUT[segment], rel=0.005)


def test_liveput_is_between_baseline_and_ideal():
    sim = simulation("ll")
    ideal, reactive, oracle = (sim.run(p) for p in ("ideal", "throughput", "parcae-oracle"))
    assert reactive.samples < oracle.samples < ideal.samples
    assert oracle.migrations >= 1 and oracle.restarts == 0
    assert all(r <= i + 1e-9 for r, i in zip(oracle.rates, ideal.rates))  # never faster than ideal


def test_simulate_json_report(capsys):
    code = main(["simulate", "--trace", P3, "--start-hour", "10", "--end-hour", "10.5", "--profile", GPT,
                 "--policies", "ideal,throughput,parcae-oracle", "--lookahead", "4", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    policies = report["policies"]
    assert set(policies) == {"ideal", "throughput", "parcae-oracle"}
    assert policies["ideal"]["ratio_to_ideal"] == 1.0
    assert 0 < policies["throughput"]["ratio_to_ideal"] < policies["parcae-oracle"]["ratio_to_ideal"] <= 1.0
    # 30 minutes of 16-18 p3.2xlarge spot instances at $0.918 per hour
    assert policies["ideal"]["dollars"] == pytest.approx(sum(
        Replay.load(P3, 60, 10, 10.5).counts[600:630]) / 60 * 0.918, abs=0.01)
    assert report["decision_ms"]["p50"] <= report["decision_ms"]["p99"]


def test_parcae_cost_model_compares_liveput_on_parcaes_own_costs(capsys):
    """Parcae's charges restart its engine on every change, so its liveput trains less than
    ours on the same segment, the reactive baseline is priced alike, and on "ll" it reaches
    what the artifact's optimizer reaches (benchmarks/results/simulate_parcae_costs.txt)."""
    reports = {}
    for model in ("megatron-parcae", "parcae"):
        assert main(["simulate", "--trace", P3, "--start-hour", "10", "--end-hour", "11", "--profile", GPT,
                     "--policies", "throughput,parcae-oracle", "--cost-model", model, "--json"]) == 0
        reports[model] = json.loads(capsys.readouterr().out)["policies"]
    ours, parcae = reports["megatron-parcae"], reports["parcae"]
    assert parcae["throughput"] == ours["throughput"]
    assert parcae["throughput"]["samples"] < parcae["parcae-oracle"]["samples"] < ours["parcae-oracle"]["samples"]
    assert parcae["parcae-oracle"]["samples"] >= PARCAE_LIVEPUT["ll"]


def test_draws_report_the_mean_over_preemption_draws(capsys):
    """Parcae's artifact charges a change at its mean over its draws of which instances
    are preempted; --draws K replays K seeded draws and reports each policy's mean."""
    args = ["simulate", "--trace", P3, "--start-hour", "8", "--end-hour", "8.5", "--profile", GPT, "--lookahead", "4",
            "--policies", "ideal,parcae-oracle", "--cost-model", "parcae", "--json"]
    reports = []
    for seeds in (["--seed", "1", "--draws", "2"], ["--seed", "1"], ["--seed", "2"]):
        assert main([*args, *seeds]) == 0
        reports.append(json.loads(capsys.readouterr().out)["policies"])
    mean, *draws = reports
    samples = [d["parcae-oracle"]["samples"] for d in draws]
    assert samples[0] != samples[1]  # the draws differ, so the mean says something
    assert mean["parcae-oracle"]["samples"] == pytest.approx(sum(samples) / 2, abs=0.1)
    assert mean["ideal"] == draws[0]["ideal"] == draws[1]["ideal"]


def test_parcae_costs_split_and_build_the_model_as_parcaes_engine():
    """Parcae's engine splits GPT-1.5B into 50 blocks (embeddings, 48 layers, output):
    over 8 stages 7, 6, 6, 6, 6, 6, 7, 6 of them, over 14 stages 4, 3 x 5, 4 x 7, 3; and
    its restart builds ceil(48 / P) layers a stage, not megatron-core's split (6 over 14)."""
    constants = CostConstants.load()
    shape = constants.model("gpt-1.5b")
    costs = ParcaeCostModel(constants, shape)
    p8, p14 = (Parallelism(1, pp, 1, balanced_partition(48, pp)) for pp in (8, 14))
    assert [len(stage) for stage in costs.stage_bytes(p8)] == [7, 6, 6, 6, 6, 6, 7, 6]
    assert [len(stage) for stage in costs.stage_bytes(p14)] == [4] + [3] * 5 + [4] * 7 + [3]
    assert max(p14.stage_layers) == 6
    build = costs.engine_restart(p14, joining=False).build_seconds
    assert build == pytest.approx(4 * shape.unit(layer_unit(0)).params * constants.model_build_seconds_per_param
                                  + constants.transfer_seconds(shape.vocab_size * shape.max_position_embeddings * 4))


@pytest.mark.parametrize("cost_model", ["megatron-parcae", "parcae"])
def test_the_optimizers_top_layouts_train_what_a_search_of_every_layout_trains(cost_model):
    """factory.CANDIDATES, checked on "ll" (all four segments, and what fewer would lose:
    benchmarks/results/simulate_parcae_costs.txt)."""
    sim = simulation("ll", cost_model=cost_model)
    every = dataclasses.replace(sim.liveput, candidates=len(sim.liveput.throughput.layouts()))
    assert sim.liveput.candidates < len(sim.liveput.throughput.layouts())
    assert sim.run("parcae-oracle").samples == pytest.approx(Simulation(sim.replay, every).run("parcae-oracle").samples)


def test_simulate_plot(tmp_path, capsys):
    out = tmp_path / "timeline.png"
    assert main(["simulate", "--trace", P3, "--start-hour", "1", "--end-hour", "1.2", "--profile", BERT,
                 "--policies", "ideal,throughput", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "throughput" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--trace", "/nonexistent.csv", "--profile", GPT], "/nonexistent.csv"),
    (["--trace", P3, "--profile", GPT, "--policies", "ideal,fastest"], "unknown fastest"),
    (["--trace", P3, "--profile", GPT, "--start-hour", "20", "--end-hour", "21"], "select no interval"),
    (["--trace", P3, "--profile", GPT, "--lookahead", "0"], "--lookahead must be at least 1"),
    (["--trace", P3, "--profile", GPT, "--draws", "0"], "--draws must be at least 1"),
    (["--trace", P3, "--profile", GPT, "--sudden-share", "1.5"], "sudden share: expected a probability from 0 to 1"),
    (["--trace", P3, "--profile", GPT, "--save-interval", "-10"], "save interval: expected a whole number of steps"),
    (["--trace", P3, "--profile", GPT, "--policies", "ideal", "--rates", "constant"], "add parcae to --policies"),
    (["--trace", P3, "--profile", GPT, "--model", "gpt-175b"], "no shape for model 'gpt-175b'"),
    (["--trace", P3, "--profile", str(helpers.REPO / "configs/profiles/gpt-1.5b-h100-tp.json"),
      "--gpus-per-instance", "4", "--cost-model", "parcae"], "no tensor parallelism"),
])
def test_simulate_errors_are_clear(capsys, args, message):
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert "parcae simulate: error:" in err and message in err and "Traceback" not in err


def test_rates_give_the_parcae_policy_a_rate_models_expected_preemptions(capsys):
    """On a day of gcp-a100 history (under two days: hour-of-day means, no Prophet fit)."""
    gcp = str(helpers.TRACES / "gcp-a100" / "a100x1-east1b.txt")
    replay = Replay.load(gcp, 60.0, 24, 24.5)
    feeds = {rates: simulate.ForecasterFeed(replay, rates) for rates in ("none", "seasonal")}
    expected = {rates: np.array([feed.after(i, 3).preemptions for i in range(replay.intervals)])
                for rates, feed in feeds.items()}
    assert not np.allclose(expected["none"], expected["seasonal"])
    counts = [[f.after(i, 3).expected for i in range(replay.intervals)] for f in feeds.values()]
    assert np.array_equal(*counts)  # the counts stay the forecaster's
    args = ["simulate", "--trace", gcp, "--start-hour", "24", "--end-hour", "24.5", "--profile", GPT,
            "--policies", "ideal,parcae", "--lookahead", "4", "--json"]
    assert main([*args, "--rates", "seasonal"]) == 0
    policies = json.loads(capsys.readouterr().out)["policies"]
    assert 0 < policies["parcae"]["ratio_to_ideal"] <= 1.0
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--rates", "hourly"])
    assert exit_.value.code == 2 and "invalid choice: 'hourly'" in capsys.readouterr().err


def test_cycled_trace_wraps_with_events(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text("0,3\n120000,5\n240000,2\n")  # ms,count: 3, then 5 at 2 min, 2 at 4 min
    replay = cycled(AvailabilityTrace.load(path), 60.0, 12)
    assert list(replay.counts) == [3, 3, 5, 5, 2, 3, 3, 5, 5, 2, 3, 3]
    assert replay.arrivals[5] == 1 and replay.preemptions[4] == 3 and replay.preemptions[5] == 0
    assert np.all(np.diff(replay.counts) == replay.arrivals[1:] - replay.preemptions[1:])


def write_flat_trace(path, count: int, minutes: int) -> str:
    path.write_text("".join(f"{m * 60000},{count}\n" for m in range(minutes + 1)))
    return str(path)


@pytest.mark.slow
def test_plan_adds_on_demand_only_when_spot_alone_is_too_slow(tmp_path, capsys):
    trace = write_flat_trace(tmp_path / "four.csv", 4, 30)
    # BERT on 4 instances trains ~130 samples/s; 300k samples in 30 minutes needs ~167/s
    code = main(["plan", "--profile", BERT, "--samples", "300000", "--deadline", "0.5", "--trace", trace,
                 "--lookahead", "2", "--json"])
    assert code == 0
    answer = json.loads(capsys.readouterr().out)
    best, candidates = answer["recommendation"], answer["candidates"]
    assert best["hours"] <= 0.5 and best["spot"] + best["on_demand"] > 4
    assert best["dollars"] == min(c["dollars"] for c in candidates)
    assert all(c["hours"] <= 0.5 for c in candidates)


def test_plan_says_when_nothing_finishes_and_what_the_fastest_does(tmp_path, capsys):
    trace = write_flat_trace(tmp_path / "two.csv", 2, 10)
    code = main(["plan", "--profile", BERT, "--samples", "1e9", "--deadline", "0.1", "--trace", trace,
                 "--lookahead", "1", "--json"])
    assert code == 1
    captured = capsys.readouterr()
    fastest = json.loads(captured.out)["fastest"]
    assert "no cluster finishes by the deadline: the fastest" in captured.err
    assert fastest["on_demand"] > 0 and fastest["hours"] > 0.1 and 0 < fastest["samples_by_deadline"] < 1e9
    assert f"{fastest['hours']:.2f} h" in captured.err


def test_plan_search_finds_the_fewest_on_demand_instances_that_trying_each_finds(tmp_path):
    """The search bounds with the ideal policy before simulating parcae: it must find what
    simulating every count finds."""
    constants = CostConstants.load()
    trace = AvailabilityTrace.load(write_flat_trace(tmp_path / "three.csv", 3, 30))
    liveput = build_liveput(BERT, constants, max_workers=8, lookahead=2, distributed_optimizer=False)
    sizer = Sizer([trace], liveput, 150_000, 0.5, 1.0, 3.0)
    for spot in (0, 3):
        most = sizer.largest - spot
        every = [od for od in range(most + 1) if math.isfinite(sizer.evaluate(spot, od).hours)]
        found = sizer.fewest_on_demand(spot, most)
        assert (found.on_demand if found else None) == (every[0] if every else None), (spot, every)


def test_plan_rejects_bad_numbers(capsys):
    assert main(["plan", "--profile", BERT, "--samples", "-5", "--deadline", "1", "--trace", P3]) == 2
    assert "--samples must be a positive number" in capsys.readouterr().err


def test_simulator_builds_the_coordinators_optimizer(tmp_path):
    """Both go through liveput/factory.py: the same layouts, costs and planner settings."""
    profile = tmp_path / "table.csv"
    profile.write_text("# model=gpt-1.5b global_batch_size=128\n"
                       "data_parallel,pipeline_stages,iteration_ms,samples_per_s\n1,8,3000,40\n2,8,3100,80\n")
    config = tmp_path / "coordinator.yaml"
    config.write_text(yaml.safe_dump({"profile": str(profile), "lookahead": 3, "distributed-optimizer": True,
                                      "sudden-share": 0.2, "copy-interval": 5, "save-interval": 100}))
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args(["--trace", write_flat_trace(tmp_path / "trace.csv", 16, 10), "--profile", str(profile),
                              "--lookahead", "3", "--distributed-optimizer", "--sudden-share", "0.2",
                              "--copy-interval", "5", "--save-interval", "100"])
    live, simulated = CoordinatorConfig.load(config).optimizer(), simulate.build(args)[1].optimizer()
    for optimizer in (live, simulated):
        assert optimizer.horizon == 3 and optimizer.distributed_optimizer
        assert optimizer.scenarios.sudden == SuddenLosses(0.2, 5, 100) and optimizer.scenarios.distributed_optimizer
    assert live.throughput.layouts() == simulated.throughput.layouts()
    assert live.costs.constants == simulated.costs.constants and live.costs.shape == simulated.costs.shape
