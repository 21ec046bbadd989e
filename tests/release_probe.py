"""Run a training script checking that every layout a process drops is freed by reference
counting alone.

    python tests/release_probe.py OUT_DIR SCRIPT [ARGS...]

The cyclic collector is off for the whole run, and `gc.collect` counts its calls. When a
layout is destroyed (`LayoutRuntime.destroy`), the probe takes weak references to its
model chunks (megatron-core DDP), their modules and parameters, DDP's buffers and their
parameter and gradient tensors, and the optimizers with their state tensors. When the
next layout's first step has returned, each process appends one JSON line to
OUT_DIR/release-PID.jsonl: {"worker", "iteration", "held": {kind: count}, "alive":
{kind: count}, "collections"}, where "alive" counts the weak references still live.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import weakref
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _optimizers(optimizer) -> list:
    """megatron-core's optimizer, the ones it chains, and the torch optimizers inside."""
    outer = [optimizer, *getattr(optimizer, "chained_optimizers", [])]
    return outer + [inner for o in outer if (inner := getattr(o, "optimizer", None)) is not None]


def _layout_objects(runtime) -> list[tuple[str, object]]:
    """(kind, object) of everything a layout owns that must not outlive it."""
    # Not imported at the top: multiprocessing's spawned helpers (the checkpoint writer's
    # results queue) import this file again as a module, and need no torch.
    import torch

    found: list[tuple[str, object]] = []
    for chunk in runtime.model:
        found.append(("model chunk", chunk))
        found += [("module", m) for m in chunk.module.modules()]
        found += [("parameter", p) for p in chunk.parameters()]
        for buffer in [*chunk.buffers, *getattr(chunk, "expert_parallel_buffers", [])]:
            found.append(("DDP buffer", buffer))
            found += [(kind, t) for kind, t in (("gradient buffer", buffer.grad_data),
                                               ("parameter buffer", buffer.param_data)) if t is not None]
    for opt in _optimizers(runtime.optimizer):
        found.append(("optimizer", opt))
        state = getattr(opt, "state", None)
        if isinstance(opt, torch.optim.Optimizer) and state:
            found += [("optimizer state", t) for s in state.values() for t in s.values() if torch.is_tensor(t)]
    return found


class Probe:
    def __init__(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"release-{os.getpid()}.jsonl"
        self.collections = 0
        self.dropped: list[tuple[str, weakref.ref]] = []

    def install(self) -> None:
        from megatron_parcae.training.runtime import LayoutRuntime

        gc.disable()
        collect = gc.collect

        def counted_collect(*args, **kwargs):
            self.collections += 1
            return collect(*args, **kwargs)

        gc.collect = counted_collect
        destroy, train_step = LayoutRuntime.destroy, LayoutRuntime.train_step
        probe = self

        def destroy_watched(runtime) -> None:
            if runtime.model is not None:
                probe.dropped += [(kind, weakref.ref(o)) for kind, o in _layout_objects(runtime)]
            destroy(runtime)

        def train_step_then_check(runtime, dataset, progress, report):
            result = train_step(runtime, dataset, progress, report)
            if probe.dropped:
                probe.record(progress.iteration + 1)
            return result

        LayoutRuntime.destroy = destroy_watched
        LayoutRuntime.train_step = train_step_then_check

    def record(self, iteration: int) -> None:
        held = Counter(kind for kind, _ in self.dropped)
        alive = Counter(kind for kind, ref in self.dropped if ref() is not None)
        self.dropped = []
        line = {"worker": int(os.environ.get("RANK", "0")), "iteration": iteration, "held": held,
                "alive": alive, "collections": self.collections}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def read_records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(out_dir.glob("release-*.jsonl"))
            for line in path.read_text().splitlines()]


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: release_probe.py OUT_DIR SCRIPT [ARGS...]")
    out_dir, script = Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, str(REPO))
    Probe(out_dir).install()
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
