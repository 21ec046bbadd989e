"""What the CPU redirection's TorchFunctionMode (megatron_parcae/training/cpu.py) costs a
CPU training step.

A TorchFunctionMode sends every torch call of the process through Python, whether or
not the call names a device, so its cost is per call, not per byte. It cannot be taken
away on CPU (megatron-core names CUDA devices in its schedules, optimizer and
sequence-parallel mappings), so it is measured by adding a second, pass-through mode:
the training process alternates steps with and without it, and the extra mode's cost
per step is the mode's own. Steps alternate one by one in one process, so a shared
machine's drift falls on both alike. CPU time (the process's, every thread) per step,
median over the steps after the first WARMUP.

    python -m benchmarks.cpu_mode_cost [--iterations 80] [--out benchmarks/results/cpu_mode_cost]
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import provenance

REPO = Path(__file__).resolve().parents[1]
WARMUP = 6
# The configs' model (configs/gpt-tiny.yaml), and the smaller one the tests train (tests/helpers.py SMALL_GPT).
MODELS = {
    "gpt-tiny": ["--config", "configs/gpt-tiny.yaml"],
    "tests' GPT": ["--config", "configs/gpt-tiny.yaml", "--num-layers", "4", "--hidden-size", "64",
                   "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
                   "--micro-batch-size", "2", "--global-batch-size", "8"],
}


def _child(argv: list[str], out: Path) -> None:
    """Train with the extra mode on every other step; write the per-step CPU times to `out`."""
    import torch

    from megatron_parcae.training.runtime import LayoutRuntime

    class PassThrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    train_step = LayoutRuntime.train_step
    times: dict[str, list[float]] = {"without": [], "with": []}

    def alternating(self, *args, **kwargs):
        which = "with" if (len(times["without"]) + len(times["with"])) % 2 else "without"
        start = time.process_time()
        if which == "with":
            with PassThrough():
                result = train_step(self, *args, **kwargs)
        else:
            result = train_step(self, *args, **kwargs)
        times[which].append(time.process_time() - start)
        return result

    LayoutRuntime.train_step = alternating
    sys.argv = [str(REPO / "scripts" / "pretrain_gpt.py"), *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        out.write_text(json.dumps(times))


def measure(model: str, iterations: int, workdir: Path) -> dict:
    out = workdir / f"{list(MODELS).index(model)}.json"
    argv = [*MODELS[model], "--train-iters", str(iterations), "--log-interval", str(iterations)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_mode_cost", "--child", str(out), "--", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{model}: training failed ({done.returncode}):\n{done.stderr[-2000:]}")
    times = json.loads(out.read_text())
    kept = {k: v[WARMUP // 2:] for k, v in times.items()}
    without, with_ = statistics.median(kept["without"]) * 1e3, statistics.median(kept["with"]) * 1e3
    return {"model": model, "steps_each": len(kept["without"]), "cpu_ms_per_step": round(without, 2),
            "cpu_ms_per_step_with_a_second_mode": round(with_, 2),
            "mode_percent_of_step": round((with_ / without - 1) * 100, 2)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[3:], Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--out", default="benchmarks/results/cpu_mode_cost", help="writes OUT.txt and OUT.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="parcae-mode-cost-") as tmp:
        rows = [measure(model, args.iterations, Path(tmp)) for model in MODELS]
    command = " ".join(["python -m benchmarks.cpu_mode_cost", *argv])
    result = {"command": command, "commit": provenance.commit(),
              "cpu_cores": os.cpu_count(), "iterations": args.iterations, "results": rows}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# command: {command}", f"# commit: {result['commit']}",
             f"# {os.cpu_count()} CPU cores, OMP_NUM_THREADS=1, one process; steps alternate with and without a "
             f"second pass-through TorchFunctionMode; CPU ms per step, medians", ""]
    lines += [f"{r['model']}: {r['cpu_ms_per_step']:.1f} ms, with a second mode {r['cpu_ms_per_step_with_a_second_mode']:.1f}"
              f" ms: the mode costs {r['mode_percent_of_step']:+.1f}% of a step ({r['steps_each']} steps each)"
              for r in rows]
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
