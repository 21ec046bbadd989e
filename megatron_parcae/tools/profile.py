"""`parcae profile`: measure a model's per-layer costs on this device for the throughput model.

The liveput optimizer's analytic 1F1B model (megatron_parcae/liveput/throughput.py, format
`megatron-parcae-layer-profile`) needs, for the embedding, every transformer layer and
the head: forward and backward time of one micro-batch at T = 1, the activation bytes a
micro-batch keeps until its backward, and the bytes a stage sends on. This command builds
a megatron-core model of the configured shape with one transformer layer (one process,
T = P = 1, embedding and head included), runs each unit on its own with inputs of the
configured shape, and writes those figures, the layer's repeated for every layer of the
model: the transformer layers of a GPT or BERT all have the same shape, so they cost the
same. The device thus holds one layer, the embedding and the head with their optimizer
state, whatever the depth (for GPT-6.7B, 0.4 B of its 6.7 B parameters).
The profile describes the whole model (`model_shape`, each unit's parameters), so it is
refused for any other:

    parcae profile --output gpt-1.5b.profile.json -- --config configs/gpt-1.5b.yaml --bf16 \\
        --transformer-impl transformer_engine --mock-data --vocab-size 50257

Tensor parallelism is modelled, not measured: PipelineModel prices T > 1 from the T = 1
figures (compute divided by T, plus four ring all-reduces of a layer's output per layer at
`tensor_parallel_bytes_per_second`). That bandwidth defaults to the cost constants'
`intra_instance_bytes_per_second` (liveput/parcae_cost_constants.json: 25 GB/s, one NVLink
2.0 link between two V100s of a p3 instance), since a tensor-parallel group never leaves
its instance (OnInstances); pipeline and data-parallel traffic crosses the network, 10 Gb/s
unless `--link-bytes-per-second` says otherwise.

With `--analytic` it builds no model: it times this device's matmuls at the model's own
shapes and its memory bandwidth (a second or two) and computes the figures from the
model's shape (megatron_parcae/liveput/analytic.py). That is a prior, not a measurement:
the coordinator corrects it from the step times the workers report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from megatron_parcae.liveput.analytic import GRADIENT_BYTES_PER_PARAM, DeviceRates, analytic_profile
from megatron_parcae.liveput.cost import CostConstants
from megatron_parcae.training.arguments import ArgumentError, parse_args

DEFAULT_LINK_BYTES_PER_SECOND = 1.25e9  # 10 Gb/s, the network of Parcae's p3.2xlarge cluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True, help="profile JSON to write")
    parser.add_argument("--model", choices=("gpt", "bert"), default="gpt", help="the model the flags after -- build")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per unit (after one warm-up)")
    parser.add_argument("--analytic", action="store_true",
                        help="build no model: compute the figures from the model's shape and this device's "
                             "measured matmul rate and memory bandwidth (a prior the coordinator corrects)")
    parser.add_argument("--link-bytes-per-second", type=float, default=DEFAULT_LINK_BYTES_PER_SECOND,
                        help="bandwidth between workers (pipeline p2p, data-parallel all-reduce)")
    parser.add_argument("--tensor-parallel-bytes-per-second", type=float,
                        default=CostConstants.load().intra_instance_bytes_per_second,
                        help="bandwidth of tensor-parallel all-reduces, inside an instance (default: %(default).3g, "
                             "the cost constants' intra_instance_bytes_per_second)")
    parser.add_argument("--max-tensor-parallel", type=int, default=8, help="GPUs that share a fast link")
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER,
                        help="-- then the model's Megatron-LM flags or --config FILE.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UnitTimer:
    """Times one unit's forward and backward and counts what autograd saves for backward:
    a micro-batch's activations, not the parameters (state, counted per parameter), whose
    storage is the model's whole parameter buffer under the distributed optimizer."""

    def __init__(self, repeats: int, parameters: Iterable[object]) -> None:
        import torch

        self.torch = torch
        self.repeats = repeats
        self.parameter_storage = {p.untyped_storage().data_ptr() for p in parameters}

    def _sync(self) -> None:
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()

    def measure(self, forward: Callable[[], "object"]) -> tuple[dict, object]:
        torch = self.torch
        saved: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.parameter_storage:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        fwd, bwd = [], []
        for run in range(self.repeats + 1):
            saved.clear()  # one run's: another run's tensors may lie elsewhere
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


