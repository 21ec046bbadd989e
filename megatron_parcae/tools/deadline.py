"""`parcae simulate` and `parcae plan` for a job with a deadline: which instances to buy.

`parcae simulate --deadline-hours D` replays one start of a spot trace for a job of
`--job-hours J` (the work N on-demand instances do in J hours at the profile's best
layout; or `--samples`) on at most `--max-instances N` instances, under each policy of
`--policies` (`POLICIES`; megatron_parcae/provisioning/baselines.py says what each
does), and reports each one's dollars, finish, whether it met the deadline, and its
instance-hours by market. The job starts at `--start-hours` of the trace; a trace that
ends before the job does is replayed from its start again. Spot instances cost
`--spot-price`, on-demand ones `--on-demand-price` and take `--startup-hours` to start
(default: the restart hours), or as `--pools` (YAML or JSON, provisioning/pools.py) says.

`parcae plan --max-instances N` answers "what will this deadline cost" with the same
deadline policy, from the start of every trace given (worst case over them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from megatron_parcae.liveput.cost import CostConstants
from megatron_parcae.liveput.factory import build_liveput
from megatron_parcae.provisioning.baselines import gang, omniscient, spot_only
from megatron_parcae.provisioning.elastic import ElasticModel, run_elastic
from megatron_parcae.provisioning.job import DeadlineJob, Outcome, SpotWindow
from megatron_parcae.provisioning.policy import DeadlinePolicy
from megatron_parcae.provisioning.pools import Market, PoolConfigError, read_pools
from predictor.traces import AvailabilityTrace

POLICIES = ("on-demand", "spot", "greedy", "uniform-progress", "deadline", "omniscient")
RESTART_HOURS = 0.1  # Can't Be Late's restart overhead in its simulations: 6 minutes


def evaluate(names: list[str], job: DeadlineJob, window: SpotWindow, market: Market, model: ElasticModel,
             policy: DeadlinePolicy = DeadlinePolicy()) -> dict[str, Outcome]:
    """Each named policy's outcome on one window."""
    runners = {"on-demand": lambda: gang("on-demand", job, window, market, model),
               "spot": lambda: spot_only(job, window, market, model),
               "greedy": lambda: gang("greedy", job, window, market, model),
               "uniform-progress": lambda: gang("uniform-progress", job, window, market, model),
               "deadline": lambda: run_elastic(job, window, market, model, policy.decide),
               "omniscient": lambda: omniscient(job, window, market, model)}
    return {name: runners[name]() for name in names}


def window_hours(deadline_hours: float, job_hours: float) -> float:
    """How long a replay runs: long enough to see when a late policy finishes."""
    return max(3 * deadline_hours, 3 * job_hours)


def add_arguments(parser: argparse.ArgumentParser, plan: bool = False) -> None:
    """The deadline job's options; `parcae plan` has its own samples, deadline and budget."""
    group = parser.add_argument_group("a job with a deadline (megatron_parcae/tools/deadline.py)")
    group.add_argument("--max-instances", type=int, default=None, metavar="N",
                       help="most instances the job runs on" + ("; with it, plan prices the deadline policy "
                                                                 "instead of sizing a fixed cluster" if plan else ""))
    if not plan:
        group.add_argument("--deadline-hours", type=float, default=None, metavar="D",
                           help="hours the job has from its start; selects the deadline policies")
        group.add_argument("--job-hours", type=float, default=None, metavar="J",
                           help="the job's work: what N on-demand instances train in J hours")
        group.add_argument("--samples", type=float, default=None, help="the job's work in samples (or --job-hours)")
        group.add_argument("--budget", type=float, default=None, metavar="DOLLARS",
                           help="most the deadline policy may spend")
        group.add_argument("--start-hours", type=float, default=0.0, metavar="H",
                           help="hour of the trace the job starts at")
    group.add_argument("--restart-hours", type=float, default=RESTART_HOURS, metavar="R",
                       help="training lost at each start (and each gang's switch of market)")
    group.add_argument("--startup-hours", type=float, default=None, metavar="HOURS",
                       help="an on-demand instance's start-up (default: --restart-hours)")
    group.add_argument("--pools", default=None, metavar="FILE",
                       help="spot and on-demand pools, YAML or JSON (instead of the prices)")


def market_of(args: argparse.Namespace, n: int) -> Market:
    startup = args.restart_hours if args.startup_hours is None else args.startup_hours
    if args.pools:
        market = Market.of(read_pools(args.pools))
        if market.spot.gpus_per_instance != args.gpus_per_instance:
            raise PoolConfigError(f"{args.pools}: pools have {market.spot.gpus_per_instance} GPUs per instance, "
                                  f"--gpus-per-instance says {args.gpus_per_instance}")
        return market
    return Market.constant(args.spot_price, args.on_demand_price, n, startup, args.gpus_per_instance)


def elastic_model(args: argparse.Namespace, n: int) -> ElasticModel:
    constants = CostConstants.load(args.cost_constants)
    liveput = build_liveput(args.profile, constants, model=args.model, max_workers=n * args.gpus_per_instance,
                            lookahead=args.lookahead, distributed_optimizer=args.distributed_optimizer,
                            gpus_per_instance=args.gpus_per_instance,
                            cost_model=getattr(args, "cost_model", "megatron-parcae"))
    model = ElasticModel.from_throughput(liveput.throughput, liveput.costs, n, args.gpus_per_instance)
    if model.rates[n] <= 0:
        raise ValueError(f"the profile has no layout for {n} instances of {args.gpus_per_instance} GPU(s)")
    return model


