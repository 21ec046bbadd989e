"""Deadline policies on a real spot trace (issue 36, acceptance 1).

Replays a job of `--job-hours` J (what N on-demand instances train in J hours) with each
deadline of `--deadlines` from `--starts` start times spread evenly over the trace, every
window [start, start + the longest deadline) inside it (a late policy's replay past its
deadline may wrap to the trace's start), under every policy of `parcae simulate
--deadline-hours` (megatron_parcae/tools/deadline.py), and writes each run's dollars and
deadline, the means per deadline, and the acceptance checks: the deadline policy meets
every deadline Uniform Progress meets, costs less than it on average at each deadline,
and is within 10% of the omniscient bound on average (mean dollars over mean bound, as
the comparison with Uniform Progress; the mean of the per-start ratios is reported too).

    python -m benchmarks.deadline_policies [--out benchmarks/results/deadline_policies]

Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks import provenance
from megatron_parcae.liveput.cost import CostConstants
from megatron_parcae.provisioning.job import DeadlineJob, SpotWindow
from megatron_parcae.tools import deadline, simulate
from predictor.traces import AvailabilityTrace

TRACE = "traces/aws-v100-16node/us-east-2b_v100_1.json"
PROFILE = "benchmarks/results/gpu_h200_profile_gpt-1.5b.json"
WITHIN = 0.10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--profile", default=PROFILE)
    parser.add_argument("--max-instances", type=int, default=16)
    parser.add_argument("--job-hours", type=float, default=48.0)
    parser.add_argument("--deadlines", default="52,72", help="hours, comma-separated")
    parser.add_argument("--starts", type=int, default=8)
    parser.add_argument("--spot-price", type=float, default=0.918)
    parser.add_argument("--on-demand-price", type=float, default=3.06)
    parser.add_argument("--restart-hours", type=float, default=0.1)
    parser.add_argument("--out", default="benchmarks/results/deadline_policies", help="writes OUT.txt and OUT.json")
    args = parser.parse_args(argv)
    deadlines = [float(d) for d in args.deadlines.split(",")]
    sim_parser = argparse.ArgumentParser()
    simulate.add_arguments(sim_parser)
    sim_args = sim_parser.parse_args(
        ["--trace", args.trace, "--profile", args.profile, "--max-instances", str(args.max_instances),
         "--job-hours", str(args.job_hours), "--spot-price", str(args.spot_price),
         "--on-demand-price", str(args.on_demand_price), "--restart-hours", str(args.restart_hours)])
    n = args.max_instances
    model = deadline.elastic_model(sim_args, n)
    market = deadline.market_of(sim_args, n)
    interval = CostConstants.load(sim_args.cost_constants).interval_seconds
    counts = AvailabilityTrace.load(args.trace).resample(interval).counts
    trace_hours = len(counts) * interval / 3600
    latest = trace_hours - max(deadlines)
    starts = [round(latest * k / (args.starts - 1), 2) for k in range(args.starts)]
    samples = args.job_hours * 3600 * model.rates[n]
    runs = []
    for hours in deadlines:
        job = DeadlineJob(samples, hours, n, args.restart_hours)
        for start in starts:
            window = SpotWindow.of(counts, interval, start, deadline.window_hours(hours, args.job_hours))
            outcomes = deadline.evaluate(list(deadline.POLICIES), job, window, market, model)
            runs.append({"deadline_hours": hours, "start_hours": start,
                         "policies": {name: o.to_dict() for name, o in outcomes.items()}})
            print(f"D={hours:g} start={start:g}: " + ", ".join(
                f"{name} ${o.dollars:.0f}{'' if o.met_deadline else ' (missed)'}" for name, o in outcomes.items()),
                file=sys.stderr)
    summary, checks = {}, {}
    for hours in deadlines:
        mine = [r for r in runs if r["deadline_hours"] == hours]
        means = {name: float(np.mean([r["policies"][name]["dollars"] for r in mine])) for name in deadline.POLICIES}
        met = {name: sum(r["policies"][name]["met_deadline"] for r in mine) for name in deadline.POLICIES}
        ratios = [r["policies"]["deadline"]["dollars"] / r["policies"]["omniscient"]["dollars"] for r in mine]
        summary[f"{hours:g}"] = {"mean_dollars": {k: round(v, 2) for k, v in means.items()}, "deadlines_met": met,
                                 "runs": len(mine), "deadline_over_omniscient_mean_ratio": round(float(np.mean(ratios)), 4),
                                 "deadline_over_omniscient_of_means": round(means["deadline"] / means["omniscient"], 4)}
        checks[f"D={hours:g}: deadline meets every deadline uniform-progress meets"] = all(
            r["policies"]["deadline"]["met_deadline"] for r in mine if r["policies"]["uniform-progress"]["met_deadline"])
        checks[f"D={hours:g}: deadline costs less than uniform-progress on average"] = \
            means["deadline"] < means["uniform-progress"]
        checks[f"D={hours:g}: deadline within {WITHIN:.0%} of omniscient on average"] = \
            means["deadline"] <= (1 + WITHIN) * means["omniscient"]
    command = "python -m benchmarks.deadline_policies " + " ".join(argv if argv is not None else sys.argv[1:])
    per_run = " ".join(["parcae simulate --trace", args.trace, "--profile", args.profile, "--max-instances", str(n),
                        "--job-hours", f"{args.job_hours:g}", "--deadline-hours D --spot-price", f"{args.spot_price:g}",
                        "--on-demand-price", f"{args.on_demand_price:g}", "--restart-hours", f"{args.restart_hours:g}",
                        "--policies", ",".join(deadline.POLICIES), "--start-hours H --json"])
    result = {"command": command.strip(), "per_run_command": per_run,
              "commit": provenance.commit(),
              "trace": args.trace, "trace_hours": round(trace_hours, 3), "profile": args.profile,
              "max_instances": n, "job_hours": args.job_hours, "samples": round(samples, 1),
              "spot_price": args.spot_price, "on_demand_price": args.on_demand_price,
              "restart_hours": args.restart_hours, "on_demand_startup_hours": market.on_demand.startup_hours,
              "interval_seconds": interval, "starts_hours": starts, "summary": summary, "checks": checks,
              "runs": runs}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# deadline policies on {args.trace} ({trace_hours:.1f} h), {n} instances, {args.profile}",
             f"# command: {result['command']}",
             f"# each run is: {per_run}",
             f"# commit: {result['commit']}",
             f"# job: {args.job_hours:g} h on {n} on-demand instances = {samples:,.0f} samples; spot ${args.spot_price}, "
             f"on-demand ${args.on_demand_price} per instance-hour; restart {args.restart_hours} h; on-demand start-up "
             f"{market.on_demand.startup_hours} h; {interval:g} s intervals",
             f"# starts (hours of the trace): {', '.join(f'{s:g}' for s in starts)}", ""]
    for hours in deadlines:
        lines.append(f"D = {hours:g} h: dollars per start (* = deadline missed)")
        lines.append(f"{'start h':>8}" + "".join(f"{name:>18}" for name in deadline.POLICIES))
        for r in (r for r in runs if r["deadline_hours"] == hours):
            lines.append(f"{r['start_hours']:>8g}" + "".join(
                f"{r['policies'][name]['dollars']:>17.2f}{' ' if r['policies'][name]['met_deadline'] else '*'}"
                for name in deadline.POLICIES))
        s = summary[f"{hours:g}"]
        lines.append(f"{'mean':>8}" + "".join(f"{s['mean_dollars'][name]:>17.2f} " for name in deadline.POLICIES))
        lines.append(f"{'met':>8}" + "".join(f"{str(s['deadlines_met'][name]) + '/' + str(s['runs']):>17} "
                                              for name in deadline.POLICIES))
        lines.append(f"deadline / omniscient: {s['deadline_over_omniscient_of_means']:.4f} of the means, "
                     f"{s['deadline_over_omniscient_mean_ratio']:.4f} mean of the ratios")
        lines.append("")
    lines += [f"{'PASS' if ok else 'FAIL'}: {name}" for name, ok in checks.items()]
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
