"""Run a training script recording the device memory of every step.

    python -m benchmarks.memory_trace OUT.jsonl SCRIPT [ARGS...]

After each training step (LayoutRuntime.train_step) the process appends a JSON line to
OUT.jsonl: {"rank", "iteration", "allocated_mib", "peak_mib"}, where the peak is
torch.cuda.max_memory_allocated since the previous line: the step itself and whatever
came between it and the one before (a layout change), so that the steady state before
and after a change stands beside the change's own peak (its layout_change event's
device_peak_mib). Without CUDA it records nothing and the script runs unchanged.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def install(out: Path) -> None:
    from megatron_parcae.training.runtime import LayoutRuntime

    train_step = LayoutRuntime.train_step

    def recorded(runtime, dataset, progress, report):
        result = train_step(runtime, dataset, progress, report)
        line = {"rank": int(os.environ.get("RANK", "0")), "iteration": progress.iteration + 1,
                "allocated_mib": torch.cuda.memory_allocated() / 2**20,
                "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
        torch.cuda.reset_peak_memory_stats()
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return result

    LayoutRuntime.train_step = recorded


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m benchmarks.memory_trace OUT.jsonl SCRIPT [ARGS...]")
    out, script = Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, str(REPO))
    if torch.cuda.is_available():
        install(out)
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