def _check(args: argparse.Namespace) -> None:
    if args.max_instances is None or args.max_instances < 1:
        raise ValueError("--max-instances must be given, at least 1")
    for name in ("restart_hours", "startup_hours"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if not (args.spot_price >= 0 and args.on_demand_price >= 0):
        raise ValueError("prices must be >= 0")


def selected(args: argparse.Namespace) -> bool:
    """Whether `parcae simulate` runs the deadline policies rather than the layout ones."""
    named = {p.strip() for p in args.policies.split(",")}
    return args.deadline_hours is not None or bool(named & set(POLICIES))


def run(args: argparse.Namespace, layout_policies: tuple[str, ...] = ()) -> int:
    """`parcae simulate` in deadline mode; `layout_policies`: simulate's own, whose default
    list means every deadline policy here."""
    named = [p.strip() for p in args.policies.split(",") if p.strip()]
    names = list(POLICIES) if named == list(layout_policies) else named
    try:
        _check(args)
        unknown = [p for p in names if p not in POLICIES]
        if unknown or not names:
            raise ValueError(f"--policies: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(POLICIES)}")
        if args.deadline_hours is None:
            raise ValueError("the deadline policies need --deadline-hours")
        if (args.job_hours is None) == (args.samples is None):
            raise ValueError("give the job's work as one of --job-hours or --samples")
        n = args.max_instances
        model = elastic_model(args, n)
        samples = args.samples if args.samples is not None else args.job_hours * 3600 * model.rates[n]
        job_hours = samples / model.rates[n] / 3600
        job = DeadlineJob(samples, args.deadline_hours, n, args.restart_hours, args.budget)
        interval = CostConstants.load(args.cost_constants).interval_seconds
        counts = AvailabilityTrace.load(args.trace).resample(interval).counts
        window = SpotWindow.of(counts, interval, args.start_hours, window_hours(args.deadline_hours, job_hours))
        market = market_of(args, n)
    except (ValueError, OSError) as exc:
        print(f"parcae simulate: error: {exc}", file=sys.stderr)
        return 2
    outcomes = evaluate(names, job, window, market, model)
    result = {"policies": {name: o.to_dict() for name, o in outcomes.items()},
              "job": {"samples": round(samples, 1), "job_hours": round(job_hours, 3), "max_instances": n,
                      "deadline_hours": args.deadline_hours, "budget": args.budget,
                      "restart_hours": args.restart_hours, "start_hours": round(window.start_hours, 4)},
              "prices": {"spot": market.spot.price_at(window.start_hours),
                         "on_demand": market.on_demand.price_at(window.start_hours),
                         "on_demand_startup_hours": market.on_demand.startup_hours},
              "interval_seconds": interval}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{samples:,.0f} samples ({job_hours:g} h on {n} on-demand instances) within {args.deadline_hours:g} h, "
          f"from hour {window.start_hours:g} of the trace")
    print(f"{'policy':<18}{'dollars':>10}{'finish h':>10}{'met':>6}{'on-demand h':>13}{'spot h':>10}")
    for name, o in outcomes.items():
        finish = "-" if o.finish_hours is None else f"{o.finish_hours:.2f}"
        print(f"{name:<18}{o.dollars:>10.2f}{finish:>10}{'yes' if o.met_deadline else 'no':>6}"
              f"{o.on_demand_instance_hours:>13.1f}{o.spot_instance_hours:>10.1f}")
    return 0


def plan(args: argparse.Namespace) -> int:
    """`parcae plan --max-instances N`: what the deadline policy spends to train --samples
    within --deadline hours on each trace from its start (worst case over the traces)."""
    try:
        _check(args)
        n = args.max_instances
        model = elastic_model(args, n)
        job = DeadlineJob(args.samples, args.deadline, n, args.restart_hours, args.budget)
        interval = CostConstants.load(args.cost_constants).interval_seconds
        market = market_of(args, n)
        hours = window_hours(args.deadline, args.samples / model.rates[n] / 3600)
        windows = [SpotWindow.of(AvailabilityTrace.load(path).resample(interval).counts, interval, 0.0, hours)
                   for path in args.trace]
    except (ValueError, OSError) as exc:
        print(f"parcae plan: error: {exc}", file=sys.stderr)
        return 2
    outcomes = [run_elastic(job, w, market, model, DeadlinePolicy().decide) for w in windows]
    bounds = [omniscient(job, w, market, model) for w in windows]
    worst = max(outcomes, key=lambda o: o.dollars)
    met = all(o.met_deadline for o in outcomes)
    within = args.budget is None or worst.dollars <= args.budget
    if args.json:
        print(json.dumps({"policy": "deadline", "max_instances": n, "met_deadline": met, "within_budget": within,
                          "dollars": round(worst.dollars, 2),
                          "traces": [{"trace": path, **o.to_dict(), "omniscient_dollars": round(b.dollars, 2)}
                                     for path, o, b in zip(args.trace, outcomes, bounds)]}, indent=1))
    else:
        for path, o, b in zip(args.trace, outcomes, bounds):
            finish = "not finished" if o.finish_hours is None else f"finishes at {o.finish_hours:.2f} h"
            print(f"{path}: ${o.dollars:.2f} ({o.on_demand_instance_hours:.1f} on-demand and "
                  f"{o.spot_instance_hours:.1f} spot instance-hours), {finish}; at least ${b.dollars:.2f} "
                  f"knowing the trace")
        print(f"answer: the deadline policy on at most {n} instances costs ${worst.dollars:.2f} (worst case), "
              f"{'meets' if met else 'misses'} the {args.deadline:g} h deadline")
    if not met or not within:
        print(f"parcae plan: {'the deadline is missed' if not met else 'the budget is exceeded'}", file=sys.stderr)
        return 1
    return 0
