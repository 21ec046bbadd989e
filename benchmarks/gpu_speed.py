"""The project's training speed beside a plain PyTorch GPT of the same shape, in one run.

    python -m benchmarks.gpu_speed [--steps 8] [--warmup 3] [--peak-tflops F] [--json PATH] -- FLAGS

One process, T=1 P=1 D=1. The model the training flags after `--` describe (GPT, mock
data is fine) trains --steps timed steps of its global batch, first as
megatron_parcae.training.runtime.LayoutRuntime builds it (megatron-core with DDP and its
mixed-precision Adam), then as a plain PyTorch model of the same shape: pre-norm blocks
with `torch.nn.functional.scaled_dot_product_attention` (causal), a GELU MLP, tied
embeddings, fp32 weights under autocast (bf16/fp16 as the flags say) and fused AdamW,
the same micro-batches accumulated into one update. For each: tokens/s, model TFLOP/s
(megatron_parcae.training.metrics.flops, no recomputation counted) and model FLOPs
utilisation against the device's dense peak (--peak-tflops, or known for H100/H200/A100
in bf16/fp16), and a torch.profiler table of the 10 kernels with the most device time
over two steps (CPU operators without a GPU).
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
import torch.nn.functional as F
from torch.autograd import DeviceType

# Dense bf16/fp16 tensor-core peaks (TFLOP/s) of the SXM parts, by a name's substring.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def _synchronized() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PlainGPT(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, positions: int) -> None:
        super().__init__()
        self.embedding, self.positions = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(positions, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm(x), self.embedding.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def _timed(step, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step` after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(steps):
        start = _synchronized()
        step()
        seconds.append(_synchronized() - start)
    return seconds


def _top_kernels(step, device: torch.device) -> list[dict]:
    """The 10 kernels (CPU operators without a GPU) with the most self time over two steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        _synchronized()
    on_device = device.type == "cuda"
    # On a GPU the kernels only: an operator's entry counts the kernels it launched again.
    averages = [a for a in prof.key_averages() if not on_device or a.device_type == DeviceType.CUDA]

    def self_us(a) -> float:
        if on_device:
            return getattr(a, "self_device_time_total", None) or getattr(a, "self_cuda_time_total", 0.0)
        return a.self_cpu_time_total

    rows = sorted((a for a in averages if self_us(a) > 0), key=self_us, reverse=True)[:10]
    total = sum(self_us(a) for a in averages) or 1.0
    return [{"name": a.key[:120], "calls": a.count, "ms": self_us(a) / 1000.0, "share": self_us(a) / total}
            for a in rows]


def _figures(name: str, step_s: list[float], tokens: int, flops: float, peak_tflops: float | None,
             kernels: list[dict]) -> dict:
    median = statistics.median(step_s)
    tflops = flops / median / 1e12
    return {"name": name, "step_s": step_s, "median_step_s": median, "tokens_per_s": tokens / median,
            "model_tflops": tflops, "mfu": tflops / peak_tflops if peak_tflops else None, "top_kernels": kernels}


