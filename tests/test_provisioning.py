"""Instance pools, the deadline policy and its baselines (issue 36): hand-checked dollars
on tiny traces, and the `parcae simulate --deadline-hours` / `parcae plan` interface."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from helpers import REPO
from megatron_parcae.cli import main
from megatron_parcae.provisioning.baselines import gang, omniscient, spot_only
from megatron_parcae.provisioning.elastic import ElasticModel, run_elastic
from megatron_parcae.provisioning.job import DeadlineJob, SpotWindow
from megatron_parcae.provisioning.policy import DeadlinePolicy, Decision, ProvisioningState
from megatron_parcae.provisioning.pools import Market, Pool, PoolConfigError, PriceTrace, load_pools, read_pools

HOUR = 3600.0
PROFILE = str(REPO / "benchmarks" / "results" / "gpu_h200_profile_gpt-1.5b.json")
LINEAR = ElasticModel((0.0, 1.0, 2.0), (0.0, 0.0, 0.0))  # 1 sample/s per instance, changes free
MARKET = Market.constant(spot_price=1.0, on_demand_price=3.0, max_count=2, startup_hours=0.0)


def window(counts, interval=HOUR, start_hours=0.0) -> SpotWindow:
    return SpotWindow(interval, np.array(counts), np.array([], dtype=np.int64), start_hours)


def job(hours_at_full: float, deadline: float, n: int = 2, restart: float = 0.0, rate: float = 2.0, budget=None):
    return DeadlineJob(hours_at_full * HOUR * rate, deadline, n, restart, budget)


# ---- pools -------------------------------------------------------------------------

def test_pool_from_dict_and_price_trace():
    pool = Pool.from_dict({"name": "od", "market": "on-demand", "gpus_per_instance": 8, "max_count": 4,
                           "price": {"trace": [[0, 3.0], [24, 2.5]]}, "startup_hours": 0.05})
    assert not pool.preemptible and pool.startup_hours == 0.05
    assert (pool.price_at(0), pool.price_at(23.9), pool.price_at(24), pool.price_at(99)) == (3.0, 3.0, 2.5, 2.5)
    assert Pool.from_dict({"name": "s", "market": "spot", "gpus_per_instance": 1, "price": 0.9,
                           "max_count": 16}).price_at(5) == 0.9


@pytest.mark.parametrize("change, message", [
    ({"market": "reserved"}, "market must be one of"),
    ({"price": -1}, "price: expected a non-negative number"),
    ({"max_count": 0}, "max_count: expected a positive integer"),
    ({"gpus_per_instance": 1.5}, "gpus_per_instance"),
    ({"startup_hours": "soon"}, "startup_hours"),
    ({"colour": "red"}, "unknown field(s) colour"),
    ({"price": {"trace": [[1, 3.0]]}}, "hours must start at 0"),
    ({"price": {"trace": [[0, 3.0], [0, 2.0]]}}, "strictly increase"),
])
def test_pool_validation(change, message):
    data = {"name": "p", "market": "spot", "gpus_per_instance": 1, "price": 1.0, "max_count": 2, **change}
    with pytest.raises(PoolConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Pool.from_dict(data, "pools[0]")


def test_pools_file_needs_one_of_each_market(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text("pools:\n"
                    "  - {name: s, market: spot, gpus_per_instance: 1, price: 0.9, max_count: 16}\n"
                    "  - {name: o, market: on-demand, gpus_per_instance: 1, price: 3.0, max_count: 16,"
                    " startup_hours: 0.1}\n")
    market = Market.of(read_pools(path))
    assert (market.spot.name, market.on_demand.name, market.on_demand.startup_hours) == ("s", "o", 0.1)
    with pytest.raises(PoolConfigError, match="unique"):
        load_pools([{"name": "s", "market": "spot", "gpus_per_instance": 1, "price": 1, "max_count": 1}] * 2)
    with pytest.raises(PoolConfigError, match="exactly one spot and one on-demand"):
        Market.of(load_pools([{"name": "s", "market": "spot", "gpus_per_instance": 1, "price": 1, "max_count": 1}]))
    assert PriceTrace((0.0, 2.0), (1.0, 2.0)).at(1.5) == 1.0


# ---- baselines on hand-checked traces (1 h intervals, 1 sample/s per instance) -----

def test_on_demand_pays_n_instances_until_done():
    out = gang("on-demand", job(3, 5), window([0] * 10), MARKET, LINEAR)
    assert (out.dollars, out.finish_hours, out.met_deadline, out.on_demand_instance_hours) == (18.0, 3.0, True, 6.0)
    late = gang("on-demand", job(3, 5, restart=0.5), window([0] * 10), MARKET, LINEAR)
    assert late.finish_hours == pytest.approx(3.5) and late.dollars == pytest.approx(21.0)


def test_spot_trains_on_what_there_is():
    out = spot_only(job(3, 5), window([2, 1, 2, 2, 2]), MARKET, LINEAR)
    # 2 + 1 + 2 instance-hours, then half an hour of 2: 6 instance-hours of work at $1
    assert out.finish_hours == pytest.approx(3.5) and out.dollars == pytest.approx(6.0)
    assert out.spot_instance_hours == pytest.approx(6.0) and out.on_demand_instance_hours == 0


def test_greedy_idles_then_waits_for_spot():
    out = gang("greedy", job(3, 10), window([2, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2]), MARKET, LINEAR)
    assert (out.dollars, out.finish_hours, out.met_deadline) == (6.0, 8.0, True)


def test_uniform_progress_buys_on_demand_when_behind_the_line():
    # at hour 4 the line (0.4 of the work) passes its progress (a third): one on-demand hour
    out = gang("uniform-progress", job(3, 10), window([2, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2]), MARKET, LINEAR)
    assert (out.dollars, out.finish_hours, out.met_deadline) == (10.0, 7.0, True)
    assert out.on_demand_instance_hours == 2.0 and out.spot_instance_hours == 4.0


def test_greedy_commits_to_on_demand_when_slack_runs_out():
    out = gang("greedy", job(3, 5), window([2, 0, 0, 2, 2, 2]), MARKET, LINEAR)
    # hour 0 on spot; idle until slack (5 - t - work left) is one interval: on-demand for good
    assert (out.dollars, out.finish_hours, out.met_deadline) == (14.0, 4.0, True)


def test_omniscient_takes_spot_first_then_on_demand():
    out = omniscient(job(3, 3), window([2, 1, 2, 2]), MARKET, LINEAR)
    # 5 spot instance-hours in the 3 h window, 1 on-demand instance-hour for the rest
    assert out.dollars == pytest.approx(8.0) and out.met_deadline
    assert out.spot_instance_hours == pytest.approx(5.0) and out.on_demand_instance_hours == pytest.approx(1.0)


def test_omniscient_runs_few_instances_when_throughput_is_concave():
    concave = ElasticModel((0.0, 1.0, 1.5), (0.0, 0.0, 0.0))
    out = omniscient(DeadlineJob(2 * HOUR, 4, 2, 0.0), window([2, 2, 2, 2]), MARKET, concave)
    assert out.dollars == pytest.approx(2.0)  # one spot instance for 2 of the 4 hours: 1 sample per dollar
    assert out.spot_instance_hours == pytest.approx(2.0)


def test_omniscient_pays_on_demand_start_ups_and_holds_through_a_short_gap():
    slow_start = Market.constant(spot_price=1.0, on_demand_price=3.0, max_count=2, startup_hours=1.0)
    out = omniscient(job(3, 3), window([0, 2, 0]), slow_start, LINEAR)
    # two on-demand instances all 3 h (18) and started once (6) beat spot in hour 1 and a second start (26)
    assert out.dollars == pytest.approx(24.0) and out.met_deadline
    assert out.on_demand_instance_hours == pytest.approx(6.0) and out.spot_instance_hours == pytest.approx(0.0)
    assert omniscient(job(3, 3), window([0, 2, 0]), MARKET, LINEAR).dollars == pytest.approx(14.0)


def test_omniscient_prices_a_start_up_before_a_price_rise_at_the_older_price():
    on_demand = Pool("on-demand", "on-demand", 1, PriceTrace((0.0, 1.0), (1.0, 10.0)), 1, startup_hours=1.0)
    rising = Market(Pool("spot", "spot", 1, 0.5, 1), on_demand)
    out = omniscient(job(2, 2, n=1, rate=1.0), window([1, 0]), rising, LINEAR)
    # a run on spot in hour 0 that starts an on-demand instance meanwhile (at $1) pays 0.5 + 1 + 10
    assert out.dollars == pytest.approx(11.5) and out.met_deadline


def test_omniscient_of_a_job_too_big_for_its_deadline_is_the_cheapest_run_at_full_speed():
    out = omniscient(job(3, 2), window([1, 2]), MARKET, LINEAR)  # 6 hours of work at full speed in 2
    assert not out.met_deadline and out.finish_hours is None
    assert out.dollars == pytest.approx(6.0)  # 1 spot + 1 on-demand, then 2 spot
    assert out.on_demand_instance_hours == pytest.approx(1.0) and out.spot_instance_hours == pytest.approx(3.0)


# ---- the deadline policy -----------------------------------------------------------

def state(**change) -> ProvisioningState:
    base = dict(time_left_hours=10.0, remaining_samples=10 * HOUR, spot_available=0, spot_held=0, on_demand_held=0,
                on_demand_ready=0,
                rates=(0.0, 1.0, 1.9, 2.7, 3.4), spot_outlook=(1, 0, 0, 0, 1), spot_price=1.0, on_demand_price=3.0)
    return ProvisioningState(**{**base, **change})


def test_policy_tops_up_where_spot_is_short_and_releases_when_ahead():
    policy = DeadlinePolicy()
    behind = policy.decide(state(remaining_samples=2.5 * 10 * HOUR))  # spot half the time gives 1.7/s
    assert behind.on_demand > 0 and behind.spot == 0
    assert policy.decide(state(spot_available=4)).on_demand == 0  # full spot: no on-demand
    ahead = policy.decide(state(remaining_samples=1 * HOUR, on_demand_held=4))
    assert ahead.on_demand < 4  # ahead of plan: releases
    assert policy.decide(state(remaining_samples=0)) == Decision(0, 0)


def test_policy_safety_net_and_budget():
    policy = DeadlinePolicy()
    tight = state(remaining_samples=3.4 * 10 * HOUR, spot_available=1)  # full size needs the 10 h left
    assert policy.decide(tight) == Decision(1, 4)  # on-demand for all; spot stands in while they start
    assert policy.decide(replace(tight, on_demand_ready=4)) == Decision(0, 4)
    assert policy.decide(state(budget=5.0)).on_demand == 0  # $5 cannot keep an on-demand instance 10 h
    assert policy.decide(state(budget=1000.0)).on_demand == policy.decide(state()).on_demand


def alternating_window(hours: float, interval: float = 300.0) -> SpotWindow:
    """4 spot instances for an hour, none the next, and so on."""
    steps = int(hours * HOUR / interval)
    counts = np.where((np.arange(steps) * interval // HOUR) % 2 == 0, 4, 0)
    return SpotWindow(interval, counts, counts[:0], 0.0)


def test_deadline_policy_meets_a_deadline_spot_alone_misses():
    model = ElasticModel((0.0, 1.0, 1.9, 2.7, 3.4), (0.0, 30.0, 30.0, 30.0, 30.0))
    market = Market.constant(0.9, 3.0, 4, startup_hours=0.1)
    work = DeadlineJob(10 * HOUR * 3.4, 12.0, 4, 0.1)
    trace = alternating_window(60)
    outcomes = {"spot": spot_only(work, trace, market, model),
                "deadline": run_elastic(work, trace, market, model, DeadlinePolicy().decide),
                "on-demand": gang("on-demand", work, trace, market, model),
                "greedy": gang("greedy", work, trace, market, model),
                "uniform-progress": gang("uniform-progress", work, trace, market, model)}
    bound = omniscient(work, trace, market, model)
    assert not outcomes["spot"].met_deadline and outcomes["spot"].finish_hours > 12
    assert outcomes["deadline"].met_deadline and outcomes["deadline"].on_demand_instance_hours > 0
    assert outcomes["deadline"].dollars < outcomes["on-demand"].dollars
    met = {name: o for name, o in outcomes.items() if o.met_deadline}
    assert bound.met_deadline and all(bound.dollars <= o.dollars + 1e-9 for o in met.values()), \
        {name: o.dollars for name, o in outcomes.items()} | {"omniscient": bound.dollars}


def test_window_wraps_around_the_trace():
    w = SpotWindow.of(np.array([1, 2, 3, 4]), HOUR, 2.0, 4.0)
    assert list(w.counts) == [3, 4, 1, 2] and list(w.history) == [1, 2]
    with pytest.raises(ValueError, match="outside"):
        SpotWindow.of(np.array([1, 2]), HOUR, 5.0, 1.0)


# ---- the command line --------------------------------------------------------------

@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "trace.json"
    counts = ([4] * 6 + [0] * 6) * 20  # 5-minute samples: an hour up, an hour down
    path.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": counts}))
    return str(path)


def test_simulate_deadline_json(small_trace, capsys):
    code = main(["simulate", "--trace", small_trace, "--profile", PROFILE, "--max-instances", "4", "--job-hours", "2",
                 "--deadline-hours", "3", "--spot-price", "0.918", "--on-demand-price", "3.06", "--restart-hours", "0.1",
                 "--policies", "on-demand,spot,greedy,uniform-progress,deadline,omniscient", "--start-hours", "1",
                 "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {"on-demand", "spot", "greedy", "uniform-progress", "deadline", "omniscient"}
    for row in report["policies"].values():
        assert set(row) == {"dollars", "finish_hours", "met_deadline", "on_demand_instance_hours",
                            "spot_instance_hours"}
    on_demand = report["policies"]["on-demand"]
    assert on_demand["finish_hours"] == pytest.approx(2.1) and on_demand["met_deadline"]
    assert on_demand["dollars"] == pytest.approx(4 * 2.1 * 3.06, abs=0.01)
    met = [r["dollars"] for r in report["policies"].values() if r["met_deadline"]]
    assert report["policies"]["omniscient"]["dollars"] <= min(met) + 0.01
    assert report["job"]["start_hours"] == 1.0


def test_plan_prices_the_deadline(small_trace, capsys):
    code = main(["plan", "--profile", PROFILE, "--samples", "100000", "--deadline", "4", "--trace", small_trace,
                 "--max-instances", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["met_deadline"] and out["policy"] == "deadline"
    assert out["traces"][0]["omniscient_dollars"] <= out["dollars"] and math.isfinite(out["dollars"])


@pytest.mark.parametrize("args, message", [
    (["--deadline-hours", "3"], "one of --job-hours or --samples"),
    (["--deadline-hours", "3", "--job-hours", "1", "--policies", "deadline,cheapest"], "unknown cheapest"),
    (["--job-hours", "1", "--policies", "deadline"], "need --deadline-hours"),
    (["--deadline-hours", "3", "--job-hours", "1", "--start-hours", "999"], "outside"),
])
def test_simulate_deadline_errors_are_clear(small_trace, capsys, args, message):
    assert main(["simulate", "--trace", small_trace, "--profile", PROFILE, "--max-instances", "4", *args]) == 2
    err = capsys.readouterr().err
    assert "parcae simulate: error:" in err and message in err and "Traceback" not in err
