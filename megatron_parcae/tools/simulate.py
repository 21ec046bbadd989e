"""`parcae simulate`: replay a spot trace interval by interval and compare layout policies.

The trace counts instances of `--gpus-per-instance` G GPUs (default 1), one worker per
GPU; a preemption takes an instance's G workers at once, and only layouts whose T
divides G run (a tensor-parallel group stays inside an instance).

The replay starts cold, as Parcae's simulator does: at the first interval every policy
but `ideal` starts the job from a checkpoint. Each interval (the cost constants'
`interval_seconds`, 60 s for Parcae's) starts with the trace's preemptions and
arrivals: preempted instances are drawn uniformly among the running spot instances
(seeded, the same draws for every policy; `--draws` replays several and reports means)
and get the grace period's notice when the constants give one. Then each policy picks
the layout for the interval and pays its migration; what a migration leaves unfinished
at the interval's end carries into the next. Policies:

- `ideal`: the highest-throughput layout for the GPUs available, changes free;
- `throughput`: Parcae's reactive throughput-optimal baseline: the same layout, but
  every availability change restarts Parcae's engine from a checkpoint, priced and
  overlapped as Parcae's simulator does (`MigrationCostModel.reactive_restart_cost`; a
  change while a restart is under way pays the new one plus another restart);
- `parcae`: the liveput optimizer with the predictor's default forecaster, which has
  seen the trace up to now (history before the replayed segment included); `--rates`
  takes its expected preemptions from a rate model fitted on that history instead
  (`predictor.rates.ForecastRates`, as the coordinator's `rates` key);
- `parcae-oracle`: the liveput optimizer told the true future counts and preemptions.

`--sudden-share`, `--copy-interval` and `--save-interval` change only how the liveput
policies price the coming preemptions (liveput/scenarios.SuddenLosses, as the
coordinator's keys of those names); the replay gives each preemption the constants' notice.

Every instance of the cluster is paid for whether a policy uses it or not: spot
instances at `--spot-price`, always-on on-demand ones (`--on-demand`) at
`--on-demand-price`, per instance-hour. Defaults are AWS p3.2xlarge in us-east-1:
$3.06 on demand and $0.918 spot (30% of it, the usual spot discount for this type);
pass the prices of your instance type, region and date.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from megatron_parcae.liveput.cost import COST_MODELS, DEFAULT_CONSTANTS, CostConstants
from megatron_parcae.liveput.factory import LiveputStack, build_liveput
from megatron_parcae.liveput.scenarios import SuddenLosses
from megatron_parcae.tools import deadline
from megatron_parcae.tools.progress import Progress, counted
from predictor.forecast import AvailabilityForecast, make_forecaster
from predictor.rates import RATES, make_rates
from predictor.traces import AvailabilityTrace
from reconfig.layout import Layout, Parallelism
from reconfig.placement import MAX_GPUS_PER_INSTANCE, Placement

POLICIES = ("ideal", "throughput", "parcae", "parcae-oracle")
SPOT_PRICE = 0.918  # $ per p3.2xlarge instance-hour, 30% of on demand
ON_DEMAND_PRICE = 3.06  # $ per p3.2xlarge instance-hour, us-east-1


@dataclass(frozen=True)
class Replay:
    """The intervals to replay and the trace before them (what a forecaster has seen).

    Index i of every array is interval i of the whole resampled trace; the replay covers
    [start, end). `arrivals[i]` and `preemptions[i]` happen at interval i's start.
    """

    interval_seconds: float
    counts: np.ndarray
    arrivals: np.ndarray
    preemptions: np.ndarray
    start: int
    end: int

    @classmethod
    def load(cls, path: str | Path, interval_seconds: float, start_hour: float | None = None,
             end_hour: float | None = None) -> Replay:
        return cls.of(AvailabilityTrace.load(path), interval_seconds, start_hour, end_hour)

    @classmethod
    def of(cls, trace: AvailabilityTrace, interval_seconds: float, start_hour: float | None = None,
           end_hour: float | None = None) -> Replay:
        """Interval i starts i intervals after the trace start and has the count after that
        instant's events; hours cut as Parcae's simulator cuts them (start floored, end ceiled)."""
        trace = trace.resample(interval_seconds)
        steps = len(trace.counts)
        start = 0 if start_hour is None else math.floor(start_hour * 3600 / interval_seconds + 1e-9)
        end = steps if end_hour is None else min(steps, math.ceil(end_hour * 3600 / interval_seconds - 1e-9))
        if not 0 <= start < end:
            raise ValueError(f"{trace.source}: hours {start_hour}-{end_hour} select no interval of a "
                             f"{trace.duration_seconds / 3600:.2f} h trace")
        return cls(interval_seconds, trace.counts, trace.arrivals, trace.preemptions, start, end)

    @property
    def intervals(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Step:
    """What happens at one interval's start: which spot instances go, how many come."""

    preempted: tuple[int, ...]
    arrived: tuple[int, ...]


