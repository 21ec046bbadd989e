"""What scripts/gpu_check.sh concludes from the records its runs wrote.

    python -m benchmarks.gpu_check_report losses REFERENCE RUN [--rel R] [--loss-scale]
    python -m benchmarks.gpu_check_report changes EVENTS [--memory TRACE.jsonl]
    python -m benchmarks.gpu_check_report rollback CHAOS.json

`losses`: the lm loss of every iteration both --parcae-events files logged (and with
--loss-scale fp16's loss scale) agrees within R relative; exits 1 when it does not, or
when the run logged other iterations than the reference. `changes`: each layout change
of an events file with its seconds and device peak, beside the steady state before and
after it from a benchmarks/memory_trace.py record (rank 0's), and the peak during the
change over that steady state. `rollback`: a benchmarks/chaos.py run passed and
recovered at least once from the workers' snapshots; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_parcae.events import Iteration, LayoutChange, read_events


def _iterations(path: Path) -> dict[int, Iteration]:
    return {e.iteration: e for e in read_events(path) if isinstance(e, Iteration)}


def compare_losses(reference: Path, run: Path, rel: float, loss_scale: bool) -> int:
    expected, found = _iterations(reference), _iterations(run)
    if not expected or expected.keys() != found.keys():
        print(f"iterations differ: reference {sorted(expected)}, run {sorted(found)}")
        return 1
    worst, failed = 0.0, []
    for it in sorted(expected):
        a, b = expected[it].losses["lm loss"], found[it].losses["lm loss"]
        difference = abs(a - b) / max(abs(a), 1e-30)
        worst = max(worst, difference)
        if difference > rel:
            failed.append(f"iteration {it}: lm loss {b!r}, reference {a!r}")
        if loss_scale and expected[it].loss_scale != found[it].loss_scale:
            failed.append(f"iteration {it}: loss scale {found[it].loss_scale}, reference {expected[it].loss_scale}")
    scales = sorted({e.loss_scale for e in found.values() if e.loss_scale is not None})
    print(f"{len(expected)} iterations; largest relative lm-loss difference {worst:.3g} (bar {rel:g})"
          + (f"; loss scales seen {scales}, equal at every iteration" if loss_scale and not failed else ""))
    for line in failed:
        print(line)
    return 1 if failed else 0


def _steady(trace: list[dict], before: int, after: int) -> tuple[float | None, float | None]:
    """Rank 0's per-step peak just before a change at `before`, and of the steps after it
    that the change's own peak did not fall in."""
    peaks = {r["iteration"]: r["peak_mib"] for r in trace if r["rank"] == 0}
    return peaks.get(before), peaks.get(after)


def report_changes(events: Path, memory: Path | None) -> int:
    trace = [json.loads(line) for line in memory.read_text().splitlines()] if memory and memory.exists() else []
    changes = [e for e in read_events(events) if isinstance(e, LayoutChange)]
    if not changes:
        print("no layout change was logged")
        return 1
    for c in changes:
        line = f"change at iteration {c.iteration} ({c.kind}, T{c.tp} P{c.pp} D{c.dp}): {c.seconds:.2f} s"
        if c.device_peak_mib is not None:
            line += f", device peak during it {c.device_peak_mib:.0f} MiB"
        before, after = _steady(trace, c.iteration, c.iteration + 2)
        if before is not None:
            line += f", steady peak before {before:.0f} MiB"
        if after is not None:
            line += f", after {after:.0f} MiB"
        if c.device_peak_mib is not None and before:
            line += f" (during / before: {c.device_peak_mib / before:.3f})"
        print(line)
    return 0


def report_rollback(chaos: Path) -> int:
    summary = json.loads(chaos.read_text())["summary"]
    print(f"chaos: {summary['passed']} of {summary['runs']} runs passed; {summary['kills']} kills, "
          f"{summary['recoveries_from_copies']} recoveries from snapshots, {summary['recoveries_from_replicas']} from "
          f"replicas, {summary['checkpoint_fallbacks']} from checkpoints; parameters "
          f"{summary['max_params_rel_diff']} apart from the uninterrupted run's")
    return 0 if summary["passed"] == summary["runs"] and summary["recoveries_from_copies"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check_report", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    losses = commands.add_parser("losses", help="a run's losses against a reference run's")
    losses.add_argument("reference", type=Path)
    losses.add_argument("run", type=Path)
    losses.add_argument("--rel", type=float, default=1e-5)
    losses.add_argument("--loss-scale", action="store_true", help="also compare fp16's loss scale")
    changes = commands.add_parser("changes", help="each layout change with its device peaks")
    changes.add_argument("events", type=Path)
    changes.add_argument("--memory", type=Path, help="a benchmarks/memory_trace.py record of the same run")
    rollback = commands.add_parser("rollback", help="a chaos run recovered from snapshots")
    rollback.add_argument("chaos", type=Path)
    args = parser.parse_args(argv)
    paths = {"losses": ("reference", "run"), "changes": ("events",), "rollback": ("chaos",)}[args.command]
    for path in (getattr(args, name) for name in paths):
        if not path.exists():
            print(f"{parser.prog}: error: {path} does not exist", file=sys.stderr)
            return 2
    if args.command == "losses":
        return compare_losses(args.reference, args.run, args.rel, args.loss_scale)
    if args.command == "rollback":
        return report_rollback(args.chaos)
    return report_changes(args.events, args.memory)


if __name__ == "__main__":
    sys.exit(main())
