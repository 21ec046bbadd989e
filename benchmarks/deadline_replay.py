"""On-demand instances provisioned live (issue 36, acceptance 2).

Runs one `parcae replay --deadline-hours D --baseline spot-only` on a segment of the g4dn
trace where spot capacity (scaled to 12 instances) falls from 9 to 2-5 between trace
hours 0.33 and 0.6, is back at 9 by 0.7 and at 12 by 1.1, then holds 8-12 until 2.5, with
paced workers (tests/hooks/paced.py: a step takes PACE seconds over the layout's
world size, so 12 processes fit on 2 cores and more of them train faster): first with
the coordinator's deadline policy buying on-demand instances through the emulator, then
the same job on spot alone. Writes the command, the commit, the date, each run's
on-demand changes (trace hours, held -> wanted, the coordinator's reason), dollars by
pool, finish and whether it met the deadline, and the checks: the run with on-demand
requested some when behind and released some when ahead while work was left (before its
finish), and met the deadline; spot alone missed it. Trace hours count from the
coordinator's start of counting, as its deadline does (tools/replay.py, `Buyer`).

    python -m benchmarks.deadline_replay [--out benchmarks/results/deadline_replay_cpu]

Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks import provenance

REPO = Path(__file__).resolve().parents[1]
TRAINING = ["scripts/pretrain_gpt.py", "--config", "configs/gpt-tiny.yaml", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "1", "--global-batch-size", "24", "--log-interval", "1"]


def replay_command(args: argparse.Namespace, workdir: Path, summary: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_parcae.cli", "replay", "--trace", args.trace,
            "--start-hour", str(args.start_hour), "--end-hour", str(args.end_hour),
            "--max-instances", str(args.max_instances), "--speedup", str(args.speedup), "--grace-seconds", "6",
            "--deadline-hours", str(args.deadline_hours), "--on-demand-max", str(args.on_demand_max),
            "--startup-hours", str(args.startup_hours), "--baseline", "spot-only", "--workdir", str(workdir),
            "--json", str(summary), "--", *TRAINING, "--train-iters", str(args.iterations)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="traces/aws-g4dn/g4dn-trace.csv")
    parser.add_argument("--start-hour", type=float, default=2.9)
    parser.add_argument("--end-hour", type=float, default=5.55)
    parser.add_argument("--max-instances", type=int, default=12)
    parser.add_argument("--on-demand-max", type=int, default=12)
    parser.add_argument("--speedup", type=float, default=20.0)
    parser.add_argument("--deadline-hours", type=float, default=2.6)
    parser.add_argument("--startup-hours", type=float, default=0.1)
    parser.add_argument("--iterations", type=int, default=240, help="the job: --train-iters, due by the deadline")
    parser.add_argument("--pace", type=float, default=12.0, help="seconds a step takes on one process")
    parser.add_argument("--workdir", default="/tmp/parcae-deadline-replay")
    parser.add_argument("--out", default="benchmarks/results/deadline_replay_cpu", help="writes OUT.txt and OUT.json")
    args = parser.parse_args(argv)
    summary_path = Path(args.workdir + ".json")
    command = replay_command(args, Path(args.workdir), summary_path)
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "hooks"), "PARCAE_TEST_HOOKS": "paced",
           "PARCAE_TEST_STEP_SECONDS": str(args.pace)}
    shown = f"PYTHONPATH=tests/hooks PARCAE_TEST_HOOKS=paced PARCAE_TEST_STEP_SECONDS={args.pace:g} parcae " + shlex.join(command[3:])
    print(shown, flush=True)
    done = subprocess.run(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE)
    if done.returncode != 0:
        print(f"deadline_replay: parcae replay exited {done.returncode}", file=sys.stderr)
        return 1
    runs = json.loads(summary_path.read_text())
    commit = provenance.commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with_on_demand, spot_only = runs["parcae"], runs["spot-only"]
    changes = with_on_demand["provisioned"]
    checks = {
        "on-demand requested when behind": any(c["wanted"] > c["held"] and c["reason"].startswith("behind")
                                               for c in changes),
        "on-demand released when ahead, before the finish": any(
            c["wanted"] < c["held"] and c["reason"].startswith("ahead")
            and (with_on_demand["finish_hours"] is None or c["trace_hours"] < with_on_demand["finish_hours"])
            for c in changes),
        "with on-demand: deadline met": bool(with_on_demand["met_deadline"]),
        "spot only: deadline missed": not spot_only["met_deadline"],
    }
    lines = [f"# command: {shown}",
             f"# run by: python -m benchmarks.deadline_replay {shlex.join(sys.argv[1:] if argv is None else argv)}",
             f"# commit: {commit}",
             f"# date: {date}",
             "# machine: 2 CPU cores, no GPU; paced workers (tests/hooks/paced.py)",
             f"# job: {args.iterations} iterations due {args.deadline_hours:g} trace hours after trace hour 0; "
             f"trace {args.trace} hours {args.start_hour:g}-{args.end_hour:g} scaled to {args.max_instances} "
             f"spot instances, {args.speedup:g} trace s per wall s; on-demand at most {args.on_demand_max}, "
             f"{args.startup_hours:g} h start-up",
             f"# reasons are the coordinator's, on its clock (the wall's): a wall minute is {args.speedup:g} trace "
             "minutes", ""]
    for name, run in (("with on-demand", with_on_demand), ("spot only", spot_only)):
        finish = "not finished" if run["finish_hours"] is None else f"finished at {run['finish_hours']:.2f} h"
        pools = ", ".join(f"{pool} ${dollars:,.2f}" for pool, dollars in run["dollars"].items())
        lines.append(f"{name}: ${sum(run['dollars'].values()):,.2f} ({pools}); {run['iterations']} iterations, "
                     f"{finish}; deadline {'met' if run['met_deadline'] else 'missed'}; "
                     f"{run['preemptions']} preemptions, {run['arrivals']} arrivals, {len(run['changes'])} layout changes")
        for change in run["provisioned"]:
            lines.append(f"  trace {change['trace_hours']:.3f} h: on-demand {change['held']} -> {change['wanted']} "
                         f"({', '.join(change['instances']) or 'none named'}); {change['reason']}")
    lines.append("")
    lines += [f"{'PASS' if ok else 'FAIL'}: {check}" for check, ok in checks.items()]
    text = "\n".join(lines) + "\n"
    Path(args.out + ".txt").write_text(text)
    Path(args.out + ".json").write_text(json.dumps({"command": shown, "commit": commit, "date": date,
                                                    "runs": runs, "checks": checks}, indent=1))
    print(text, end="")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