def draw_steps(replay: Replay, on_demand: int, seed: int) -> tuple[frozenset[int], list[Step]]:
    """Instance ids at the replay's start and each interval's events, drawn once for all
    policies. On-demand instances have ids from 0 and are never preempted."""
    rng = random.Random(seed)
    next_id = on_demand + int(replay.counts[replay.start])
    spot = set(range(on_demand, next_id))
    steps = [Step((), ())]
    for i in range(replay.start + 1, replay.end):
        gone = tuple(sorted(rng.sample(sorted(spot), min(int(replay.preemptions[i]), len(spot)))))
        new = tuple(range(next_id, next_id + int(replay.arrivals[i])))
        next_id += len(new)
        spot.difference_update(gone)
        spot.update(new)
        steps.append(Step(gone, new))
    return frozenset(range(on_demand + int(replay.counts[replay.start]))), steps


@dataclass
class PolicyRun:
    """What one policy did: per interval, its layout, throughput and time lost."""

    name: str
    samples: float = 0.0
    dollars: float = 0.0
    layouts: list[Parallelism | None] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # samples per second over each interval
    lost_seconds: float = 0.0
    migrations: float = 0  # a count; a mean when averaged over draws
    restarts: float = 0
    decision_seconds: list[float] = field(default_factory=list)  # wall clock of each decide()
    decision_cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU time of each

    def add(self, layout: Parallelism | None, rate: float, work_seconds: float, interval: float) -> None:
        self.layouts.append(layout)
        self.samples += rate * work_seconds
        self.rates.append(rate * work_seconds / interval)


def averaged(runs: list[PolicyRun]) -> PolicyRun:
    """One policy's runs over several preemption draws as one: samples, time lost, changes
    and rates are their means (the layouts are the first draw's), decisions all of theirs.
    Parcae's artifact charges each change at its mean over its draws, so the mean over
    draws is what compares with its figures."""
    if len(runs) == 1:
        return runs[0]
    return replace(runs[0], samples=float(np.mean([r.samples for r in runs])),
                   lost_seconds=float(np.mean([r.lost_seconds for r in runs])),
                   migrations=float(np.mean([r.migrations for r in runs])),
                   restarts=float(np.mean([r.restarts for r in runs])),
                   rates=list(np.mean([r.rates for r in runs], axis=0)),
                   decision_seconds=[t for r in runs for t in r.decision_seconds],
                   decision_cpu_seconds=[t for r in runs for t in r.decision_cpu_seconds])


