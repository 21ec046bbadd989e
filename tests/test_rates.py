from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from megatron_parcae.cli import main as parcae
from megatron_parcae.liveput.cost import CostConstants, MigrationCostModel
from megatron_parcae.liveput.optimizer import LiveputOptimizer, outlook
from megatron_parcae.liveput.throughput import ProfileTable
from predictor.backtest import backtest_rates
from predictor.forecast import AvailabilityForecast
from predictor.rates import (ConstantRates, ForecastRates, IntervalEvents, SeasonalRates, make_rates,
                             poisson_log_pmf)
from predictor.traces import AvailabilityTrace
from reconfig.layout import ModelShape

import helpers

INTERVAL = 600.0


def churn_trace(days: float, preemptions_per_hour, seed: int, instances: int = 20) -> AvailabilityTrace:
    """Instances preempted at ``preemptions_per_hour(hour of day)`` per instance and
    replaced by as many arrivals on average, every ``INTERVAL`` seconds."""
    rng = np.random.default_rng(seed)
    steps = int(days * 86400 / INTERVAL) + 1
    counts, arrivals, preemptions = [instances], [0], [0]
    for step in range(1, steps):
        rate = preemptions_per_hour(int((step - 1) * INTERVAL % 86400 // 3600)) * INTERVAL / 3600
        preempted = min(int(rng.poisson(rate * counts[-1])), counts[-1])
        arrived = int(rng.poisson(rate * instances))
        counts.append(counts[-1] - preempted + arrived)
        arrivals.append(arrived)
        preemptions.append(preempted)
    times = np.arange(steps) * INTERVAL
    return AvailabilityTrace(times, counts, arrivals, preemptions, INTERVAL)


def test_poisson_log_pmf_by_hand() -> None:
    values = poisson_log_pmf(np.array([2, 0, 0, 1]), np.array([1.5, 0.7, 0.0, 0.0]))
    assert values[0] == pytest.approx(2 * math.log(1.5) - 1.5 - math.log(2))
    assert values[1] == pytest.approx(-0.7)
    assert values[2] == 0.0 and values[3] == -math.inf


def test_constant_rates_by_hand() -> None:
    history = IntervalEvents(starts=np.array([0.0, 600.0, 1200.0]), instances=np.array([4, 3, 5]),
                             preemptions=np.array([1, 0, 2]), arrivals=np.array([0, 2, 1]))
    model = ConstantRates(INTERVAL).fit(history)
    preemption_rate, arrival_rate = (3 + 0.5) / (4 + 3 + 5 + 3 + 1), (3 + 0.5) / (3 + 1)
    expected = model.expected(np.array([1800.0]), np.array([6]))
    assert expected[0][0] == pytest.approx(preemption_rate * (6 + arrival_rate))
    assert expected[1][0] == pytest.approx(arrival_rate)
    observed = IntervalEvents(np.array([1800.0]), np.array([6]), np.array([2]), np.array([1]))
    preempted, arrived = model.log_likelihood(observed)
    mean = preemption_rate * (6 + 1)  # the instance that arrived could have been preempted too
    assert preempted[0] == pytest.approx(2 * math.log(mean) - mean - math.log(2))
    assert arrived[0] == pytest.approx(math.log(arrival_rate) - arrival_rate)


def test_seasonal_is_constant_on_less_than_a_day() -> None:
    trace = churn_trace(0.9, lambda hour: 1.0 if hour < 6 else 0.05, seed=1)
    scores = backtest_rates(trace, warmup=8)  # refits 20 minutes into an hour
    assert scores["seasonal"] == scores["constant"]


def test_seasonal_wins_on_a_daily_cycle() -> None:
    trace = churn_trace(2.5, lambda hour: 0.6 if hour < 6 else 0.03, seed=2)
    scores = backtest_rates(trace, warmup=6, refit_seconds=6 * 3600)  # 3 Prophet refits
    assert scores["seasonal"].log_likelihood > scores["constant"].log_likelihood + 0.05 * scores["seasonal"].intervals
    history = IntervalEvents.from_trace(trace)  # 60 whole hours
    seasonal, constant = SeasonalRates(INTERVAL).fit(history), ConstantRates(INTERVAL).fit(history)
    busy, quiet = seasonal.rates(np.array([3 * 3600.0, 15 * 3600.0]))[0]
    assert busy > 5 * quiet  # Prophet's fit finds the cycle (true ratio 20)
    exposure = history.instances + history.arrivals  # the level is the history's, the shape Prophet's
    assert (seasonal.rates(history.starts)[0] * exposure).sum() == pytest.approx(
        (constant.rates(history.starts)[0] * exposure).sum())


def test_seasonal_gains_nothing_on_a_constant_rate() -> None:
    trace = churn_trace(2.5, lambda hour: 0.2, seed=3)
    scores = backtest_rates(trace, warmup=6, refit_seconds=6 * 3600)
    assert scores["seasonal"].log_likelihood <= scores["constant"].log_likelihood


def test_cli_rates_json_and_table(tmp_path, capsys) -> None:
    trace = churn_trace(0.5, lambda hour: 0.2, seed=4)
    path = tmp_path / "trace.csv"
    path.write_text("".join(f"{int(time * 1000)},{count}\n" for time, count in zip(trace.times, trace.counts)))
    arguments = ["forecast", "--trace", str(path), "--interval", "600", "--horizon", "3", "--forecasters", "last-value"]
    assert parcae([*arguments, "--rates", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"default", "forecasters", "rates"}
    assert report["rates"]["winner"] == "tie" and report["rates"]["constant"]["intervals"] == 72 - 6
    assert parcae(arguments) == 0
    assert "rate models" not in capsys.readouterr().out  # opt-in
    assert parcae([*arguments, "--rates"]) == 0
    assert "winner: tie" in capsys.readouterr().out


@pytest.mark.parametrize("relative, hours", [
    ("aws-p3/p3-trace.csv", None), ("aws-g4dn/g4dn-trace.csv", None), ("gcp-a100/a100x1-east1b.txt", None),
    ("aws-v100-16node/us-east-2b_v100_1.json", 54),  # two Prophet refits; the full 270 h is the CLI's job
])
def test_every_shared_trace_is_scored(relative: str, hours: float | None) -> None:
    trace = AvailabilityTrace.load(helpers.TRACES / relative)
    scores = backtest_rates((trace.cut(0, hours) if hours else trace).resample(300), warmup=20)
    for score in scores.values():
        assert math.isfinite(score.log_likelihood) and score.log_likelihood < 0
        assert score.log_likelihood == pytest.approx(score.preemptions + score.arrivals, abs=0.01)


# ---- rate models in liveput's forecasts ---------------------------------------------------

def uncertain_forecast(counts: list[float], interval: float = INTERVAL) -> AvailabilityForecast:
    """Counts with a spread (so liveput draws preemptions from a Poisson), and the
    forecaster's own expected events."""
    counts = np.array(counts, dtype=float)
    return AvailabilityForecast(interval, counts, {0.1: counts - 0.4, 0.5: counts, 0.9: counts + 0.4},
                                np.full(len(counts), 0.1), np.full(len(counts), 0.2))


# [instances, preemptions, arrivals] per interval, as a forecaster observes them: 7 intervals
ROWS = [[4, 0, 0], [3, 1, 0], [4, 0, 1], [4, 0, 0], [5, 0, 1], [4, 1, 0], [4, 0, 0], [4, 0, 0]]


def test_forecast_rates_put_the_models_means_in_the_forecast() -> None:
    forecast = uncertain_forecast([5, 6, 6])
    rated = ForecastRates(ConstantRates(INTERVAL)).apply(forecast, ROWS, 7200.0)
    preemption_rate, arrival_rate = (2 + 0.5) / (28 + 2 + 1), (2 + 0.5) / (7 + 1)  # events over exposure
    # each step's preemptions hit the instances of the step before: the history's last count, then the forecast's
    assert rated.preemptions == pytest.approx(preemption_rate * (np.array([4, 5, 6]) + arrival_rate))
    assert rated.arrivals == pytest.approx([arrival_rate] * 3)
    assert np.array_equal(rated.expected, forecast.expected)  # the counts stay the forecaster's
    assert all(np.array_equal(rated.quantiles[level], values) for level, values in forecast.quantiles.items())
    assert ForecastRates(ConstantRates(INTERVAL)).apply(forecast, ROWS[:6], 7200.0) is forecast  # under an hour
    with pytest.raises(ValueError, match="rates of 600 s"):
        ForecastRates(ConstantRates(INTERVAL)).apply(uncertain_forecast([5], 60.0), ROWS, 7200.0)


def test_forecast_rates_refit_at_the_first_forecast_of_each_hour() -> None:
    rates, forecast = ForecastRates(ConstantRates(INTERVAL)), uncertain_forecast([4])
    first = rates.apply(forecast, ROWS, 7200.0).preemptions  # the last row starts 2 h into the clock
    stormy = ROWS + [[4, 4, 4]] * 5
    assert rates.apply(forecast, stormy[:9], 7800.0).preemptions == pytest.approx(first)  # still hour 2
    assert rates.apply(forecast, stormy, 10800.0).preemptions[0] > 2 * first[0]  # hour 3: refitted


def test_make_rates_knows_the_names_configs_use() -> None:
    assert make_rates("none", 60.0) is None
    assert isinstance(make_rates("constant", 60.0).model, ConstantRates)
    assert isinstance(make_rates("seasonal", 60.0).model, SeasonalRates)
    with pytest.raises(ValueError, match="unknown rate model 'hourly'; known: none, seasonal, constant"):
        make_rates("hourly", 60.0)


TINY = ModelShape("gpt", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128,
                  max_position_embeddings=32)


def test_a_busy_hour_raises_the_outlooks_preemptions_and_changes_the_decision() -> None:
    """A day and a half of 8 instances, one preempted and replaced every minute of hour 3
    of the day and none otherwise. At hour 3 the seasonal model expects far more
    preemptions than the constant one, so the optimizer (no notice: a preemption can take
    a stage's last replica) keeps spare instances that the constant model's outlook finds
    not worth keeping; at a quiet hour it expects fewer, and both keep none spare."""
    interval = 60.0
    busy_hour = [int((k - 1) * interval % 86400 // 3600 == 3) for k in range(1, 2161)]  # events end interval k - 1
    rows = [[8, 0, 0]] + [[8, event, event] for event in busy_hour]
    constants = dataclasses.replace(CostConstants.load(), grace_period_seconds=0.0)
    table = ProfileTable({(1, 4, 1): 3.0, (1, 1, 8): 3.1}, "tiny", 12, TINY)  # 4 of the 8 instances, or all
    forecast = uncertain_forecast([8] * 7, interval)
    chosen = {}
    for hour in (3, 10):
        now = 86400 + hour * 3600.0
        history = rows[:int(now // interval) + 1]
        for model in (SeasonalRates(interval), ConstantRates(interval)):
            rated = ForecastRates(model).apply(forecast, history, now)
            steps = outlook(rated, 8, 7)
            mean = sum(p * k for p, k in steps[0].preemptions)
            decision = LiveputOptimizer(table, MigrationCostModel(constants, TINY), 8).decide(None, range(8), rated)
            chosen[hour, model.name] = (rated.preemptions[0], mean, decision.layout.parallelism.dp,
                                        decision.expected_samples)
    busy, busy_constant = chosen[3, "seasonal"], chosen[3, "constant"]
    assert busy[0] > 10 * busy_constant[0] and busy[1] > 10 * busy_constant[1]
    assert (busy[2], busy_constant[2]) == (1, 8) and busy[3] < busy_constant[3]
    quiet, quiet_constant = chosen[10, "seasonal"], chosen[10, "constant"]
    assert quiet[0] < quiet_constant[0]
    assert quiet[2] == quiet_constant[2] == 8 and quiet[3] > quiet_constant[3]
