"""Time one forecaster update (observe + forecast) on 7 days of 1-minute history.

The live coordinator calls observe() and forecast() once per interval; both together
must stay under 200 ms. A real trace is tiled to the wanted length, fed to the
forecaster, and then the next updates are timed one by one; the Prophet member refits
every 3 hours (180 updates), so the slowest update is one that refits.

    python -m benchmarks.forecast_update [--trace PATH] [--days 7] [--interval 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from predictor.forecast import FORECASTERS, make_forecaster
from predictor.traces import AvailabilityTrace  # noqa: E402

BUDGET_SECONDS = 0.2
DEFAULT_TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "aws-p3" / "p3-trace.csv")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="trace to tile into the history")
    parser.add_argument("--days", type=float, default=7.0, help="history length in days")
    parser.add_argument("--interval", type=float, default=60.0, help="interval in seconds")
    parser.add_argument("--horizon", type=int, default=10)
    parser.add_argument("--forecaster", default="default", choices=FORECASTERS)
    parser.add_argument("--updates", type=int, default=400, help="updates to time after the history")
    args = parser.parse_args()

    steps = int(args.days * 86400 / args.interval)
    base = AvailabilityTrace.load(args.trace).resample(args.interval).counts
    counts = np.tile(base, steps // len(base) + 2)[: steps + args.updates]
    series = AvailabilityTrace.from_counts(np.arange(len(counts)) * args.interval, counts)

    forecaster = make_forecaster(args.forecaster, args.interval, horizon=args.horizon)
    started = time.perf_counter()
    for index in range(steps):
        forecaster.observe(int(series.counts[index]), int(series.preemptions[index]), int(series.arrivals[index]))
    history_seconds = time.perf_counter() - started

    timings = []
    for index in range(steps, steps + args.updates):
        started = time.perf_counter()
        forecaster.observe(int(series.counts[index]), int(series.preemptions[index]), int(series.arrivals[index]))
        forecaster.forecast(args.horizon)
        timings.append(time.perf_counter() - started)
    timings_ms = np.array(timings) * 1000

    print(f"forecaster {args.forecaster}: {steps} intervals of {args.interval:g} s history ({args.days:g} days, "
          f"tiled from {args.trace}), fed in {history_seconds:.1f} s")
    print(f"{args.updates} timed updates (observe + forecast, horizon {args.horizon}):")
    print(f"  median {np.median(timings_ms):.2f} ms, 95th percentile {np.percentile(timings_ms, 95):.2f} ms, "
          f"slowest {timings_ms.max():.2f} ms (budget {BUDGET_SECONDS * 1000:.0f} ms)")
    print(f"  three slowest: {', '.join(f'{value:.1f}' for value in np.sort(timings_ms)[-3:])} ms")
    print(f"  slowest / budget = {timings_ms.max() / (BUDGET_SECONDS * 1000):.2f}, "
          f"median / budget = {np.median(timings_ms) / (BUDGET_SECONDS * 1000):.3f}")
    within = timings_ms.max() <= BUDGET_SECONDS * 1000
    print("within budget" if within else "OVER BUDGET")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
