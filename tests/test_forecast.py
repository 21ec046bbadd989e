"""Forecasters, their calibration and event expectations, and the back-test command."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_parcae.cli import main as parcae
from predictor.backtest import backtest
from predictor.forecast import (
    FORECASTERS,
    AvailabilityForecast,
    ProphetForecaster,
    _smoothed_quantiles,
    make_forecaster,
)
from predictor.traces import AvailabilityTrace

import helpers

TRACES = helpers.TRACES
QUICK_DEFAULT = {"default": {"members": ("last-value", "rolling-median")}}  # no Prophet fits
GOOD_FORECAST = {"interval_seconds": 60, "expected": [1.0], "quantiles": {"0.1": [0.5], "0.5": [1.0], "0.9": [1.5]},
                 "preemptions": [0.1], "arrivals": [0.1]}


def feed(forecaster, counts) -> None:
    for count in counts:
        forecaster.observe(int(count))


def step_process(length: int, seed: int, jump: float = 0.08, top: int = 20) -> np.ndarray:
    """Counts that hold for a while, then jump to a random level: spot-like steps."""
    rng = np.random.default_rng(seed)
    counts = [top]
    for _ in range(length - 1):
        counts.append(int(rng.integers(0, top + 1)) if rng.random() < jump else counts[-1])
    return np.array(counts)


def regular(counts, interval: float = 60.0) -> AvailabilityTrace:
    return AvailabilityTrace.from_counts(np.arange(len(counts)) * interval, counts).resample(interval)


# ---- quantiles of counts ----------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(0, 12), min_size=1, max_size=60), level=st.floats(0.01, 0.99))
def test_smoothed_quantile_inverts_the_spread_cdf(counts: list[int], level: float) -> None:
    ordered = np.sort(np.array(counts, dtype=float))
    value = _smoothed_quantiles(ordered[None, :], np.array([level]))[0, 0]
    spread_cdf = np.clip(value - ordered + 0.5, 0, 1).mean()  # each count uniform on [k-0.5, k+0.5]
    assert spread_cdf == pytest.approx(level, abs=1e-9)


# ---- the forecast object ----------------------------------------------------------


def test_forecast_round_trips_through_json() -> None:
    forecaster = make_forecaster("last-value", 60.0, horizon=4)
    feed(forecaster, step_process(300, seed=1))
    forecast = forecaster.forecast(4)
    again = AvailabilityForecast.from_dict(json.loads(json.dumps(forecast.to_dict())))
    assert np.array_equal(again.expected, forecast.expected)
    assert again.quantiles.keys() == forecast.quantiles.keys()
    assert again.models == ("last-value",) * 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quantiles": {"0.1": [2.0], "0.5": [1.0], "0.9": [3.0]}}, "must not decrease"),
        ({"quantiles": {"0.5": [1.0], "0.9": [3.0]}}, "must include 0.1"),
        ({"expected": [1.0, 2.0]}, "one value per step"),
        ({"preemptions": [-1.0]}, "non-negative"),
        ({"arrivals": "many"}, "list of numbers"),
        ({"interval_seconds": None}, "malformed"),
    ],
)
def test_forecast_from_dict_rejects_bad_input(change: dict, message: str) -> None:
    data = {**GOOD_FORECAST, **change}
    with pytest.raises(ValueError, match=message):
        AvailabilityForecast.from_dict(data)


def test_forecast_from_dict_names_a_missing_field() -> None:
    AvailabilityForecast.from_dict(GOOD_FORECAST)
    with pytest.raises(ValueError, match="missing 'arrivals'"):
        AvailabilityForecast.from_dict({key: value for key, value in GOOD_FORECAST.items() if key != "arrivals"})
    with pytest.raises(ValueError, match="JSON object"):
        AvailabilityForecast.from_dict([GOOD_FORECAST])


# ---- forecasters ------------------------------------------------------------------


def test_names_and_factory() -> None:
    assert {"default", "last-value", "prophet"} <= set(FORECASTERS)
    with pytest.raises(ValueError, match="unknown forecaster"):
        make_forecaster("oracle", 60.0)
    with pytest.raises(ValueError, match="takes no option window"):
        make_forecaster("last-value", 60.0, window=3)
    assert make_forecaster("rolling-median", 60.0, window=3).name == "rolling-median"


def test_last_value_forecast_shape_and_order() -> None:
    forecaster = make_forecaster("last-value", 60.0, horizon=6)
    feed(forecaster, step_process(500, seed=2))
    forecaster.observe(7)
    forecast = forecaster.forecast(6)
    assert forecast.horizon == 6 and forecast.interval_seconds == 60.0
    assert np.all(forecast.quantiles[0.5] == 7)
    levels = sorted(forecast.quantiles)
    assert levels[0] <= 0.1 and levels[-1] >= 0.9
    for low, high in zip(levels, levels[1:]):
        assert np.all(forecast.quantiles[low] <= forecast.quantiles[high])
    assert np.all(forecast.expected >= 0) and np.all(forecast.preemptions >= 0) and np.all(forecast.arrivals >= 0)


def test_expected_events_add_up_to_the_expected_change() -> None:
    forecaster = make_forecaster("last-value", 60.0, horizon=8)
    feed(forecaster, step_process(800, seed=3))
    forecast = forecaster.forecast(8)
    before = np.concatenate(([forecaster._history.last], forecast.expected[:-1]))
    assert np.allclose(forecast.expected - before, forecast.arrivals - forecast.preemptions)


def test_steady_churn_gives_matching_event_rates() -> None:
    # Ten instances; every interval one is preempted and one arrives: the count never moves.
    forecaster = make_forecaster("last-value", 60.0, horizon=5)
    forecaster.observe(10)
    for _ in range(200):
        forecaster.observe(10, preempted=1, arrived=1)
    forecast = forecaster.forecast(5)
    assert np.allclose(forecast.expected, 10)
    assert np.allclose(forecast.preemptions, 1.0) and np.allclose(forecast.arrivals, 1.0)


def test_unexplained_drops_count_as_preemptions() -> None:
    forecaster = make_forecaster("last-value", 60.0, horizon=2)
    forecaster.observe(10)
    for _ in range(100):
        forecaster.observe(7, preempted=1)  # a drop of 3 reported as 1 preemption
        forecaster.observe(10, arrived=3)
    forecast = forecaster.forecast(2)
    assert forecast.preemptions.mean() == pytest.approx(1.5, abs=0.2)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda f: f.observe(-1), "count must be a non-negative integer"),
        (lambda f: f.observe(2.5), "count must be a non-negative integer"),
        (lambda f: f.observe(True), "count must be a non-negative integer"),
        (lambda f: f.observe(3, preempted=-2), "preempted must be"),
        (lambda f: f.forecast(3), "needs at least one observe"),
        (lambda f: f.forecast(0), "horizon must be a positive integer"),
    ],
)
def test_bad_calls_are_value_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(make_forecaster("last-value", 60.0))


def test_longer_horizon_than_configured() -> None:
    forecaster = make_forecaster("default", 60.0, horizon=4, members=("last-value", "rolling-median"))
    feed(forecaster, step_process(200, seed=4))
    assert forecaster.forecast(9).horizon == 9
    feed(forecaster, step_process(50, seed=5))
    forecast = forecaster.forecast(9)
    assert forecast.horizon == 9 and len(forecast.models) == 9


def test_intervals_are_calibrated_on_a_step_process() -> None:
    trace = regular(step_process(2500, seed=6))
    result = backtest(trace, ("last-value",), horizon=10)["last-value"]
    assert 0.75 <= result.coverage_80 <= 0.85
    assert result.preemptions_ratio == pytest.approx(1.0, abs=0.15)
    assert result.arrivals_ratio == pytest.approx(1.0, abs=0.15)
    assert abs(result.expected_bias) < 0.3


def test_default_is_last_value_when_nothing_beats_it() -> None:
    trace = regular(step_process(1500, seed=7))
    results = backtest(trace, ("default", "last-value"), horizon=10, options=QUICK_DEFAULT)
    assert results["default"].mae == results["last-value"].mae
    assert results["default"].models == {"last-value": 1.0}


def test_default_switches_to_a_model_that_clearly_wins() -> None:
    # A steady 10 with one-interval blips to 2: the rolling median ignores the blips.
    rng = np.random.default_rng(8)
    counts = np.full(1500, 10)
    blips = np.flatnonzero(rng.random(1500) < 0.1)
    counts[blips[np.diff(blips, prepend=-2) > 1]] = 2
    results = backtest(regular(counts), ("default", "last-value"), horizon=5, options=QUICK_DEFAULT)
    assert results["default"].models.get("rolling-median", 0) > 0.5
    assert results["default"].mae_at_horizon < 0.8 * results["last-value"].mae_at_horizon


@pytest.mark.slow
def test_prophet_follows_a_trend_and_stays_quiet(capfd, caplog) -> None:
    ramp = np.repeat(np.arange(10, 40), 8)  # one more instance every 8 minutes, 4 hours
    forecaster = ProphetForecaster(60.0, horizon=10, refit_seconds=5400, min_fit_seconds=5400)
    with caplog.at_level(logging.INFO):
        feed(forecaster, ramp[:80])
        assert np.all(forecaster.forecast(10).quantiles[0.5] == ramp[79])  # too little history yet
        feed(forecaster, ramp[80:])
        point = forecaster.forecast(10).quantiles[0.5]
    assert point[-1] > ramp[-1] + 0.5  # predicts the rise that last value cannot
    captured = capfd.readouterr()
    assert "Chain" not in captured.out + captured.err and "plotly" not in captured.out + captured.err
    assert not [record for record in caplog.records if record.name.startswith(("cmdstanpy", "prophet"))]


# ---- the command ------------------------------------------------------------------


def write_counts(tmp_path: Path, counts) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("".join(f"{index * 60_000},{count}\n" for index, count in enumerate(counts)))
    return path


def test_cli_json(tmp_path: Path, capsys) -> None:
    path = write_counts(tmp_path, step_process(400, seed=9))
    code = parcae(["forecast", "--trace", str(path), "--interval", "60", "--horizon", "5",
                   "--forecasters", "last-value,rolling-median", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["default"] == "last-value"  # the first one tested when "default" is not
    for result in report["forecasters"].values():
        assert len(result["mae"]) == 5 and result["mae_at_horizon"] == result["mae"][-1]
        assert 0 <= result["coverage_80"] <= 1 and result["seconds_per_update"] > 0


def test_cli_table_with_cut(tmp_path: Path, capsys) -> None:
    path = write_counts(tmp_path, step_process(400, seed=10))
    code = parcae(["forecast", "--trace", str(path), "--interval", "120", "--horizon", "3",
                   "--start-hour", "1", "--end-hour", "6", "--forecasters", "last-value"])
    assert code == 0
    out = capsys.readouterr().out
    assert "151 intervals of 120 s" in out and "last-value" in out


@pytest.mark.parametrize(
    "text, arguments, message",
    [
        ("0,3\n60000,x\n", [], ":2: instance count 'x'"),
        ("0,3\n60000,4\n", [], "too few"),
        ("0,3\n6000000,4\n", ["--forecasters", "oracle"], "unknown forecaster"),
        ("0,3\n6000000,4\n", ["--start-hour", "5"], "cannot cut"),
    ],
)
def test_cli_errors_exit_non_zero(tmp_path: Path, capsys, text: str, arguments: list[str], message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    code = parcae(["forecast", "--trace", str(path), "--interval", "60", "--horizon", "5", *arguments])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---- acceptance on the real traces (traces/) -------------------------------------


@pytest.mark.parametrize(
    "relative, interval, hours",
    [
        ("aws-p3/p3-trace.csv", 60, None),
        ("aws-g4dn/g4dn-trace.csv", 60, None),
        ("gcp-a100/a100x1-east1b.txt", 60, None),
        ("aws-v100-16node/us-east-2b_v100_1.json", 300, 120),  # the full 270 h is the CLI's job
    ],
)
@pytest.mark.slow
def test_default_never_worse_than_last_value_and_calibrated(relative: str, interval: int, hours: float | None) -> None:
    trace = AvailabilityTrace.load(TRACES / relative)
    if hours:
        trace = trace.cut(0, hours)
    results = backtest(trace.resample(interval), ("default", "last-value"), horizon=10)
    assert results["default"].mae_at_horizon <= results["last-value"].mae_at_horizon
    assert 0.70 <= results["default"].coverage_80 <= 0.90
