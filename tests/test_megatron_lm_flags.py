"""Megatron-LM's pretrain_gpt.py flags (docs/megatron-lm-flags.md): a launch line written
with them trains, each flag whose feature the project lacks is refused in one line that
names it, and `--parcae` without a source of layout changes fails at once."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, child_env, trained_losses
from megatron_parcae.events import Iteration, read_events
from megatron_parcae.training.arguments import UNSUPPORTED, build_parser, parse_args

G = 4  # --global-batch-size
# A GPT launch line as Megatron-LM's examples write one, at a size two CPU cores train in
# seconds: random tokens through NullTokenizer, samples rather than steps.
MEGATRON_GPT = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--kv-channels", "32", "--seq-length", "32", "--max-position-embeddings", "32", "--swiglu",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--no-masked-softmax-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--micro-batch-size", "2", "--global-batch-size", str(G), "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.2", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--distributed-backend", "gloo", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--ckpt-format", "torch_dist", "--no-load-rng", "--log-interval", "1",
]
SAMPLES = 26  # 6 steps of 4; the schedule spans all 26 samples


def _train(args: list[str], events: Path) -> subprocess.CompletedProcess:
    """scripts/pretrain_gpt.py as one torchrun rank, warnings shown (the tests' default hides them)."""
    env = {k: v for k, v in child_env().items() if k != "PYTHONWARNINGS"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(REPO / "scripts" / "pretrain_gpt.py"), *args, "--parcae-events", str(events)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _iterations(events: Path) -> dict[int, Iteration]:
    return {e.iteration: e for e in read_events(events) if isinstance(e, Iteration)}


@pytest.mark.slow
def test_a_megatron_lm_launch_line_trains_and_resumes_without_its_optimizer(tmp_path):
    save = tmp_path / "ckpt"
    first = _train([*MEGATRON_GPT, "--train-samples", str(SAMPLES), "--save", str(save), "--save-interval", "3"],
                   tmp_path / "first.jsonl")
    assert first.returncode == 0, first.stderr[-3000:]
    losses = trained_losses(read_events(tmp_path / "first.jsonl"))
    assert sorted(losses) == list(range(1, SAMPLES // G + 1))
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    # Megatron-LM's schedule in samples: warmup over 0.2 x 26 samples, so the second step
    # (4 samples in) runs at 4 / 5.2 of --lr.
    steps = _iterations(tmp_path / "first.jsonl")
    assert steps[1].learning_rate == 0.0
    assert steps[2].learning_rate == pytest.approx(1e-3 * G / (0.2 * SAMPLES), rel=1e-6)
    # The flags that change the model's parameters are in the checkpoint's record of it.
    record = json.loads((save / "iter_0000006" / "parcae_progress.json").read_text())["model"]
    assert record["kv_channels"] == 32 and record["disable_bias_linear"] is True
    # megatron-core's warnings that Transformer Engine and Apex are missing: at most one.
    assert first.stderr.count("not installed") <= 1, first.stderr

    resumed = _train([*MEGATRON_GPT, "--train-samples", str(SAMPLES + 2 * G), "--load", str(save),
                      "--no-load-optim"], tmp_path / "resumed.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = _iterations(tmp_path / "resumed.jsonl")
    assert sorted(steps) == [7, 8]  # the iteration comes from the checkpoint
    assert steps[7].learning_rate == 0.0  # the schedule starts afresh, as Adam does


def test_the_honoured_model_flags_reach_megatron_cores_config():
    from megatron_parcae.training.cpu import import_megatron_core

    import_megatron_core()
    from megatron.core.transformer.enums import AttnBackend

    from megatron_parcae.training.models import transformer_config

    args = parse_args([*MEGATRON_GPT, "--train-samples", str(SAMPLES)], prog="pretrain_gpt.py", model="gpt",
                      world_size=1)
    assert args.train_iters == SAMPLES // G and args.lr_warmup_iters == pytest.approx(0.2 * SAMPLES / G)
    config = transformer_config(args)
    assert config.kv_channels == 32 and not config.add_bias_linear and not config.masked_softmax_fusion
    assert config.attention_backend == AttnBackend.auto


def test_every_flag_is_described_and_help_shows_defaults():
    parser = build_parser("pretrain_gpt.py")
    assert [a.option_strings for a in parser._actions if not (a.help or "").strip()] == []
    text = " ".join(parser.format_help().split())
    assert "(default: 0.02)" in text and "(required)" in text


_BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
         "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
_REFUSED = [
    ["--num-experts", "8"], ["--expert-model-parallel-size", "2"], ["--context-parallel-size", "2"],
    ["--fp8-format", "hybrid"], ["--virtual-pipeline-model-parallel-size", "2"],
    ["--num-layers-per-virtual-pipeline-stage", "1"], ["--rampup-batch-size", "4", "4", "100"],
    ["--ckpt-format", "torch"],
    # Without Transformer Engine's layers, which --use-flash-attn needs (the default is local).
    ["--use-flash-attn"],
]


def _fails(extra: list[str]) -> tuple[int, list[str], float]:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    start = time.monotonic()
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "pretrain_gpt.py"), *_BASE, *extra],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return run.returncode, run.stderr.strip().splitlines(), time.monotonic() - start


def test_the_refusals_cover_every_unsupported_flag():
    assert {dest for dest, _, _ in UNSUPPORTED} <= {flags[0][2:].replace("-", "_") for flags in _REFUSED}


@pytest.mark.slow
@pytest.mark.parametrize("flags", _REFUSED, ids=lambda flags: flags[0])
def test_a_flag_the_project_cannot_honour_is_refused_in_one_line(flags):
    code, lines, _ = _fails(flags)
    assert code == 2
    prefix = f"pretrain_gpt.py: error: {flags[0]}"
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    assert len(lines[0]) > len(prefix) + 30, lines  # and why


@pytest.mark.slow
def test_nccl_is_refused_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU takes nccl")
    code, lines, _ = _fails(["--distributed-backend", "nccl"])
    assert code == 2 and len(lines) == 1 and "--distributed-backend nccl" in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--parcae"], "--parcae needs --parcae-etcd"),
    (["--parcae-job", "j"], "--parcae-job needs --parcae-etcd"),
], ids=["parcae-alone", "job-without-etcd"])
def test_parcae_without_a_source_of_layout_changes_fails_at_once(flags, message):
    code, lines, seconds = _fails(flags)
    assert code != 0 and len(lines) == 1 and message in lines[0], lines
    assert seconds < 5  # flags are checked before torch loads


@pytest.mark.slow
def test_a_huggingface_tokenizer_needs_transformers_or_reads_a_local_folder(tiny_data, tmp_path):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    if importlib.util.find_spec("transformers") is None:
        code, lines, _ = _fails(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder)])
        assert code == 2 and len(lines) == 1 and "transformers is not installed" in lines[0], lines
        return
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from megatron_parcae.training.data.tokenizer import HuggingFaceTokenizer, Tokenizer

    bpe = ByteLevelBPETokenizer(str(REPO / "data" / "gpt2-vocab.json"), str(REPO / "data" / "gpt2-merges.txt"))
    bpe.add_special_tokens(["<|endoftext|>"])
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)
    ours, theirs = Tokenizer("GPT2BPETokenizer", str(REPO / "data" / "gpt2-vocab.json"),
                             str(REPO / "data" / "gpt2-merges.txt")), HuggingFaceTokenizer(str(folder))
    text = "def f(x):\n    return x + 1"
    assert theirs.tokenize(text) == ours.tokenize(text)
    assert (theirs.vocab_size, theirs.eod) == (ours.vocab_size, ours.eod)
