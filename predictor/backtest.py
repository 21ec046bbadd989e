"""Rolling-origin back-test of availability forecasters on a trace (`parcae forecast`).

Each forecaster sees the trace one interval at a time, exactly as the live coordinator
feeds it, and forecasts the next ``horizon`` intervals after every interval once
``warmup`` intervals have been seen. Scores, per forecaster:

- ``mae[h]``: mean absolute error of the point forecast (the median) ``h`` steps ahead;
- ``coverage_80``: share of outcomes inside the 10%-90% interval, over all steps, each
  integer outcome counted as spread over [count - 0.5, count + 0.5] (the same
  continuity correction the quantiles use; see ``predictor.forecast``);
- ``width_80``: mean width of that interval (narrower is better at equal coverage);
- ``expected_bias``: mean of expected count minus outcome (0 is unbiased);
- ``preemptions_ratio`` / ``arrivals_ratio``: expected events summed over all forecasts
  divided by the events that happened (1.0 is unbiased; null when none happened);
- ``seconds_per_update``: mean wall time of one ``observe`` + ``forecast``.

With ``--rates`` it also walks the rate models of ``predictor.rates`` (seasonal: by hour
of day; constant) forward through the trace: every ``refit_seconds`` of trace (3 h, which
keeps the Prophet fits of a 270-hour trace to about 150) each model is fitted on all the
intervals so far and scores the ones up to the next refit by the Poisson log-likelihood
of their preemptions and arrivals; the higher total wins.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from predictor.forecast import FORECASTERS, make_forecaster
from predictor.rates import RATE_MODELS, IntervalEvents
from predictor.traces import AvailabilityTrace

__all__ = ["BacktestResult", "RateScore", "backtest", "backtest_rates", "add_arguments", "run"]


@dataclass
class BacktestResult:
    name: str
    mae: list[float]
    mae_at_horizon: float
    coverage_80: float
    width_80: float
    expected_bias: float
    preemptions_ratio: float | None
    arrivals_ratio: float | None
    seconds_per_update: float
    max_seconds_per_update: float
    origins: int
    models: dict[str, float] = field(default_factory=dict)  # share of steps each model forecast


def backtest(
    trace: AvailabilityTrace,
    names: tuple[str, ...],
    horizon: int,
    warmup: int | None = None,
    options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, BacktestResult]:
    """Back-test each named forecaster on an evenly resampled ``trace``.

    ``options`` maps a forecaster name to constructor options (see ``make_forecaster``).
    """
    if trace.interval_seconds is None:
        raise ValueError("back-test needs an evenly spaced trace: resample it first")
    warmup = 2 * horizon if warmup is None else warmup
    if len(trace.counts) < warmup + horizon + 1:
        raise ValueError(
            f"{trace.source}: {len(trace.counts)} intervals are too few for a warm-up of {warmup} "
            f"and a horizon of {horizon}; use a longer trace or a shorter interval"
        )
    options = options or {}
    return {name: _backtest_one(trace, name, horizon, warmup, options.get(name, {})) for name in names}


def _backtest_one(
    trace: AvailabilityTrace, name: str, horizon: int, warmup: int, options: dict[str, Any]
) -> BacktestResult:
    forecaster = make_forecaster(name, trace.interval_seconds, **{"horizon": horizon, **options})
    counts, preempted, arrived = trace.counts, trace.preemptions, trace.arrivals
    last_origin = len(counts) - 1 - horizon
    steps = np.arange(1, horizon + 1)
    abs_error = np.zeros(horizon)
    covered = width = bias = 0.0
    expected_events = np.zeros(2)
    seconds: list[float] = []
    models: dict[str, int] = {}
    for origin in range(last_origin + 1):
        started = time.perf_counter()
        forecaster.observe(int(counts[origin]), int(preempted[origin]), int(arrived[origin]))
        if origin < warmup:
            continue
        forecast = forecaster.forecast(horizon)
        seconds.append(time.perf_counter() - started)
        outcome = counts[origin + steps]
        abs_error += np.abs(outcome - forecast.quantiles[0.5])
        low, high = forecast.interval(0.8)
        covered += np.clip(np.minimum(high, outcome + 0.5) - np.maximum(low, outcome - 0.5), 0, 1).sum()
        width += (high - low).sum()
        bias += (forecast.expected - outcome).sum()
        expected_events += forecast.preemptions.sum(), forecast.arrivals.sum()
        for model in forecast.models:
            models[model] = models.get(model, 0) + 1
    origins = last_origin + 1 - warmup
    happened = [_events_after(events, warmup, last_origin, horizon) for events in (preempted, arrived)]
    mae = abs_error / origins
    return BacktestResult(
        name=name,
        mae=[round(float(value), 4) for value in mae],
        mae_at_horizon=round(float(mae[-1]), 4),
        coverage_80=round(float(covered) / (origins * horizon), 4),
        width_80=round(float(width) / (origins * horizon), 4),
        expected_bias=round(float(bias) / (origins * horizon), 4),
        preemptions_ratio=round(float(expected_events[0]) / happened[0], 4) if happened[0] else None,
        arrivals_ratio=round(float(expected_events[1]) / happened[1], 4) if happened[1] else None,
        seconds_per_update=round(float(np.mean(seconds)), 6),
        max_seconds_per_update=round(float(np.max(seconds)), 6),
        origins=origins,
        models={model: round(count / (origins * horizon), 4) for model, count in sorted(models.items())},
    )


@dataclass
class RateScore:
    log_likelihood: float  # preemptions and arrivals together, summed over the scored intervals
    per_interval: float
    preemptions: float
    arrivals: float
    intervals: int


def backtest_rates(trace: AvailabilityTrace, warmup: int, refit_seconds: float = 3 * 3600.0) -> dict[str, RateScore]:
    """Walk each rate model forward through an evenly resampled ``trace``, scoring every
    interval after the first ``warmup`` (see the module docstring)."""
    events = IntervalEvents.from_trace(trace)
    if not 1 <= warmup < len(events):
        raise ValueError(f"{trace.source}: a warm-up of {warmup} leaves none of its {len(events)} intervals to score")
    refit = max(int(round(refit_seconds / trace.interval_seconds)), 1)
    models = [model_class(trace.interval_seconds) for model_class in RATE_MODELS]
    totals = np.zeros((len(models), 2))
    for begin in range(warmup, len(events), refit):
        history, scored = events.window(0, begin), events.window(begin, begin + refit)
        for row, model in enumerate(models):
            totals[row] += [float(values.sum()) for values in model.fit(history).log_likelihood(scored)]
    intervals = len(events) - warmup
    return {
        model.name: RateScore(
            log_likelihood=round(float(total.sum()), 3),
            per_interval=round(float(total.sum()) / intervals, 5),
            preemptions=round(float(total[0]), 3),
            arrivals=round(float(total[1]), 3),
            intervals=intervals,
        )
        for model, total in zip(models, totals)
    }


def _events_after(events: np.ndarray, first: int, last: int, horizon: int) -> int:
    """Events inside the forecast windows of origins first..last, counted once per window."""
    cumulative = np.concatenate(([0], np.cumsum(events)))
    origins = np.arange(first, last + 1)
    return int((cumulative[origins + horizon + 1] - cumulative[origins + 1]).sum())


# ---- command line -----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", required=True, help="trace file (event CSV, ms,count, date/time/count or SkyPilot JSON)"
    )
    parser.add_argument("--interval", required=True, type=float, help="forecast interval in seconds")
    parser.add_argument("--horizon", required=True, type=int, help="intervals ahead to forecast")
    parser.add_argument("--start-hour", type=float, default=None, help="cut the trace from this hour (default: start)")
    parser.add_argument("--end-hour", type=float, default=None, help="cut the trace up to this hour (default: its end)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="intervals observed before scoring starts (default: 2 x horizon)"
    )
    parser.add_argument(
        "--forecasters", default=",".join(FORECASTERS),
        help=f"comma-separated forecasters to test (default: all of {','.join(FORECASTERS)})",
    )
    parser.add_argument(
        "--rates", action="store_true",
        help="also score a seasonal (hour-of-day) and a constant rate model of preemptions and arrivals",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    names = tuple(name.strip() for name in args.forecasters.split(",") if name.strip())
    try:
        unknown = [name for name in names if name not in FORECASTERS]
        if unknown or not names:
            given = ", ".join(unknown) or "(none given)"
            raise ValueError(f"unknown forecaster(s) {given}; choose from {', '.join(FORECASTERS)}")
        if args.horizon < 1:
            raise ValueError(f"--horizon must be at least 1, got {args.horizon}")
        if args.warmup is not None and args.warmup < 1:
            raise ValueError(f"--warmup must be at least 1, got {args.warmup}")
        trace = AvailabilityTrace.load(args.trace)
        if args.start_hour is not None or args.end_hour is not None:
            start = 0.0 if args.start_hour is None else args.start_hour
            end = trace.duration_seconds / 3600.0 if args.end_hour is None else args.end_hour
            trace = trace.cut(start, end)
        trace = trace.resample(args.interval)
        results = backtest(trace, names, args.horizon, args.warmup)
        warmup = 2 * args.horizon if args.warmup is None else args.warmup
        rates = backtest_rates(trace, warmup) if args.rates else None
    except ValueError as exc:  # TraceFormatError included: file:line: reason
        print(f"parcae forecast: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        report = {"default": "default" if "default" in results else names[0],
                  "forecasters": {name: _json_fields(result) for name, result in results.items()}}
        if rates is not None:
            report["rates"] = {"winner": _rate_winner(rates), **{name: asdict(score) for name, score in rates.items()}}
        print(json.dumps(report, indent=2))
    else:
        print(_table(trace, args.horizon, results))
        if rates is not None:
            print(_rates_table(rates))
    return 0


def _rate_winner(rates: dict[str, RateScore]) -> str:
    """The model with the higher log-likelihood; "tie" when they agree to 0.001."""
    seasonal, constant = rates["seasonal"].log_likelihood, rates["constant"].log_likelihood
    if abs(seasonal - constant) < 1e-3:
        return "tie"
    return "seasonal" if seasonal > constant else "constant"


def _rates_table(rates: dict[str, RateScore]) -> str:
    intervals = next(iter(rates.values())).intervals
    lines = [
        f"rate models, Poisson log-likelihood of {intervals} intervals' preemptions and arrivals (walk-forward):",
        f"{'model':<16}{'total':>12}{'per interval':>14}{'preemptions':>13}{'arrivals':>11}",
    ]
    for name, score in rates.items():
        lines.append(f"{name:<16}{score.log_likelihood:>12.2f}{score.per_interval:>14.4f}"
                     f"{score.preemptions:>13.2f}{score.arrivals:>11.2f}")
    winner = _rate_winner(rates)
    margin = abs(rates["seasonal"].log_likelihood - rates["constant"].log_likelihood)
    by = f", by {margin:.2f} ({margin / intervals:.4f} per interval)" if winner != "tie" else ""
    lines.append(f"winner: {winner}{by}")
    return "\n".join(lines)


def _json_fields(result: BacktestResult) -> dict:
    fields = asdict(result)
    del fields["name"]
    return fields


def _table(trace: AvailabilityTrace, horizon: int, results: dict[str, BacktestResult]) -> str:
    any_result = next(iter(results.values()))
    lines = [
        f"{trace.source}: {len(trace.counts)} intervals of {trace.interval_seconds:g} s, "
        f"horizon {horizon}, {any_result.origins} forecast origins",
        f"{'forecaster':<16}{'MAE@1':>8}{'MAE@H':>8}{'vs last':>9}{'cover80':>9}{'width80':>9}"
        f"{'preempt':>9}{'arrive':>8}{'ms/update':>11}",
    ]
    baseline = results.get("last-value")
    for name, result in results.items():
        comparable = baseline is not None and baseline.mae_at_horizon > 0
        ratio = f"{result.mae_at_horizon / baseline.mae_at_horizon:.3f}" if comparable else "-"
        ratio_text = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
        lines.append(
            f"{name:<16}{result.mae[0]:>8.3f}{result.mae_at_horizon:>8.3f}{ratio:>9}{result.coverage_80:>9.3f}"
            f"{result.width_80:>9.2f}{ratio_text(result.preemptions_ratio):>9}{ratio_text(result.arrivals_ratio):>8}"
            f"{result.seconds_per_update * 1000:>11.2f}"
        )
    lines.append("MAE: point forecast (median); cover80: share of outcomes in the 10-90% interval (target 0.8);")
    lines.append("preempt/arrive: expected events / events that happened (1.00 = unbiased).")
    return "\n".join(lines)
