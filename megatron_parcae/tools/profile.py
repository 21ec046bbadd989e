"""`parcae profile`: measure a model's per-layer costs on this device for the throughput model.

The liveput optimizer's analytic 1F1B model (megatron_parcae/liveput/throughput.py, format
`megatron-parcae-layer-profile`) needs, for the embedding, every transformer layer and
the head: forward and backward time of one micro-batch at T = 1, the activation bytes a
micro-batch keeps until its backward, and the bytes a stage sends on. This command builds
the real megatron-core model (one process, T = P = 1), runs each unit on its own with
inputs of the configured shape, and writes those figures:

    parcae profile --output gpt-1.5b.profile.json -- --config configs/gpt-1.5b.yaml --bf16 \\
        --transformer-impl transformer_engine --mock-data --vocab-size 50257

With `--analytic` it builds no model: it times this device's matmuls at the model's own
shapes and its memory bandwidth (a second or two) and computes the figures from the
model's shape (megatron_parcae/liveput/analytic.py). That is a prior, not a measurement:
the coordinator corrects it from the step times the workers report.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from megatron_parcae.liveput.analytic import GRADIENT_BYTES_PER_PARAM, DeviceRates, analytic_profile
from megatron_parcae.training.arguments import ArgumentError, parse_args

DEFAULT_LINK_BYTES_PER_SECOND = 1.25e9  # 10 Gb/s, the network of Parcae's p3.2xlarge cluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True, help="profile JSON to write")
    parser.add_argument("--model", choices=("gpt", "bert"), default="gpt")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per unit (after one warm-up)")
    parser.add_argument("--analytic", action="store_true",
                        help="build no model: compute the figures from the model's shape and this device's "
                             "measured matmul rate and memory bandwidth (a prior the coordinator corrects)")
    parser.add_argument("--link-bytes-per-second", type=float, default=DEFAULT_LINK_BYTES_PER_SECOND,
                        help="bandwidth between workers (pipeline p2p, data-parallel all-reduce)")
    parser.add_argument("--tensor-parallel-bytes-per-second", type=float, default=None,
                        help="bandwidth of tensor-parallel all-reduces (default: the link bandwidth)")
    parser.add_argument("--max-tensor-parallel", type=int, default=8, help="GPUs that share a fast link")
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER,
                        help="-- then the model's Megatron-LM flags or --config FILE.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _UnitTimer:
    """Times one unit's forward and backward and counts what autograd saves for backward."""

    def __init__(self, repeats: int) -> None:
        import torch

        self.torch = torch
        self.repeats = repeats

    def _sync(self) -> None:
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()

    def measure(self, forward: Callable[[], "object"]) -> tuple[dict, object]:
        torch = self.torch
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        fwd, bwd = [], []
        for run in range(self.repeats + 1):
            self._sync()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward()
            self._sync()
            mid = time.perf_counter()
            out.backward(torch.ones_like(out) / out.numel())
            self._sync()
            if run:  # the first run warms up
                fwd.append(mid - start)
                bwd.append(time.perf_counter() - mid)
        fwd.sort()
        bwd.sort()
        unit = {"forward_ms": 1000 * fwd[len(fwd) // 2], "backward_ms": 1000 * bwd[len(bwd) // 2],
                "optimizer_ms": 0.0, "activation_bytes": float(sum(saved.values())),
                "output_bytes": float(out.numel() * out.element_size())}
        return unit, out.detach()


def measure(args: argparse.Namespace, repeats: int) -> dict:
    """Per-unit costs of the model `args` describe, on this process's device."""
    import torch

    from megatron_parcae.training.data.datasets import build_tokenizer
    from megatron_parcae.training.models import padded_vocab_size
    from megatron_parcae.training.device import initialize_distributed
    from megatron_parcae.training.runtime import LayoutRuntime
    from reconfig.tensors import transformer_layers, unwrap

    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    initialize_distributed()
    vocab = padded_vocab_size(build_tokenizer(args).vocab_size, args)
    runtime = LayoutRuntime(args, vocab)
    chunk = unwrap(runtime.model[0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, vocab, (b, s), device=device)
    positions = torch.arange(s, device=device).expand(b, s)
    timer = _UnitTimer(repeats)
    bert = args.model == "bert"
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool, device=device) if bert else None

    embedding, hidden = timer.measure(lambda: chunk.embedding(input_ids=tokens, position_ids=positions))
    layers = []
    for layer in transformer_layers(chunk):
        x = hidden.clone().requires_grad_(True)
        unit, hidden = timer.measure(lambda: layer(hidden_states=x, attention_mask=mask)[0])
        layers.append(unit)
    x = hidden.clone().requires_grad_(True)
    weight = chunk.shared_embedding_or_output_weight()

    def head():
        h = chunk.lm_head(hidden_states=x) if bert else chunk.decoder.final_layernorm(x)
        logits, _ = chunk.output_layer(h, weight=weight)
        loss = chunk.compute_language_model_loss(tokens, logits)
        if bert and chunk.binary_head is not None:
            loss = loss.float().mean() + chunk.binary_head(chunk.pooler(x, 0)).float().mean()
        return loss.float().mean().view(1)

    head_unit, _ = timer.measure(head)
    start = time.perf_counter()
    runtime.optimizer.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    optimizer_ms = 1000 * (time.perf_counter() - start)
    return {"embedding": embedding, "layers": layers, "head": head_unit, "optimizer_ms": optimizer_ms,
            "vocab_size": vocab, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}


def _memory_bytes() -> float:
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    import psutil

    return float(psutil.virtual_memory().total)


def _seconds_per_call(call: Callable[[], object], repeats: int) -> float:
    """Best of `repeats` timed calls after a warm-up: the rate the device can sustain."""
    import torch

    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_device(args: argparse.Namespace, repeats: int) -> DeviceRates:
    """This device's matmul rate on one micro-batch of the model's layer matmuls (QKV,
    MLP up and down, in the run's dtype) and its memory bandwidth on an elementwise add."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 and device == "cuda" else torch.float32
    tokens, h, f = args.micro_batch_size * args.seq_length, args.hidden_size, args.ffn_hidden_size
    x, xf = torch.randn(tokens, h, dtype=dtype, device=device), torch.randn(tokens, f, dtype=dtype, device=device)
    weights = [torch.randn(h, 3 * h, dtype=dtype, device=device), torch.randn(h, f, dtype=dtype, device=device)]
    down = torch.randn(f, h, dtype=dtype, device=device)

    def matmuls() -> None:
        for w in weights:
            x @ w
        xf @ down
    flops = 2.0 * tokens * h * (3 * h + 2 * f)
    a, b = (torch.ones(1 << 23, dtype=torch.float32, device=device) for _ in range(2))
    return DeviceRates(torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       flops / _seconds_per_call(matmuls, repeats),
                       3 * a.numel() * a.element_size() / _seconds_per_call(lambda: a.add_(b), repeats),
                       _memory_bytes())


def build_analytic_profile(args: argparse.Namespace, options: argparse.Namespace) -> dict:
    from megatron_parcae.training.data.datasets import build_tokenizer
    from megatron_parcae.training.models import padded_vocab_size
    from reconfig.layout import ModelShape

    shape = ModelShape.from_args(args, padded_vocab_size(build_tokenizer(args).vocab_size, args))
    return analytic_profile(
        shape, model=Path(args.config).stem if args.config else args.model,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        seq_length=args.seq_length, value_bytes=2 if args.bf16 or args.fp16 else 4,
        device=measure_device(args, options.repeats), link_bytes_per_second=options.link_bytes_per_second,
        tensor_parallel_bytes_per_second=options.tensor_parallel_bytes_per_second or options.link_bytes_per_second,
        max_tensor_parallel=options.max_tensor_parallel)


def build_profile(args: argparse.Namespace, measured: dict, options: argparse.Namespace) -> dict:
    """The profile document, with the optimizer step shared out over units by parameters."""
    from reconfig.layout import ModelShape

    shape = ModelShape.from_args(args, measured["vocab_size"])
    units = {u.name: u.params for u in shape.units()}
    total = sum(units.values())
    share = {name: measured["optimizer_ms"] * params / total for name, params in units.items()}
    embedding = {**measured["embedding"],
                 "optimizer_ms": sum(v for k, v in share.items() if k.startswith("embedding"))}
    layers = [{**unit, "optimizer_ms": share[f"layer.{i}"]} for i, unit in enumerate(measured["layers"])]
    head = {**measured["head"], "optimizer_ms": share.get("head", 0.0)}
    return {
        "format": "megatron-parcae-layer-profile", "version": 1,
        "model": Path(args.config).stem if args.config else args.model,
        "device": measured["device"],
        "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
        "gpu_memory_bytes": _memory_bytes(),
        "link_bytes_per_second": options.link_bytes_per_second,
        "tensor_parallel_bytes_per_second": options.tensor_parallel_bytes_per_second or options.link_bytes_per_second,
        "max_tensor_parallel": options.max_tensor_parallel,
        "memory_bytes_per_param": shape.state_bytes_per_param + GRADIENT_BYTES_PER_PARAM,  # state, gradient
        "gradient_bytes_per_param": GRADIENT_BYTES_PER_PARAM,
        "model_shape": shape.to_dict(),
        "embedding": embedding, "layers": layers, "head": head,
    }


def run(options: argparse.Namespace) -> int:
    megatron_args = [a for a in options.megatron_args if a != "--"]
    try:
        if options.repeats < 1:
            raise ArgumentError("--repeats must be positive")
        args = parse_args(megatron_args, prog="parcae profile", model=options.model, world_size=1)
        if not options.analytic and (args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1):
            raise ArgumentError("profiles are measured at T = P = 1 (drop the parallel-size flags)")
    except ArgumentError as exc:
        print(f"parcae profile: error: {exc}", file=sys.stderr)
        return 2
    if options.analytic:
        profile = build_analytic_profile(args, options)
    else:
        profile = build_profile(args, measure(args, options.repeats), options)
    Path(options.output).write_text(json.dumps(profile, indent=1))
    layer_ms = sum(u["forward_ms"] + u["backward_ms"] for u in profile["layers"]) / len(profile["layers"])
    print(f"{options.output}: {len(profile['layers'])} layers, {layer_ms:.2f} ms forward+backward per layer "
          f"per micro-batch on {profile['device']}")
    return 0