def one_layer(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with one transformer layer: every layer has the same shape, so one stands for all."""
    return argparse.Namespace(**{**vars(args), "num_layers": 1, "stage_layers": (1,)})


def measure(args: argparse.Namespace, repeats: int) -> dict:
    """Costs of the embedding, one transformer layer, the head and the optimizer step of
    the model `args` describe, on this process's device, from a one-layer copy of it."""
    import torch

    from megatron_parcae.training.data.datasets import build_tokenizer
    from megatron_parcae.training.models import padded_vocab_size
    from megatron_parcae.training.device import initialize_distributed
    from megatron_parcae.training.runtime import LayoutRuntime
    from reconfig.tensors import transformer_layers, unwrap

    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    initialize_distributed()
    vocab = padded_vocab_size(build_tokenizer(args).vocab_size, args)
    runtime = LayoutRuntime(one_layer(args), vocab)
    chunk = unwrap(runtime.model[0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, vocab, (b, s), device=device)
    positions = torch.arange(s, device=device).expand(b, s)
    timer = UnitTimer(repeats, chunk.parameters())
    bert = args.model == "bert"
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool, device=device) if bert else None

    # BERT's binary head comes with sentence (token type) embeddings, which need their ids.
    types = torch.zeros_like(tokens) if chunk.embedding.num_tokentypes else None
    embedding, hidden = timer.measure(lambda: chunk.embedding(input_ids=tokens, position_ids=positions,
                                                              tokentype_ids=types))
    (layer,) = transformer_layers(chunk)
    x = hidden.clone().requires_grad_(True)
    layer_unit, hidden = timer.measure(lambda: layer(hidden_states=x, attention_mask=mask)[0])
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
    # The first step allocates Adam's moments: time the steps after it.
    optimizer_ms = 1000 * _seconds_per_call(runtime.optimizer.step, repeats)
    return {"embedding": embedding, "layer": layer_unit, "head": head_unit, "optimizer_ms": optimizer_ms,
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
        tensor_parallel_bytes_per_second=options.tensor_parallel_bytes_per_second,
        max_tensor_parallel=options.max_tensor_parallel)


def build_profile(args: argparse.Namespace, measured: dict, options: argparse.Namespace) -> dict:
    """The profile document of the whole model `args` describe, from `measure`'s figures:
    the one layer's for every layer, and the one-layer model's optimizer step shared out
    over the whole model's units by parameters."""
    from reconfig.layout import ModelShape

    shape = ModelShape.from_args(args, measured["vocab_size"])
    built = dataclasses.replace(shape, num_layers=1)
    ms_per_param = measured["optimizer_ms"] / sum(u.params for u in built.units())
    share = {u.name: ms_per_param * u.params for u in shape.units()}
    embedding = {**measured["embedding"],
                 "optimizer_ms": sum(v for k, v in share.items() if k.startswith("embedding"))}
    layers = [{**measured["layer"], "optimizer_ms": share[f"layer.{i}"]} for i in range(shape.num_layers)]
    head = {**measured["head"], "optimizer_ms": share.get("head", 0.0)}
    return {
        "format": "megatron-parcae-layer-profile", "version": 1,
        "model": Path(args.config).stem if args.config else args.model,
        "device": measured["device"],
        "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
        "gpu_memory_bytes": _memory_bytes(),
        "link_bytes_per_second": options.link_bytes_per_second,
        "tensor_parallel_bytes_per_second": options.tensor_parallel_bytes_per_second,
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
