"""`parcae plan`: how many spot instances, and whether on-demand ones too, to train N
samples by a deadline at the lowest cost (the question spotDNN answers).

Each candidate cluster is simulated, not estimated: asking for s spot instances is
replayed as the trace scaled to at most s instances (`AvailabilityTrace.scale`), plus o
on-demand instances that are never preempted, under the `parcae` policy (the liveput
optimizer with the default forecaster), on every trace given. A trace shorter than the
deadline is replayed again from its start. A candidate finishes when its cumulative
samples reach N; it costs what its instances cost until then (spot instances while
available, on-demand ones all along). It qualifies when it finishes before the deadline
on every trace and, with --budget, costs no more than the budget on every trace; the
answer is the qualifying candidate with the lowest worst-case cost.

Instances have `--gpus-per-instance` G GPUs (default 1), as in `parcae simulate`: the
traces and every count here are instances, and a cluster of n instances trains on n x G
GPUs. Spot sizes are tried on a grid up to the instances the profile's largest layout
needs; for each, the fewest on-demand instances that meet the deadline are found by
bisection (more instances never slow training down in the profiles we read).

The search stays short by bounding before simulating: the `ideal` policy (the best
layout of every interval, free changes) trains at least as much as `parcae` and costs
a table lookup per interval, so a cluster whose ideal misses the deadline is never
simulated, and the bisection runs on ideals first. As parcae finishes no sooner than
the ideal, it pays no less: the cheapest ideal over a spot size's on-demand counts is a
floor on what any of its candidates costs. Spot sizes are simulated cheapest floor
first, and one whose floor is above the cheapest candidate found is ruled out unsimulated
(it is listed with its floor): the answer is the one simulating every size would give.
The fastest cluster of all (as many on-demand instances as the largest layout needs)
answers an impossible question at once, with the hours it would take. Simulations stop
once they reach the target, and those of one spot size share the forecasts of its trace.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

import numpy as np

from megatron_parcae.liveput.cost import DEFAULT_CONSTANTS, CostConstants
from megatron_parcae.liveput.factory import LiveputStack, build_liveput
from megatron_parcae.tools import deadline
from megatron_parcae.tools.progress import Progress
from megatron_parcae.tools.simulate import ON_DEMAND_PRICE, SPOT_PRICE, ForecasterFeed, Replay, Simulation
from predictor.traces import AvailabilityTrace
from reconfig.placement import MAX_GPUS_PER_INSTANCE

SPOT_GRID_STEPS = 8


@dataclass(frozen=True)
class Outcome:
    """One cluster on one trace: when it reaches the target, and what it costs until then."""

    hours: float  # inf when it does not finish by the deadline
    dollars: float


@dataclass(frozen=True)
class Candidate:
    spot: int
    on_demand: int
    outcomes: tuple[Outcome, ...]  # one per trace

    @property
    def hours(self) -> float:
        return max(o.hours for o in self.outcomes)

    @property
    def dollars(self) -> float:
        return max(o.dollars for o in self.outcomes)


@dataclass(frozen=True)
class Floor:
    """The least any candidate of `spot` spot instances can cost (worst case over the traces)."""

    spot: int
    dollars: float


def cycled(trace: AvailabilityTrace, interval_seconds: float, intervals: int) -> Replay:
    """`intervals` intervals of the trace, replayed from its start again when it ends."""
    base = Replay.of(trace, interval_seconds)
    repeats = math.ceil(intervals / len(base.counts))
    counts = np.tile(base.counts, repeats)[:intervals]
    change = np.diff(counts, prepend=counts[0])
    arrivals = np.tile(base.arrivals, repeats)[:intervals]
    preemptions = np.tile(base.preemptions, repeats)[:intervals]
    for wrap in range(len(base.counts), intervals, len(base.counts)):  # the jump back to the start
        arrivals[wrap], preemptions[wrap] = max(change[wrap], 0), max(-change[wrap], 0)
    return Replay(interval_seconds, counts, arrivals, preemptions, 0, intervals)


def outcome(rates: np.ndarray, replay: Replay, on_demand: int, samples: float, spot_price: float,
            on_demand_price: float) -> Outcome:
    """When a cluster reaches `samples`, training at `rates` (samples per second of each
    interval from the replay's start, up to the one that reaches the target), and what its
    spot and `on_demand` instances cost until then."""
    per_interval = rates * replay.interval_seconds
    done = np.cumsum(per_interval)
    hours = replay.interval_seconds / 3600
    spot = replay.counts[replay.start:replay.end].astype(float)
    if done[-1] < samples:
        return Outcome(math.inf, float((spot.sum() * spot_price + on_demand * len(spot) * on_demand_price) * hours))
    last = int(np.searchsorted(done, samples))  # the interval in which the target is reached
    before = done[last - 1] if last else 0.0
    fraction = (samples - before) / per_interval[last] if per_interval[last] else 1.0
    elapsed = last + fraction
    spot_hours = (spot[:last].sum() + fraction * spot[last]) * hours
    return Outcome(elapsed * hours, float(spot_hours * spot_price + on_demand * elapsed * hours * on_demand_price))


class Sizer:
    """Simulates candidate clusters over the traces (see the module docstring)."""

    def __init__(self, traces: list[AvailabilityTrace], liveput: LiveputStack, samples: float, deadline_hours: float,
                 spot_price: float, on_demand_price: float):
        self.traces, self.liveput, self.constants = traces, liveput, liveput.constants
        self.samples = samples
        self.spot_price, self.on_demand_price = spot_price, on_demand_price
        self.intervals = max(1, math.ceil(deadline_hours * 3600 / self.constants.interval_seconds))
        self.largest = -(-liveput.throughput.max_workers // liveput.gpus_per_instance)
        self._seen: dict[tuple[str, int, int], Candidate] = {}
        self._replays: dict[tuple[int, int], Replay] = {}
        self._feeds: dict[tuple[int, int], ForecasterFeed] = {}
        self._best_rates: dict[int, float] = {}
        # Simulations finished, their intervals, the one running: one tuple, replaced whole,
        # so that the progress line's thread reads a consistent count.
        self._simulations: tuple[int, int, Simulation | None] = (0, 0, None)

    def simulated(self) -> tuple[int, int]:
        """Simulations started and the intervals they have replayed so far."""
        finished, intervals, running = self._simulations
        return finished + (running is not None), intervals + (running.intervals_done if running else 0)

    def progress(self) -> str:
        """Where the search is, for the progress line (read from its thread)."""
        return "{} clusters priced, {} simulated, {} intervals replayed".format(len(self._seen), *self.simulated())

    def _replay(self, trace: int, spot: int) -> Replay:
        """Trace `trace` scaled to `spot` instances over the deadline."""
        if (trace, spot) not in self._replays:
            if spot:
                replay = cycled(self.traces[trace].scale(spot), self.constants.interval_seconds, self.intervals)
            else:
                none = np.zeros(self.intervals, dtype=np.int64)
                replay = Replay(self.constants.interval_seconds, none, none, none, 0, self.intervals)
            self._replays[trace, spot] = replay
        return self._replays[trace, spot]

    def _feed(self, trace: int, spot: int) -> ForecasterFeed:
        """The forecasts of `_replay(trace, spot)`, made only when a simulation asks for them."""
        if (trace, spot) not in self._feeds:
            self._feeds[trace, spot] = ForecasterFeed(self._replay(trace, spot))
        return self._feeds[trace, spot]

    def _best_rate(self, instances: int) -> float:
        """Samples per second of the best layout on `instances` instances (`ideal`'s rate)."""
        if instances not in self._best_rates:
            best = self.liveput.throughput.best(instances * self.liveput.gpus_per_instance)
            self._best_rates[instances] = 0.0 if best is None else self.liveput.throughput.samples_per_second(best)
        return self._best_rates[instances]

    def _rates(self, trace: int, spot: int, on_demand: int, policy: str) -> np.ndarray:
        """Samples per second of each interval `policy` runs, until it reaches the target.
        The ideal's depend only on each interval's instance count: a table lookup, not a
        simulation."""
        replay = self._replay(trace, spot)
        if policy == "ideal":
            counts = replay.counts[replay.start:replay.end] + on_demand
            return np.array([self._best_rate(n) for n in range(int(counts.max()) + 1)])[counts]
        sim = Simulation(replay, self.liveput, on_demand=on_demand, spot_price=self.spot_price,
                         on_demand_price=self.on_demand_price, feed=self._feed(trace, spot))
        self._simulations = (*self.simulated(), sim)
        return np.array(sim.run(policy, until_samples=self.samples).rates)

    def evaluate(self, spot: int, on_demand: int, policy: str = "parcae") -> Candidate:
        key = (policy, spot, on_demand)
        if key not in self._seen:
            outcomes = []
            for trace in range(len(self.traces)):
                outcomes.append(outcome(self._rates(trace, spot, on_demand, policy), self._replay(trace, spot),
                                        on_demand, self.samples, self.spot_price, self.on_demand_price))
                if not math.isfinite(outcomes[-1].hours):
                    break  # it misses the deadline on this trace: the others do not matter
            self._seen[key] = Candidate(spot, on_demand, tuple(outcomes))
        return self._seen[key]

    def _finishes(self, spot: int, on_demand: int, policy: str = "parcae") -> bool:
        return math.isfinite(self.evaluate(spot, on_demand, policy).hours)

    def fewest_on_demand(self, spot: int, most: int) -> Candidate | None:
        """The smallest on-demand count that meets the deadline with `spot` spot instances:
        bisection on the ideal, then on parcae above the ideal's answer."""
        if not self._finishes(spot, most, "ideal"):
            return None
        probe = self._bisect(spot, 0, most, "ideal")  # parcae needs at least as many
        missed, step = probe - 1, 1
        while not self._finishes(spot, probe):  # parcae is within a few percent of ideal: look just above first
            if probe == most:
                return None
            missed, probe, step = probe, min(most, probe + step), 2 * step
        return self.evaluate(spot, self._bisect(spot, missed + 1, probe, "parcae"))

    def _bisect(self, spot: int, low: int, high: int, policy: str) -> int:
        """The fewest on-demand instances in [low, high] that finish (`high` does)."""
        while low < high:
            middle = (low + high) // 2
            if self._finishes(spot, middle, policy):
                high = middle
            else:
                low = middle + 1
        return high

    def possible(self) -> bool:
        """Whether any cluster can finish: the fastest one does, ideally."""
        return self._finishes(0, self.largest, "ideal")

    def fastest_rate(self) -> float:
        """Samples per second of the fastest cluster (on-demand instances for the largest
        layout, never preempted, at its best layout)."""
        return self._best_rate(self.largest)

    def floor(self, spot: int, most: int) -> Floor | None:
        """The least a cluster of `spot` spot and at most `most` on-demand instances can cost
        if it finishes: at each on-demand count, parcae trains no more than the ideal in
        any interval, so it finishes no sooner and pays no less. None when none finishes."""
        ideals = (self.evaluate(spot, on_demand, "ideal") for on_demand in range(most + 1))
        dollars = [c.dollars for c in ideals if math.isfinite(c.hours)]
        return Floor(spot, min(dollars)) if dollars else None

    def search(self) -> tuple[list[Candidate], list[Floor]]:
        """The fewest-on-demand candidate of each spot size on the grid, cheapest first, and
        the spot sizes left unsimulated because even their ideal costs more than a candidate
        found (so the cheapest candidate is the same as if every size were simulated)."""
        step = max(1, math.ceil(self.largest / SPOT_GRID_STEPS))
        spots = sorted({0, *range(step, self.largest, step), self.largest})
        floors = [f for f in (self.floor(spot, self.largest - spot) for spot in spots) if f is not None]
        found, ruled_out = [], []
        for floor in sorted(floors, key=lambda f: (f.dollars, f.spot)):
            if found and floor.dollars > min(c.dollars for c in found):
                ruled_out.append(floor)
                continue
            candidate = self.fewest_on_demand(floor.spot, self.largest - floor.spot)
            if candidate is not None:
                found.append(candidate)
        return sorted(found, key=lambda c: (c.dollars, c.hours)), ruled_out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="throughput table (CSV) or layer profile (JSON)")
    parser.add_argument("--model", default=None, help="model shape in the cost constants for a CSV profile")
    parser.add_argument("--samples", type=float, required=True, help="samples to train")
    parser.add_argument("--deadline", type=float, required=True, metavar="HOURS", help="hours to finish in")
    parser.add_argument("--budget", type=float, default=None, metavar="DOLLARS", help="most to spend")
    parser.add_argument("--trace", action="append", required=True,
                        help="availability trace of the spot instances; repeat to require every trace")
    parser.add_argument("--cost-constants", default=str(DEFAULT_CONSTANTS), help="migration cost constants JSON")
    parser.add_argument("--lookahead", type=int, default=8, help="intervals the liveput optimizer looks ahead")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="the job trains with --use-distributed-optimizer")
    parser.add_argument("--gpus-per-instance", type=int, default=1, metavar="G",
                        help="GPUs (workers) of one instance; the traces and the answer count instances")
    parser.add_argument("--spot-price", type=float, default=SPOT_PRICE, help="$ per spot instance-hour")
    parser.add_argument("--on-demand-price", type=float, default=ON_DEMAND_PRICE, help="$ per on-demand instance-hour")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    deadline.add_arguments(parser, plan=True)


