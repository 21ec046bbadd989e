from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_parcae.cli import main as parcae
from predictor.backtest import backtest_rates
from predictor.rates import ConstantRates, IntervalEvents, SeasonalRates, poisson_log_pmf
from predictor.traces import AvailabilityTrace

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
