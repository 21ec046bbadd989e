"""What one snapshot costs the training thread, set beside a training step (issue 18's
snapshots with buddy copies, `--parcae-copy-interval K`).

One process, layout T=1 P=1 D=1, the model the flags after `--` describe (mock data is
fine). It trains --steps steps, timing each, then takes --repeats snapshots the way a
worker does every K steps: `execute.export_held_state`, the state copied into host
memory (pinned on a GPU) and waited for, with the previous snapshot still held, as the
snapshot store holds it until the new one is committed. Reported: the median step, each
snapshot's seconds (the first includes allocating its host memory), the state's MiB and
copy rate, and what a snapshot every K steps adds to an iteration: the median snapshot
over K median steps. The exchange with the buddy is not included: it needs a second
process, on GPUs a second GPU.

    python -m benchmarks.snapshot_cost [--steps 6] [--repeats 4] [--copy-interval 10] [--json PATH] -- FLAGS
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _synchronized() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(flags: list[str], steps: int, repeats: int) -> dict:
    from megatron_parcae.training.arguments import parse_args
    from megatron_parcae.training.data.datasets import build_datasets, build_tokenizer
    from megatron_parcae.training.device import prepare_device
    from megatron_parcae.training.models import padded_vocab_size
    from megatron_parcae.training.progress import Progress
    from megatron_parcae.training.runtime import LayoutRuntime
    from reconfig.execute import export_held_state
    from reconfig.world import process_group_backend

    args = parse_args(["--train-iters", str(steps), *flags, "--tensor-model-parallel-size", "1",
                       "--pipeline-model-parallel-size", "1"], prog="python -m benchmarks.snapshot_cost", model="gpt",
                      world_size=1)
    prepare_device()
    dist.init_process_group(process_group_backend(), store=dist.HashStore(), rank=0, world_size=1)
    tokenizer = build_tokenizer(args)
    runtime = LayoutRuntime(args, padded_vocab_size(tokenizer.vocab_size, args))
    try:
        dataset, _ = build_datasets(args, tokenizer)
        step_s = []
        for i in range(steps):
            start = _synchronized()
            runtime.train_step(dataset, Progress(i, i * args.global_batch_size), report=False)
            step_s.append(_synchronized() - start)
        snapshot_s, held = [], None
        for _ in range(repeats):
            start = _synchronized()
            newer = export_held_state(runtime)
            snapshot_s.append(_synchronized() - start)
            held = newer  # the older one is freed only now, as the store drops it on commit
        nbytes = sum(t.numel() * t.element_size() for tensors in held.tensors.values() for t in tensors.values())
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        return {"device": device, "parameters": sum(p.numel() for p in runtime.model[0].parameters()),
                "step_s": step_s, "snapshot_s": snapshot_s, "snapshot_mib": nbytes / 2**20}
    finally:
        runtime.destroy()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.snapshot_cost",
                                     description="one snapshot's cost to the training thread beside a step "
                                                 "(see the module docstring); training flags follow --")
    parser.add_argument("--steps", type=int, default=6, help="training steps timed first, the first not counted")
    parser.add_argument("--repeats", type=int, default=4, help="snapshots taken, the first not counted")
    parser.add_argument("--copy-interval", type=int, default=10, metavar="K", help="steps between snapshots")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures to this file")
    args = parser.parse_args(ours)
    if args.steps < 2 or args.repeats < 2 or args.copy_interval < 1:
        parser.error("--steps and --repeats must be at least 2, --copy-interval at least 1")
    if not flags:
        parser.error("give the training flags after --, e.g. -- --config configs/gpt-tiny.yaml")
    figures = measure(flags, args.steps, args.repeats)
    step = statistics.median(figures["step_s"][1:])
    snapshot = statistics.median(figures["snapshot_s"][1:])
    figures.update(command=" ".join(["python -m benchmarks.snapshot_cost", *argv]), copy_interval=args.copy_interval,
                   median_step_s=step, median_snapshot_s=snapshot,
                   copy_gb_per_s=figures["snapshot_mib"] * 2**20 / snapshot / 1e9,
                   added_per_iteration_percent=100.0 * snapshot / (args.copy_interval * step))
    print(f"{figures['device']}: {figures['parameters'] / 1e6:.1f}M parameters; step {step * 1000:.1f} ms (median of "
          f"{args.steps - 1}); snapshot of {figures['snapshot_mib']:.1f} MiB: first {figures['snapshot_s'][0]:.3f} s, "
          f"then {snapshot:.3f} s (median, {figures['copy_gb_per_s']:.2f} GB/s); every {args.copy_interval} steps it "
          f"adds {figures['added_per_iteration_percent']:.2f}% to an iteration", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