def _check(args: argparse.Namespace) -> None:
    for name in ("samples", "deadline"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name} must be a positive number, got {value}")
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget >= 0):
        raise ValueError(f"--budget must be a non-negative number, got {args.budget}")
    if args.lookahead < 1:
        raise ValueError(f"--lookahead must be at least 1, got {args.lookahead}")
    if not 1 <= args.gpus_per_instance <= MAX_GPUS_PER_INSTANCE:
        raise ValueError(f"--gpus-per-instance must be from 1 to {MAX_GPUS_PER_INSTANCE}, got {args.gpus_per_instance}")
    if not (args.spot_price >= 0 and args.on_demand_price >= 0):
        raise ValueError("prices must be >= 0")


def _row(c: Candidate) -> dict:
    return {"spot": c.spot, "on_demand": c.on_demand, "hours": round(c.hours, 3), "dollars": round(c.dollars, 2)}


def _impossible(args: argparse.Namespace, sizer: Sizer) -> int:
    """No cluster finishes by the deadline: say what the fastest one would do."""
    rate, gpus = sizer.fastest_rate(), args.gpus_per_instance
    fastest = {"spot": 0, "on_demand": sizer.largest, "gpus": sizer.largest * gpus,
               "hours": round(args.samples / rate / 3600, 3) if rate else None,
               "samples_by_deadline": round(rate * args.deadline * 3600)}
    if args.json:
        print(json.dumps({"gpus_per_instance": gpus, "recommendation": None, "candidates": [], "fastest": fastest},
                         indent=1))
    hours = "never" if fastest["hours"] is None else f"{fastest['hours']:.2f} h"
    print(f"parcae plan: no cluster finishes by the deadline: the fastest, {sizer.largest} on-demand instances "
          f"({sizer.largest * gpus} GPUs) at the profile's best layout, needs {hours} for {args.samples:g} samples "
          f"and trains {fastest['samples_by_deadline']:,} by the deadline", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    if args.max_instances is not None:
        return deadline.plan(args)
    try:
        _check(args)
        constants = CostConstants.load(args.cost_constants)
        traces = [AvailabilityTrace.load(path) for path in args.trace]
        gpus = args.gpus_per_instance
        liveput = build_liveput(args.profile, constants, model=args.model,
                                max_workers=max(t.peak for t in traces) * gpus, lookahead=args.lookahead,
                                distributed_optimizer=args.distributed_optimizer, gpus_per_instance=gpus)
    except (ValueError, OSError) as exc:
        print(f"parcae plan: error: {exc}", file=sys.stderr)
        return 2
    sizer = Sizer(traces, liveput, args.samples, args.deadline, args.spot_price, args.on_demand_price)
    with Progress("parcae plan", lambda elapsed: sizer.progress()):
        possible = sizer.possible()
        candidates, ruled_out = sizer.search() if possible else ([], [])
    if not possible:
        return _impossible(args, sizer)
    affordable = [c for c in candidates if args.budget is None or c.dollars <= args.budget]
    best = affordable[0] if affordable else None
    if args.json:
        print(json.dumps({"gpus_per_instance": gpus, "recommendation": None if best is None else _row(best),
                          "candidates": [_row(c) for c in candidates],
                          "ruled_out": [{"spot": f.spot, "dollars_at_least": round(f.dollars, 2)} for f in ruled_out]},
                         indent=1))
    else:
        print(f"{args.samples:g} samples of {liveput.throughput.model} within {args.deadline:g} h "
              f"on {len(traces)} trace(s), instances of {gpus} GPU(s); cheapest way for each spot size simulated:")
        print(f"{'spot':>6}{'on-demand':>11}{'GPUs':>7}{'hours':>9}{'dollars':>10}")
        for c in candidates:
            print(f"{c.spot:>6}{c.on_demand:>11}{(c.spot + c.on_demand) * gpus:>7}{c.hours:>9.2f}{c.dollars:>10.2f}")
        if ruled_out:
            print("ruled out, as they cost more even ideally: "
                  + ", ".join(f"{f.spot} spot >= ${f.dollars:.2f}" for f in sorted(ruled_out, key=lambda f: f.spot)))
        if best is not None:
            print(f"answer: {best.spot} spot + {best.on_demand} on-demand instances "
                  f"({(best.spot + best.on_demand) * gpus} GPUs), {best.hours:.2f} h, ${best.dollars:.2f} "
                  f"(worst case over the traces)")
    if best is None:
        reason = ("no cluster finishes by the deadline" if not candidates
                  else "no cluster that finishes in time fits the budget")
        print(f"parcae plan: {reason}", file=sys.stderr)
        return 1
    return 0
