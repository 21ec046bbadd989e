"""`parcae compare --checkpoint A --reference B -- TRAINING FLAGS`: how far apart the
states of two checkpoints are.

A layout change, a recovery or a resume must leave the model where an uninterrupted run
would be; this is the check. Both checkpoints are loaded at T1P1D1 in this process (dist
checkpoints reshard on load, so they may come from any layouts) and compared by
||a - b|| / ||b||: over all parameters, over all Adam moments, and for the single tensor
where it is largest. Prints JSON; exits 1 when the parameters differ by more than
--tolerance. The training flags describe the model, as in the run that saved them.

Expect about 1e-7 over the whole model between two runs on different layouts (float
sums in another order); single tensors with no true gradient, such as the key part of
the QKV bias, drift further, as Adam turns their rounding noise into lr-sized steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the checkpoints, after the arguments are checked
    import torch

TOLERANCE = 1e-5


@dataclass(frozen=True)
class StateDifference:
    """||a - b|| / ||b|| of two states: all parameters, all Adam moments, the worst tensor."""

    params: float
    moments: float
    worst_tensor: str
    worst_tensor_diff: float

    @classmethod
    def of(cls, state: dict[str, dict[str, torch.Tensor]],
           reference: dict[str, dict[str, torch.Tensor]]) -> StateDifference:
        if state.keys() != reference.keys():
            raise ValueError(f"the states hold different parameters: {sorted(state.keys() ^ reference.keys())[:5]}")
        squares = {"params": [0.0, 0.0], "moments": [0.0, 0.0]}
        worst = ("", 0.0)
        for name, tensors in sorted(reference.items()):
            for key, ref in tensors.items():
                diff, norm = float((state[name][key] - ref).norm()), float(ref.norm())
                group = squares["params" if key == "param" else "moments"]
                group[0] += diff**2
                group[1] += norm**2
                if diff / max(norm, 1e-30) > worst[1]:
                    worst = (f"{name} ({key})", diff / max(norm, 1e-30))
        params, moments = ((d / max(n, 1e-60)) ** 0.5 for d, n in squares.values())
        return cls(params, moments, *worst)


def load_state(root: str | Path, flags: list[str], model: str) -> dict[str, dict[str, torch.Tensor]]:
    """The newest checkpoint under `root`: parameters and Adam moments by global name.

    Runs in this process as a one-rank WORLD (made here if there is none).
    """
    import torch.distributed as dist

    from megatron_parcae.training import checkpointing
    from megatron_parcae.training.arguments import parse_args
    from megatron_parcae.training.data.datasets import build_tokenizer
    from megatron_parcae.training.models import padded_vocab_size
    from reconfig.optimizer_state import export_param_states
    from megatron_parcae.training.device import prepare_device
    from megatron_parcae.training.runtime import LayoutRuntime

    args = parse_args([*flags, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"],
                      prog="parcae compare", model=model, world_size=1)
    if not dist.is_initialized():
        prepare_device()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runtime = LayoutRuntime(args, padded_vocab_size(build_tokenizer(args).vocab_size, args))
    try:
        checkpointing.load(str(root), runtime)
        return {s.shard.global_name: s.tensors for s in export_param_states(runtime.model, runtime.optimizer)}
    finally:
        runtime.destroy()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, required=True, help="a --save folder (its newest checkpoint is read)")
    parser.add_argument("--reference", type=Path, required=True, help="the --save folder to compare against")
    parser.add_argument("--model", choices=("gpt", "bert"), default="gpt", help="the model the training flags build")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"largest relative difference of the parameters allowed (default {TOLERANCE:g})")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the training flags of the runs")


def missing_folder(args: argparse.Namespace) -> str | None:
    """The first of --checkpoint, --reference that is not a folder, said as an error."""
    for flag, path in (("--checkpoint", args.checkpoint), ("--reference", args.reference)):
        if not path.is_dir():
            return f"{flag} {path}: {'not a folder' if path.exists() else 'no such folder'}"
    return None


def run(args: argparse.Namespace) -> int:
    problem = missing_folder(args)  # before megatron-core and torch load: seconds
    if problem is not None:
        print(f"parcae compare: error: {problem}", file=sys.stderr)
        return 2
    from megatron_parcae.training.arguments import ArgumentError
    from megatron_parcae.training.checkpointing import CheckpointError

    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    try:
        if not args.tolerance >= 0:
            raise ValueError(f"--tolerance must be >= 0, got {args.tolerance}")
        difference = StateDifference.of(load_state(args.checkpoint, flags, args.model),
                                        load_state(args.reference, flags, args.model))
    except (ArgumentError, CheckpointError, ValueError) as exc:
        print(f"parcae compare: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({**asdict(difference), "tolerance": args.tolerance}, indent=1))
    return 0 if difference.params <= args.tolerance else 1