def measure_megatron(args: argparse.Namespace, steps: int, warmup: int) -> tuple[list[float], list[dict]]:
    from megatron_parcae.training.data.datasets import build_datasets, build_tokenizer
    from megatron_parcae.training.models import padded_vocab_size
    from megatron_parcae.training.progress import Progress
    from megatron_parcae.training.runtime import LayoutRuntime

    tokenizer = build_tokenizer(args)
    runtime = LayoutRuntime(args, padded_vocab_size(tokenizer.vocab_size, args))
    try:
        dataset, _ = build_datasets(args, tokenizer)
        done = 0

        def step() -> None:
            nonlocal done
            runtime.train_step(dataset, Progress(done, done * args.global_batch_size), report=False)
            done += 1

        return _timed(step, warmup, steps), _top_kernels(step, _device())
    finally:
        runtime.destroy()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def measure_plain(args: argparse.Namespace, vocab: int, steps: int, warmup: int) -> tuple[list[float], list[dict]]:
    device = _device()
    torch.manual_seed(args.seed)
    model = PlainGPT(args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size, vocab,
                     args.max_position_embeddings).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    accumulate = args.global_batch_size // args.micro_batch_size
    shape = (args.micro_batch_size, args.seq_length)
    tokens = torch.randint(0, vocab, shape, device=device)
    labels = torch.randint(0, vocab, shape, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = model(tokens, labels) / accumulate
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()

    step_s = _timed(step, warmup, steps)
    kernels = _top_kernels(step, device)
    del model, optimizer
    return step_s, kernels


def measure(flags: list[str], steps: int, warmup: int, peak_tflops: float | None) -> dict:
    from megatron_parcae.training.arguments import parse_args
    from megatron_parcae.training.data.datasets import build_tokenizer
    from megatron_parcae.training.device import prepare_device
    from megatron_parcae.training.metrics.flops import model_flops_per_step
    from megatron_parcae.training.models import padded_vocab_size
    from reconfig.world import process_group_backend

    prog = "python -m benchmarks.gpu_speed"
    args = parse_args(["--train-iters", str(warmup + steps + 2), *flags, "--tensor-model-parallel-size", "1",
                       "--pipeline-model-parallel-size", "1"], prog=prog, model="gpt", world_size=1)
    prepare_device()
    dist.init_process_group(process_group_backend(), store=dist.HashStore(), rank=0, world_size=1)
    try:
        vocab = padded_vocab_size(build_tokenizer(args).vocab_size, args)
        flops = model_flops_per_step("gpt", args.num_layers, args.hidden_size, args.ffn_hidden_size, args.seq_length,
                                     vocab, args.global_batch_size)
        tokens = args.global_batch_size * args.seq_length
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        if peak_tflops is None and (args.bf16 or args.fp16):
            peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
        megatron_s, megatron_kernels = measure_megatron(args, steps, warmup)
        plain_s, plain_kernels = measure_plain(args, vocab, steps, warmup)
        runs = [_figures("megatron-parcae (megatron-core, local spec)", megatron_s, tokens, flops, peak_tflops,
                         megatron_kernels),
                _figures("plain PyTorch (scaled_dot_product_attention)", plain_s, tokens, flops, peak_tflops,
                         plain_kernels)]
        parameters = 12 * args.num_layers * args.hidden_size ** 2 + vocab * args.hidden_size
        return {"device": device, "torch": torch.__version__, "peak_tflops": peak_tflops, "vocab_size": vocab,
                "approximate_parameters": parameters, "tokens_per_step": tokens, "model_flops_per_step": flops,
                "runs": runs}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_speed",
                                     description="training speed beside plain PyTorch (see the module docstring); "
                                                 "training flags follow --")
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each model")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense peak for the MFU (TFLOP/s)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures to this file")
    options = parser.parse_args(ours)
    if options.steps < 1 or options.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    if not flags:
        parser.error("give the training flags after --, e.g. -- --config configs/gpt-tiny.yaml")
    figures = measure(flags, options.steps, options.warmup, options.peak_tflops)
    figures["command"] = " ".join([parser.prog, *argv])
    print(f"{figures['device']}: about {figures['approximate_parameters'] / 1e6:.0f}M parameters, "
          f"{figures['tokens_per_step']} tokens per step, median of {options.steps} steps each")
    for run in figures["runs"]:
        mfu = f", MFU {100 * run['mfu']:.1f}% of {figures['peak_tflops']:g} TFLOP/s" if run["mfu"] is not None else ""
        print(f"  {run['name']}: {run['median_step_s'] * 1000:.1f} ms per step, {run['tokens_per_s']:.0f} tokens/s, "
              f"{run['model_tflops']:.1f} model TFLOP/s{mfu}")
        for k in run["top_kernels"]:
            print(f"      {k['ms']:9.2f} ms {100 * k['share']:5.1f}% {k['calls']:6d}x  {k['name']}")
    if options.json is not None:
        options.json.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