class Simulation:
    """Replays one trace segment for one liveput stack; see the module docstring."""

    def __init__(self, replay: Replay, liveput: LiveputStack, seed: int = 0, on_demand: int = 0,
                 spot_price: float = SPOT_PRICE, on_demand_price: float = ON_DEMAND_PRICE,
                 feed: ForecasterFeed | None = None):
        """`feed`: the forecasts of this replay's spot instances, shared with other
        simulations of the same replay (forecasting costs as much as deciding)."""
        if liveput.constants.interval_seconds != replay.interval_seconds:
            raise ValueError("the replay and the cost constants disagree on the interval length")
        if feed is not None and feed.replay is not replay:
            raise ValueError("the forecaster feed is of another replay")
        self.replay, self.liveput = replay, liveput
        self.feed = feed
        self.throughput, self.costs = liveput.throughput, liveput.costs
        self.gpus = liveput.gpus_per_instance
        self.on_demand = on_demand
        self.interval = replay.interval_seconds
        self.initial, self.steps = draw_steps(replay, on_demand, seed)
        instances = len(self.initial) + sum(len(step.arrived) for step in self.steps)
        self.placement = Placement(self.gpus, {w: str(w // self.gpus) for w in range(instances * self.gpus)})
        hours = self.interval / 3600
        spot_hours = float(replay.counts[replay.start:replay.end].sum()) * hours
        self.dollars = spot_hours * spot_price + on_demand * replay.intervals * hours * on_demand_price
        self.intervals_done = 0  # over every policy run, for progress

    def instances(self, i: int) -> int:
        return int(self.replay.counts[self.replay.start + i]) + self.on_demand

    def workers(self, instances: Iterable[int]) -> set[int]:
        """The workers (GPUs) of `instances`: instance k runs workers k*G .. k*G+G-1."""
        return {k * self.gpus + g for k in instances for g in range(self.gpus)}

    def run(self, policy: str, until_samples: float = math.inf) -> PolicyRun:
        """Replay `policy`; with `until_samples`, only until it has trained that many."""
        runners = {"ideal": self._ideal, "throughput": self._reactive,
                   "parcae": lambda: self._liveput("parcae", oracle=False, until=until_samples),
                   "parcae-oracle": lambda: self._liveput("parcae-oracle", oracle=True, until=until_samples)}
        if policy not in runners:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        result = runners[policy]()
        result.dollars = self.dollars
        return result

    def _ideal(self) -> PolicyRun:
        run = PolicyRun("ideal")
        for i in range(self.replay.intervals):
            best = self.throughput.best(self.instances(i) * self.gpus)
            rate = 0.0 if best is None else self.throughput.samples_per_second(best)
            run.add(best, rate, self.interval, self.interval)
            self.intervals_done += 1
        return run

    def _reactive(self) -> PolicyRun:
        run = PolicyRun("throughput")
        busy = 0.0
        for i, step in enumerate(self.steps):
            best = self.throughput.best(self.instances(i) * self.gpus)
            lost = busy
            if best is not None and (i == 0 or step.preempted or step.arrived):
                restart = self.costs.reactive_restart_cost(best, joining=bool(step.arrived), cold=i == 0)
                lost = restart.seconds + (restart.world_seconds + restart.groups_seconds + restart.build_seconds
                                          if busy > 0 else 0.0)
                run.restarts += 1
            busy = self._account(run, best, lost)
        return run

    def _account(self, run: PolicyRun, layout: Parallelism | None, lost: float) -> float:
        """Book one interval; returns the migration time carried into the next."""
        rate = 0.0 if layout is None else self.throughput.samples_per_second(layout)
        work = max(0.0, self.interval - lost)
        run.lost_seconds += min(lost, self.interval)
        run.add(layout, rate, work, self.interval)
        self.intervals_done += 1
        return max(0.0, lost - self.interval)

    def _liveput(self, name: str, oracle: bool, until: float) -> PolicyRun:
        run = PolicyRun(name)
        optimizer = self.liveput.optimizer()
        forecasts = OracleForecasts(self.replay, self.on_demand) if oracle else \
            _Shifted(self.feed or ForecasterFeed(self.replay), self.on_demand)
        notice = self.costs.constants.grace_period_seconds > 0
        available = self.workers(self.initial)
        layout: Layout | None = None
        busy = 0.0
        for i, step in enumerate(self.steps):
            preempted = self.workers(step.preempted)
            available.difference_update(preempted)
            available.update(self.workers(step.arrived))
            forecast = forecasts.after(i, self.liveput.lookahead - 1)
            leaving = frozenset(preempted) & layout.workers if (layout is not None and notice) else frozenset()
            started, cpu = time.perf_counter(), time.process_time()
            decision = optimizer.decide(layout, available, forecast, leaving, busy, self.placement)
            run.decision_seconds.append(time.perf_counter() - started)
            run.decision_cpu_seconds.append(time.process_time() - cpu)
            if layout is not None and decision.layout != layout:
                run.migrations += 1
                run.restarts += decision.cost.restart
            layout = decision.layout
            busy = self._account(run, None if layout is None else layout.parallelism, busy + decision.cost.seconds)
            if run.samples >= until:
                break
        return run


class OracleForecasts:
    """The true future as a forecast that is certain (quantiles equal the counts)."""

    def __init__(self, replay: Replay, on_demand: int):
        self.replay, self.on_demand = replay, on_demand

    def after(self, i: int, horizon: int) -> AvailabilityForecast | None:
        """What the next `horizon` intervals after interval i bring."""
        if horizon == 0:
            return None
        r = self.replay
        index = np.minimum(np.arange(r.start + i + 1, r.start + i + 1 + horizon), len(r.counts) - 1)
        inside = np.arange(r.start + i + 1, r.start + i + 1 + horizon) < len(r.counts)
        counts = (r.counts[index] + self.on_demand).astype(float)
        return AvailabilityForecast(r.interval_seconds, counts, {0.1: counts, 0.5: counts, 0.9: counts},
                                    np.where(inside, r.preemptions[index], 0).astype(float),
                                    np.where(inside, r.arrivals[index], 0).astype(float))


class ForecasterFeed:
    """The predictor's default forecaster, fed the trace up to the current interval, its
    expected events a rate model's when `rates` names one (`predictor.rates.RATES`); its
    forecasts are kept, so simulations of one replay share them."""

    def __init__(self, replay: Replay, rates: str = "none"):
        self.replay = replay
        self.forecaster = make_forecaster("default", replay.interval_seconds)
        self.rates = make_rates(rates, replay.interval_seconds)
        self._rows = np.column_stack((replay.counts, replay.preemptions, replay.arrivals))
        self._forecasts: list[AvailabilityForecast | None] = []
        self._horizon: int | None = None
        for i in range(replay.start):
            self._observe(i)

    def _observe(self, i: int) -> None:
        r = self.replay
        self.forecaster.observe(int(r.counts[i]), int(r.preemptions[i]), int(r.arrivals[i]))

    def after(self, i: int, horizon: int) -> AvailabilityForecast | None:
        """Observe interval i (and those before it), then forecast the `horizon` after it."""
        if self._horizon not in (None, horizon):
            raise ValueError(f"this feed forecasts {self._horizon} intervals, not {horizon}")
        self._horizon = horizon
        while len(self._forecasts) <= i:
            last = self.replay.start + len(self._forecasts)
            self._observe(last)
            forecast = self.forecaster.forecast(horizon) if horizon else None
            if forecast is not None and self.rates is not None:  # interval `last` starts at last x interval
                forecast = self.rates.apply(forecast, self._rows[:last + 1], last * self.replay.interval_seconds)
            self._forecasts.append(forecast)
        return self._forecasts[i]


class _Shifted:
    """A feed's forecasts of the spot instances, plus `on_demand` that are never preempted."""

    def __init__(self, feed: ForecasterFeed, on_demand: int):
        self.feed, self.on_demand = feed, on_demand

    def after(self, i: int, horizon: int) -> AvailabilityForecast | None:
        forecast = self.feed.after(i, horizon)
        if forecast is None or not self.on_demand:
            return forecast
        shifted = {q: v + self.on_demand for q, v in forecast.quantiles.items()}
        return AvailabilityForecast(forecast.interval_seconds, forecast.expected + self.on_demand, shifted,
                                    forecast.preemptions, forecast.arrivals)


def percentile_ms(seconds: list[float], q: float) -> float:
    return float(np.percentile(np.array(seconds) * 1000, q)) if seconds else 0.0


def report(sim: Simulation, runs: dict[str, PolicyRun]) -> dict:
    """The JSON report: samples, share of ideal and dollars per policy, decision times."""
    ideal = runs["ideal"].samples if "ideal" in runs else sim.run("ideal").samples
    decisions = [s for run in runs.values() for s in run.decision_seconds]
    return {
        "policies": {name: {"samples": round(run.samples, 1),
                            "ratio_to_ideal": round(run.samples / ideal, 4) if ideal else 0.0,
                            "dollars": round(run.dollars, 2), "migrations": round(run.migrations, 2),
                            "restarts": round(run.restarts, 2), "lost_seconds": round(run.lost_seconds, 1)}
                     for name, run in runs.items()},
        "decision_ms": {"p50": round(percentile_ms(decisions, 50), 3), "p99": round(percentile_ms(decisions, 99), 3),
                        "max": round(max(decisions, default=0.0) * 1000, 3)},
        "intervals": sim.replay.intervals,
        "gpus_per_instance": sim.gpus,
    }


def plot_timeline(sim: Simulation, runs: dict[str, PolicyRun], path: str | Path) -> None:
    """PNG: availability, the layout each policy ran (instances used, P), its throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = np.arange(sim.replay.intervals) * sim.interval / 60
    fig, (avail, shape, rate) = plt.subplots(3, 1, sharex=True, figsize=(11, 8))
    counts = [sim.instances(i) for i in range(sim.replay.intervals)]
    avail.step(minutes, counts, where="post", color="black", label="available")
    for name, run in runs.items():
        used = [0 if p is None else -(-p.world_size // sim.gpus) for p in run.layouts]
        stages = [0 if p is None else p.pp for p in run.layouts]
        avail.step(minutes, used, where="post", label=f"{name}: used", alpha=0.7)
        shape.step(minutes, stages, where="post", label=name, alpha=0.8)
        rate.step(minutes, run.rates, where="post", label=name, alpha=0.8)
    avail.set_ylabel("instances")
    shape.set_ylabel("pipeline stages P")
    rate.set_ylabel("samples / s\n(net of migrations)")
    rate.set_xlabel("minutes")
    for ax in (avail, shape, rate):
        ax.legend(fontsize=7, loc="lower left")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="availability trace (any format predictor.traces reads)")
    parser.add_argument("--start-hour", type=float, default=None, help="replay from this hour of the trace")
    parser.add_argument("--end-hour", type=float, default=None, help="replay up to this hour of the trace")
    parser.add_argument("--profile", required=True,
                        help="throughput table (CSV, Parcae's format) or layer profile "
                             "(JSON, see megatron_parcae/liveput/throughput.py)")
    parser.add_argument("--model", default=None,
                        help="model shape in the cost constants for a CSV profile (default: its '# model=' line)")
    parser.add_argument("--cost-constants", default=str(DEFAULT_CONSTANTS),
                        help="migration cost constants JSON (default: Parcae's, shipped with megatron-parcae)")
    parser.add_argument("--cost-model", choices=tuple(COST_MODELS), default="megatron-parcae",
                        help="who prices a layout change: megatron-parcae (this project's in-place executor) or "
                             "parcae (what Parcae's artifact charges, to compare with its figures)")
    parser.add_argument("--lookahead", type=int, default=8, help="intervals the liveput optimizer looks ahead")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="the job trains with --use-distributed-optimizer (as the coordinator's config says)")
    parser.add_argument("--gpus-per-instance", type=int, default=1, metavar="G",
                        help="GPUs (workers) of one instance: the trace counts instances, a preemption takes G "
                             "workers, tensor parallelism stays inside an instance (T divides G)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of: {', '.join(POLICIES)}")
    parser.add_argument("--rates", choices=RATES, default="none",
                        help="the parcae policy's expected preemptions and arrivals per interval: the forecaster's "
                             "(none), or a rate model's fitted on the trace so far, constant or seasonal (by hour of "
                             "day), as the coordinator's rates key")
    parser.add_argument("--sudden-share", type=float, default=0.0, metavar="SHARE",
                        help="share of preemptions the liveput policies price as coming without notice (the "
                             "coordinator's sudden-share key); the replay itself still gives every preemption the "
                             "cost constants' notice")
    parser.add_argument("--copy-interval", type=int, default=SuddenLosses.copy_interval, metavar="STEPS",
                        help="steps between the workers' snapshots (--parcae-copy-interval; 0: none), for pricing "
                             "sudden losses")
    parser.add_argument("--save-interval", type=int, default=0, metavar="STEPS",
                        help="steps between checkpoints (0: unknown, no retrained steps charged), for pricing "
                             "sudden losses")
    parser.add_argument("--seed", type=int, default=0, help="seed of which instances a preemption hits")
    parser.add_argument("--draws", type=int, default=1,
                        help="replay this many draws of which instances preemptions hit (seeds --seed, --seed + 1, "
                             "...) and report each policy's means: Parcae's artifact charges a change at its mean "
                             "over its draws")
    parser.add_argument("--on-demand", type=int, default=0, help="always-on on-demand instances added to the trace's")
    parser.add_argument("--spot-price", type=float, default=SPOT_PRICE, help="$ per spot instance-hour")
    parser.add_argument("--on-demand-price", type=float, default=ON_DEMAND_PRICE, help="$ per on-demand instance-hour")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="write a timeline plot")
    deadline.add_arguments(parser)


def build(args: argparse.Namespace) -> tuple[Replay, LiveputStack]:
    """Load the replay and the liveput stack; raises ValueError on bad input."""
    constants = CostConstants.load(args.cost_constants)
    replay = Replay.load(args.trace, constants.interval_seconds, args.start_hour, args.end_hour)
    max_workers = (int(replay.counts.max()) + max(args.on_demand, 0)) * args.gpus_per_instance
    liveput = build_liveput(args.profile, constants, model=args.model, max_workers=max_workers,
                            lookahead=args.lookahead, distributed_optimizer=args.distributed_optimizer,
                            gpus_per_instance=args.gpus_per_instance, cost_model=args.cost_model,
                            sudden=SuddenLosses(args.sudden_share, args.copy_interval, args.save_interval))
    return replay, liveput


def _check_common(args: argparse.Namespace) -> None:
    if args.lookahead < 1:
        raise ValueError(f"--lookahead must be at least 1, got {args.lookahead}")
    if args.on_demand < 0:
        raise ValueError(f"--on-demand must be >= 0, got {args.on_demand}")
    if not 1 <= args.gpus_per_instance <= MAX_GPUS_PER_INSTANCE:
        raise ValueError(f"--gpus-per-instance must be from 1 to {MAX_GPUS_PER_INSTANCE}, got {args.gpus_per_instance}")
    if not (args.spot_price >= 0 and args.on_demand_price >= 0):
        raise ValueError("prices must be >= 0")


def run(args: argparse.Namespace) -> int:
    if deadline.selected(args):
        return deadline.run(args, POLICIES)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    progress = Progress("parcae simulate").start()
    try:
        _check_common(args)
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise ValueError(f"--policies: unknown {', '.join(unknown) or '(none given)'}; "
                             f"known: {', '.join(POLICIES)}")
        if args.draws < 1:
            raise ValueError(f"--draws must be at least 1, got {args.draws}")
        if args.rates != "none" and "parcae" not in policies:
            raise ValueError("--rates changes the parcae policy's forecasts: add parcae to --policies")
        replay, liveput = build(args)
        progress.update(f"the forecaster reads the {replay.start} intervals before the replay")
        feed = ForecasterFeed(replay, args.rates) if "parcae" in policies else None
        sims = [Simulation(replay, liveput, args.seed + k, args.on_demand, args.spot_price, args.on_demand_price,
                           feed) for k in range(args.draws)]
    except (ValueError, OSError) as exc:
        progress.close()
        print(f"parcae simulate: error: {exc}", file=sys.stderr)
        return 2
    sim = sims[0]
    total = len(policies) * len(sims) * replay.intervals
    progress.status = lambda elapsed: counted(sum(s.intervals_done for s in sims), total, "intervals replayed")
    runs = {p: averaged([s.run(p) for s in sims]) for p in policies}
    progress.close()
    result = report(sim, runs)
    if args.plot:
        plot_timeline(sim, runs, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    throughput_samples = runs["throughput"].samples if "throughput" in runs else None
    most = int(replay.counts[replay.start:replay.end].max()) + args.on_demand
    print(f"{replay.intervals} intervals of {replay.interval_seconds:g} s, {liveput.throughput.model}, "
          f"look-ahead {args.lookahead}; up to {most} instances of {sim.gpus} GPU(s) ({most * sim.gpus} GPUs)")
    print(f"{'policy':<15}{'samples':>12}{'of ideal':>10}{'vs throughput':>15}{'dollars':>10}"
          f"{'migrations':>12}{'lost s':>9}")
    for name, row in result["policies"].items():
        versus = f"{runs[name].samples / throughput_samples:.3f}x" if throughput_samples else "-"
        print(f"{name:<15}{row['samples']:>12.1f}{row['ratio_to_ideal']:>10.2%}{versus:>15}{row['dollars']:>10.2f}"
              f"{row['migrations']:>12}{row['lost_seconds']:>9.0f}")
    ms = result["decision_ms"]
    print(f"decision time: p50 {ms['p50']:.2f} ms, p99 {ms['p99']:.2f} ms, max {ms['max']:.2f} ms")
    return 0
