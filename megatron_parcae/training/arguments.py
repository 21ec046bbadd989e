"""Command-line arguments with Megatron-LM's names, YAML configs, and up-front validation.

Everything a run is told is checked here, before torch.distributed starts: a bad value
found after the first collective would hang the other ranks instead of failing.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import yaml

from megatron_parcae.control.etcd.options import add_etcd_arguments, check_etcd_arguments
from megatron_parcae.control.notices import SOURCES as NOTICE_SOURCES, WATCHERS as NOTICE_WATCHERS
from megatron_parcae.control.notices.base import Endpoint
from megatron_parcae.training.data.blend import parse_blend, parse_split
from reconfig.layout import ModelShape, Parallelism, partition_layers

TOKENIZERS = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase")
# What training also takes: ids as they are (Megatron-LM's NullTokenizer), or a tokenizer
# transformers saved in a local folder.
TRAINING_TOKENIZERS = (*TOKENIZERS, "NullTokenizer", "HuggingFaceTokenizer")
# Megatron-LM flags for features this project does not have, each with the value that
# means the feature is off and the reason: parsed, so that using one fails naming it and
# why, instead of as an unrecognized argument. (dest, accepted value, reason)
UNSUPPORTED = (
    ("num_experts", None, "mixture-of-experts layers are not supported (layout changes move dense layers only)"),
    ("expert_model_parallel_size", 1, "expert parallelism needs mixture-of-experts layers, which are not supported"),
    ("context_parallel_size", 1, "context parallelism is not supported: a layout is tensor x pipeline x data "
                                 "parallel"),
    ("fp8_format", None, "FP8 training is not supported: use --bf16 or --fp16"),
    ("virtual_pipeline_model_parallel_size", None, "the interleaved pipeline schedule is not supported"),
    ("num_layers_per_virtual_pipeline_stage", None, "the interleaved pipeline schedule is not supported"),
    ("rampup_batch_size", None, "batch-size ramp-up is not supported: every step trains --global-batch-size "
                                "samples, which is what lets a job change layout between any two steps"),
)
CKPT_FORMAT = "torch_dist"  # megatron-core's sharded format, the one checkpointing.py writes and reads
# What ModelShape.problems checks, by the flags that set it.
_FLAG_NAMES = {
    "num_attention_heads": "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size",
    "num_query_groups": "--num-query-groups",
    "tp": "--tensor-model-parallel-size", "dp": "data-parallel size", "stage_layers": "layers per stage",
    "micro_batch_size": "--micro-batch-size", "global_batch_size": "--global-batch-size",
}


class ArgumentError(ValueError):
    """A user error in flags or config; the message names the flag."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(message)


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's help followed by "(required)" or its default, unless the help already
    says what happens without the flag (an unset flag's default is None or False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return f"{text} (required)"
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="accepted for Megatron-LM launch lines; the models are always megatron-core's")
    g.add_argument("--num-layers", type=int, required=True, help="transformer layers")
    g.add_argument("--hidden-size", type=int, required=True, help="width of the residual stream")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default: 4 x --hidden-size)")
    g.add_argument("--num-attention-heads", type=int, required=True, help="attention heads per layer")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="width of each head's query, key and value projections "
                        "(default: --hidden-size / --num-attention-heads)")
    g.add_argument("--seq-length", type=int, required=True, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, required=True,
                   help="longest sequence the position embeddings cover (at least --seq-length)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x lcm(T, 8), the same model under every T "
                        "in 1, 2, 4, 8")
    g.add_argument("--init-method-std", type=float, default=0.02, help="standard deviation of the initial weights")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout after attention and after the MLP")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="dropout on the attention probabilities")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the attention and MLP linear layers")
    g.add_argument("--bert-no-binary-head", action="store_true", help="BERT without next-sentence head")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute",
                   help="learned absolute position embeddings, or rotary (RoPE)")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="with rope: share of each head's dimensions rotated")
    g.add_argument("--rotary-base", type=int, default=10000, help="with rope: base of the rotary frequencies")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm",
                   help="the layers' normalization")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate, vocab-parallel output layer instead of the word embedding")
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (its fc1 holds [gate; up] per TP shard)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="query heads share --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="with --group-query-attention: key/value heads; every T used must divide it")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="recompute activations in backward: whole layers (full) or core attention (selective)")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with --recompute-granularity full: which layers are recomputed")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with --recompute-method: layers per recomputed unit (uniform) or per stage (block)")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                   help="default: local; transformer_engine (a GPU and Transformer Engine) only when asked: its "
                        "layers have not been taken through in-place changes, snapshots or recoveries, and every "
                        "worker of a job must run the same one")
    g.add_argument("--no-masked-softmax-fusion", action="store_true",
                   help="do not use Megatron's fused scaled-masked-softmax kernel (otherwise used on GPUs where "
                        "it is installed)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="FlashAttention, from Transformer Engine: needs --transformer-impl transformer_engine "
                        "and the flash-attn package")
    g.add_argument("--bf16", action="store_true", help="bfloat16 model, fp32 main weights in the optimizer")
    g.add_argument("--fp16", action="store_true", help="float16 model with loss scaling, fp32 main weights")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: a constant loss scale (default: dynamic, from --initial-loss-scale)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="fp16: the dynamic loss scale's start")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: the dynamic loss scale's floor")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="fp16: steps without overflow before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="fp16: overflows tolerated before the dynamic scale halves")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="T: ranks that split each layer")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="P: pipeline stages")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage, the other stages even (default: all even)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage, the other stages even (default: all even)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard Adam's state (and fp32 main weights) over the data-parallel ranks")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="torch.distributed backend of the model's collectives: nccl on GPUs, gloo on CPU, the "
                        "only one megatron-core works with on each (default: the device's; small control "
                        "messages always go over gloo)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split layernorm and dropout activations over the TP group; on for T > 1, off at T = 1, "
                        "following T through layout changes")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="reduce gradients bucket by bucket during backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: gather updated parameters during the next forward")


def _add_parcae_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parcae")
    g.add_argument("--parcae", action="store_true", help="train with in-place layout changes")
    g.add_argument("--parcae-layout-schedule", default=None, metavar="ITER:T,P,D[:leave=W1,W2][:join=K];...",
                   help="change the layout at these iterations, no coordinator; workers are torchrun ranks, "
                        "joining workers the last K ranks (started with the job, idle until they join)")
    g.add_argument("--parcae-worker-id", type=int, default=None, metavar="ID",
                   help="with --parcae-etcd: this process's id in the job, unique over the job's whole life "
                        "(default: a new one from etcd)")
    g.add_argument("--parcae-instance", default=None, metavar="NAME",
                   help="with --parcae-etcd: the instance (node) this process runs on; a preemption takes all of "
                        "its processes (default: the host name and the launching torchrun's pid)")
    g.add_argument("--parcae-pool", default=None, metavar="NAME",
                   help="with --parcae-etcd: the coordinator config's pool this instance was bought from, which "
                        "prices it (default: what the provisioner tells from the instance's name, else the "
                        "config's first pool)")
    g.add_argument("--parcae-failure-domain", default=None, metavar="NAME",
                   help="with --parcae-etcd: the failure domain of this process's instance, e.g. a cloud zone, "
                        "rack or switch; instances in one domain may fail together, so workers keep their "
                        "copies (--parcae-copy-interval) in another domain where they can (default: none)")
    g.add_argument("--parcae-notice", choices=NOTICE_SOURCES, default="signal",
                   help="with --parcae-etcd: where preemption notices come from besides SIGTERM: a cloud's "
                        "metadata service (aws, gcp, azure), auto (probe them, else signals only) or signal "
                        "(default); local rank 0 watches for its instance")
    g.add_argument("--parcae-metadata-endpoint", default=None, metavar="URL",
                   help="with --parcae-notice aws|gcp|azure: the metadata service's base URL (default: the cloud's)")
    g.add_argument("--parcae-grace-seconds", type=float, default=30.0, metavar="SECONDS",
                   help="with --parcae-etcd: time between SIGTERM (preemption notice) and SIGKILL (default 30; "
                        "under torchrun also pass --shutdown-timeout at least this long)")
    g.add_argument("--parcae-lease-seconds", type=float, default=10.0, metavar="SECONDS",
                   help="with --parcae-etcd: a process silent this long counts as lost, and a collective "
                        "waiting this long for a peer fails (default 10; above the longest wait within a step)")
    g.add_argument("--parcae-first-step-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="with --parcae-etcd: how long a collective of a layout's first step (kernels compile, "
                        "communicators form, the first snapshot pins host memory) waits for a peer; a peer that "
                        "dies meanwhile is still noticed within --parcae-lease-seconds (default 600)")
    g.add_argument("--parcae-copy-interval", type=int, default=10, metavar="STEPS",
                   help="with --parcae-etcd: every this many steps, and after each layout change, each worker "
                        "snapshots its state in host memory and sends a copy to a worker on another instance (none "
                        "where that worker is a DP peer, whose own snapshot is the same), so "
                        "a worker lost without notice costs at most this many steps instead of a checkpoint "
                        "restart; memory: two copies of a worker's state (default 10; 0: no copies)")
    g.add_argument("--parcae-events", default=None, metavar="FILE",
                   help="append what the run does (logged steps, checkpoints, layout changes) to FILE as JSON "
                        "lines, written by the layout's rank 0 (megatron_parcae/events.py); also without --parcae")
    add_etcd_arguments(p, prefix="parcae-", required=False, long_running=True)


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True, help="samples per forward and backward pass")
    g.add_argument("--global-batch-size", type=int, required=True,
                   help="samples per optimizer step, over all data-parallel ranks")
    g.add_argument("--train-iters", type=int, default=None,
                   help="optimizer steps to train (this or --train-samples is required)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train: --train-samples / --global-batch-size steps, rounded down; the "
                        "learning-rate schedule then counts samples (--lr-warmup-samples, --lr-decay-samples)")
    g.add_argument("--lr", type=float, required=True, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"), default="linear",
                   help="shape of the decay from --lr to --min-lr")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="steps of linear warmup from 0 to --lr")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as this fraction of the decay period, instead of --lr-warmup-iters or "
                        "--lr-warmup-samples")
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="with --train-samples: samples of warmup")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="steps of the decay (default: --train-iters)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples: samples of the decay (default: --train-samples)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Adam's decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this (0: no clipping)")
    g.add_argument("--seed", type=int, default=1234, help="seed of the initial weights, the data order and dropout")
    g.add_argument("--log-interval", type=int, default=100, help="print a training line every this many steps")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, with --save) once the iteration is a multiple of this")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None, metavar="[WEIGHT] PREFIX",
                   help="indexed dataset prefixes (without .bin/.idx), blended by size; or weight-prefix pairs "
                        "(0.7 A 0.3 B), blended by weight")
    g.add_argument("--mock-data", action="store_true", help="random tokens, for benchmarks")
    g.add_argument("--split", default="969,30,1", help="train,validation,test shares of each dataset")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="compute the validation loss every this many iterations (default: never)")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches of the validation split each evaluation reads (0: no evaluation)")
    g.add_argument("--tokenizer-type", choices=TRAINING_TOKENIZERS, default=None,
                   help="GPT-2 BPE or BERT WordPiece from --vocab-file (and --merge-file); NullTokenizer: token "
                        "ids as they are, --vocab-size of them plus the end-of-document id; HuggingFaceTokenizer: "
                        "the local folder --tokenizer-model (needs transformers)")
    g.add_argument("--tokenizer-model", default=None, metavar="DIR",
                   help="with HuggingFaceTokenizer: a folder a tokenizer was saved to (save_pretrained); "
                        "nothing is downloaded")
    g.add_argument("--vocab-file", default=None, help="the tokenizer's vocabulary (GPT-2 vocab.json, BERT vocab.txt)")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: its merges file")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="with --mock-data and no tokenizer: the vocabulary; with NullTokenizer: the ids below "
                        "its end-of-document id")
    g.add_argument("--data-cache-path", default=None,
                   help="folder for megatron-core's dataset index caches (default: beside the data)")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-throughput", action="store_true",
                   help="add the model TFLOP/s per GPU to each iteration line")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="write training scalars (losses, learning rate, grad norm, samples/s, TFLOP/s per GPU, "
                        "loss scale, the layout's T, P, D) as TensorBoard event files in DIR, from the layout's rank 0")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write the training scalars every this many iterations (default 1)")
    g.add_argument("--wandb-project", default=None, help="also write the scalars to this Weights & Biases project")
    g.add_argument("--wandb-exp-name", default=None, help="with --wandb-project: the run's name")
    g.add_argument("--wandb-save-dir", default=None, help="with --wandb-project: its local files (default: SAVE/wandb with --save)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, every rank finishes its step, saves a checkpoint under --save and exits 0; "
                        "not with --parcae, where SIGTERM is a preemption notice the job itself handles")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="folder to write checkpoints to, one iter_NNNNNNN/ each")
    g.add_argument("--load", default=None,
                   help="a save folder (its newest checkpoint) or one checkpoint folder, e.g. one a plain "
                        "megatron-core model wrote with dist_checkpointing.save(model.sharded_state_dict(), DIR)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model's weights from --load: Adam starts afresh at iteration 0")
    g.add_argument("--save-interval", type=int, default=None,
                   help="with --save: save every this many steps (and at the end)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load the weights, iteration and consumed samples from --load, not the optimizer: Adam "
                        "and the learning-rate schedule start afresh")
    g.add_argument("--no-load-rng", action="store_true",
                   help="accepted: checkpoints hold no random state (each step seeds from --seed and its "
                        "iteration)")
    g.add_argument("--ckpt-format", default=CKPT_FORMAT,
                   help="checkpoint format: torch_dist (megatron-core's sharded format) only")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints from a forked process while training goes on; a checkpoint becomes "
                        "the newest once every rank has written it")


def _add_unsupported_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("not supported", "Megatron-LM flags refused unless they leave their feature off "
                                              "(docs/megatron-lm-flags.md)")
    reasons = {dest: reason for dest, _, reason in UNSUPPORTED}
    g.add_argument("--num-experts", type=int, default=None, help=reasons["num_experts"])
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help=f"1 only: {reasons['expert_model_parallel_size']}")
    g.add_argument("--context-parallel-size", type=int, default=1, help=f"1 only: {reasons['context_parallel_size']}")
    g.add_argument("--fp8-format", default=None, help=reasons["fp8_format"])
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help=reasons["virtual_pipeline_model_parallel_size"])
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help=reasons["num_layers_per_virtual_pipeline_stage"])
    g.add_argument("--rampup-batch-size", nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help=reasons["rampup_batch_size"])


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=prog, description="megatron-core pretraining with megatron-parcae",
                            formatter_class=_HelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file whose keys are these flags' names")
    for add in (_add_model_args, _add_parallel_args, _add_training_args, _add_data_args, _add_checkpoint_args,
                _add_logging_args, _add_parcae_args, _add_unsupported_args):
        add(parser)
    return parser


def _config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Read a YAML config into argparse defaults, refusing keys that are not flags."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ArgumentError(f"--config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ArgumentError(f"--config: {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ArgumentError(f"--config: {path} must hold a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    defaults: dict[str, Any] = {}
    for key, value in loaded.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None or dest == "config":
            raise ArgumentError(f"--config: unknown key {key!r} in {path}")
        defaults[dest] = _coerce(action, key, value, path)
    return defaults


def _coerce(action: argparse.Action, key: str, value: Any, path: str) -> Any:
    where = f"--config: key {key!r} in {path}"
    if value is None:  # `key:` with nothing after it: as if the key were absent
        return action.default
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ArgumentError(f"{where} must be true or false")
        return value
    values = value if isinstance(value, list) else [value]
    if action.nargs is None and isinstance(value, list):
        raise ArgumentError(f"{where} takes one value, not a list")
    out = []
    for v in values:
        if v is None:
            raise ArgumentError(f"{where}: a list item is empty")
        if action.type is None:  # a text flag: a YAML number reads as its text, nothing else does
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                raise ArgumentError(f"{where}: {v!r} is not text")
            v = str(v)
        else:
            if isinstance(v, bool):
                raise ArgumentError(f"{where}: {v!r} is not a valid {action.type.__name__}")
            try:
                v = action.type(v) if not (action.type is int and isinstance(v, float)) else _int_exact(v)
            except (TypeError, ValueError):
                raise ArgumentError(f"{where}: {v!r} is not a valid {action.type.__name__}") from None
        if action.choices is not None and v not in action.choices:
            raise ArgumentError(f"{where}: {v!r} is not one of {', '.join(map(str, action.choices))}")
        out.append(v)
    return out if action.nargs is not None else out[0]


def _int_exact(v: float) -> int:
    if not math.isfinite(v) or v != int(v):
        raise ValueError(v)
    return int(v)


def parse_args(argv: Sequence[str] | None, prog: str, model: str, world_size: int | None = None,
               extend: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Parse flags over an optional YAML config (flags win) and validate the result.

    `world_size` defaults to torchrun's WORLD_SIZE; it is checked here so that a bad
    layout fails before any process group exists. `extend` adds a command's own flags.
    """
    parser = build_parser(prog)
    if extend is not None:
        extend(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    pre_parser = _OneLineParser(add_help=False)
    pre_parser.add_argument("--config", default=None)
    pre, _ = pre_parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_config_defaults(parser, pre.config))
        for action in parser._actions:  # a value from the file satisfies required=True
            if action.required and parser.get_default(action.dest) is not None:
                action.required = False
    args = parser.parse_args(argv)
    args.model = model
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(args, world_size)
    return args


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ArgumentError(message)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Check the flags against each other and the world size; fill derived values."""
    _refuse_unsupported(args)
    _resolve_train_length(args)
    T, P = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "global_batch_size", "train_iters", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "log_interval", "max_position_embeddings"):
        value = getattr(args, flag)
        _check(value > 0, f"--{flag.replace('_', '-')} must be positive, got {value}")
    _check(args.hidden_size % args.num_attention_heads == 0,
           f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    _check(args.ffn_hidden_size > 0, f"--ffn-hidden-size must be positive, got {args.ffn_hidden_size}")
    _check(args.seq_length <= args.max_position_embeddings,
           f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    args.stage_layers = stage_layers(args.num_layers, P, args.decoder_first_pipeline_num_layers,
                                     args.decoder_last_pipeline_num_layers)
    _validate_model_flags(args)
    # The vocabulary is padded once the tokenizer loads; no check here depends on its size.
    shape = ModelShape.from_args(args, vocab_size=1)
    _check_trainable(shape, Parallelism(T, P, 1, args.stage_layers))  # T and P before the world size they need
    if args.parcae_etcd is not None:
        _check_live_job(args)
        world_size = T * P  # the coordinator's plans choose the layout; T and P here are only checked
    total_workers = world_size
    if args.parcae_layout_schedule is not None:
        world_size -= _parse_layout_schedule(args)
        _check(world_size > 0, f"--parcae-layout-schedule: its joining workers take all {total_workers} processes, "
                               "none is left to start the job")
    _check(world_size % (T * P) == 0,
           f"world size {world_size} is not a multiple of --tensor-model-parallel-size {T} x "
           f"--pipeline-model-parallel-size {P}")
    args.data_parallel_size = world_size // (T * P)
    initial = Parallelism(T, P, args.data_parallel_size, args.stage_layers)
    _check_trainable(shape, initial, args.micro_batch_size, args.global_batch_size)
    for flag in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps", "init_method_std"):
        value = getattr(args, flag)
        _check(math.isfinite(value) and value >= 0, f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
    for flag in ("adam_beta1", "adam_beta2", "hidden_dropout", "attention_dropout"):
        value = getattr(args, flag)
        _check(0 <= value < 1, f"--{flag.replace('_', '-')} must be in [0, 1), got {value}")
    _check(not (args.bf16 and args.fp16), "--bf16 and --fp16 exclude each other")
    for flag in ("initial_loss_scale", "min_loss_scale", *(("loss_scale",) if args.loss_scale is not None else ())):
        value = getattr(args, flag)
        _check(math.isfinite(value) and value > 0, f"--{flag.replace('_', '-')} must be a finite number > 0, got {value}")
    _check(args.min_loss_scale <= args.initial_loss_scale,
           f"--min-loss-scale {args.min_loss_scale} exceeds --initial-loss-scale {args.initial_loss_scale}")
    for flag in ("loss_scale_window", "hysteresis"):
        _check(getattr(args, flag) > 0, f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    _check(args.min_lr <= args.lr, f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        _check(0 <= args.lr_warmup_fraction < 1,
               f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
        _check(args.lr_warmup_iters == 0 and args.lr_warmup_samples is None,
               "--lr-warmup-fraction excludes --lr-warmup-iters and --lr-warmup-samples")
        args.lr_warmup_iters = args.lr_warmup_fraction * args.lr_decay_iters
    _check(args.lr_warmup_iters < args.lr_decay_iters,
           f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters}"
           " (which defaults to --train-iters)")
    _check((args.save_interval is None) or args.save_interval > 0, "--save-interval must be positive")
    _check((args.exit_interval is None) or args.exit_interval > 0, "--exit-interval must be positive")
    _check(args.save_interval is None or args.save is not None, "--save-interval needs --save")
    _check(not args.async_save or args.save is not None, "--async-save needs --save")
    if args.load is not None:
        _check(Path(args.load).is_dir(), f"--load: no checkpoint directory {args.load}")
    _check(not args.finetune or args.load is not None, "--finetune needs --load")
    if args.parcae_events is not None:
        folder = Path(args.parcae_events).parent
        _check(folder.is_dir(), f"--parcae-events: no directory {folder}")
    _validate_data(args)
    _validate_logging(args)
    _check(not args.parcae or args.parcae_etcd is not None or args.parcae_layout_schedule is not None,
           "--parcae needs --parcae-etcd (a job that `parcae coordinator` drives) or --parcae-layout-schedule")
    _check(args.parcae_job is None or args.parcae_etcd is not None, "--parcae-job needs --parcae-etcd")
    _check(not (args.no_load_optim and args.parcae_etcd is not None and args.load is not None
                and args.load == args.save),
           "--no-load-optim with --parcae-etcd needs --load other than --save: the job goes back to its own "
           "checkpoints after a failure, optimizer included")
    _resolve_transformer_impl(args)
    if args.use_flash_attn:
        _check(args.transformer_impl == "transformer_engine",
               "--use-flash-attn: FlashAttention comes from Transformer Engine; add --transformer-impl "
               "transformer_engine (a GPU with Transformer Engine), or leave the flag out")
        _check(any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_interface")),
               "--use-flash-attn: the flash-attn package is not installed (pip install flash-attn)")
    _check_distributed_backend(args)
    if args.parcae_layout_schedule is not None:
        _check_layout_schedule(args, total_workers, shape, initial)


def _refuse_unsupported(args: argparse.Namespace) -> None:
    """One line naming the first flag of UNSUPPORTED that turns its feature on, and why."""
    for dest, accepted, reason in UNSUPPORTED:
        value = getattr(args, dest)
        if value != accepted:
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            raise ArgumentError(f"--{dest.replace('_', '-')} {shown}: {reason}")
    _check(args.ckpt_format == CKPT_FORMAT,
           f"--ckpt-format {args.ckpt_format}: checkpoints are megatron-core's sharded {CKPT_FORMAT} format "
           f"(loadable under any layout) only; use --ckpt-format {CKPT_FORMAT}")


def _resolve_train_length(args: argparse.Namespace) -> None:
    """--train-iters, or Megatron-LM's --train-samples: whole global batches of them, with
    the learning-rate schedule counted in samples. A schedule length given in samples
    becomes steps that may be fractional, so that the scheduler, which counts samples
    (steps x --global-batch-size), warms up and decays over exactly those samples."""
    samples_flags = ("lr_warmup_samples", "lr_decay_samples")
    if args.train_samples is None:
        _check(args.train_iters is not None, "--train-iters or --train-samples is required")
        for flag in samples_flags:
            _check(getattr(args, flag) is None, f"--{flag.replace('_', '-')} needs --train-samples")
        return
    _check(args.train_iters is None, "--train-iters and --train-samples exclude each other")
    G = args.global_batch_size
    _check(G > 0, f"--global-batch-size must be positive, got {G}")
    _check(args.train_samples >= G,
           f"--train-samples {args.train_samples} is less than one --global-batch-size {G}")
    _check(args.lr_decay_iters is None and args.lr_warmup_iters == 0,
           "with --train-samples the schedule is in samples: --lr-decay-samples and --lr-warmup-samples, not "
           "--lr-decay-iters and --lr-warmup-iters")
    for flag in samples_flags:
        value = getattr(args, flag)
        _check(value is None or value >= 0, f"--{flag.replace('_', '-')} must be >= 0, got {value}")
    args.train_iters = args.train_samples // G
    decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
    _check(decay > 0, "--lr-decay-samples must be positive")
    args.lr_decay_iters = decay / G
    if args.lr_warmup_samples is not None:
        args.lr_warmup_iters = args.lr_warmup_samples / G


def _check_distributed_backend(args: argparse.Namespace) -> None:
    """Megatron-LM's --distributed-backend, where it names the one backend megatron-core's
    collectives work with on this device. torch is imported (seconds) only when it is given."""
    if args.distributed_backend is None:
        return
    import torch

    if torch.cuda.is_available():
        _check(args.distributed_backend == "nccl",
               "--distributed-backend gloo: megatron-core's collectives on GPU tensors need nccl")
    else:
        _check(args.distributed_backend == "gloo",
               "--distributed-backend nccl: this machine has no GPU; gloo is the backend on CPU")


def _validate_model_flags(args: argparse.Namespace) -> None:
    """Megatron-LM's constraints on its model and memory flags."""
    if args.kv_channels is not None:
        _check(args.kv_channels > 0, f"--kv-channels must be positive, got {args.kv_channels}")
        if args.kv_channels == args.hidden_size // args.num_attention_heads:
            args.kv_channels = None  # the default, so checkpoints record one model one way
    _check(0 < args.rotary_percent <= 1, f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    _check(args.rotary_base > 0, f"--rotary-base must be positive, got {args.rotary_base}")
    if args.group_query_attention:
        _check(args.num_query_groups > 0, f"--num-query-groups must be positive, got {args.num_query_groups}")
        _check(args.num_attention_heads % args.num_query_groups == 0,
               f"--num-query-groups {args.num_query_groups} does not divide --num-attention-heads "
               f"{args.num_attention_heads}")
    else:
        args.num_query_groups = None  # one key/value head per attention head
    if args.recompute_granularity == "full":
        _check(args.recompute_method is not None, "--recompute-granularity full needs --recompute-method")
        _check(args.recompute_num_layers is not None and args.recompute_num_layers > 0,
               "--recompute-granularity full needs a positive --recompute-num-layers")
    else:
        _check(args.recompute_method is None,
               "--recompute-method needs --recompute-granularity full")
        _check(args.recompute_num_layers is None,
               "--recompute-num-layers needs --recompute-granularity full")
    _check(not args.overlap_param_gather or args.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer")
    _check(not args.overlap_param_gather or args.overlap_grad_reduce,
           "--overlap-param-gather needs --overlap-grad-reduce")


def _validate_logging(args: argparse.Namespace) -> None:
    _check(args.tensorboard_log_interval > 0,
           f"--tensorboard-log-interval must be positive, got {args.tensorboard_log_interval}")
    if args.tensorboard_dir is not None:
        _check(not Path(args.tensorboard_dir).exists() or Path(args.tensorboard_dir).is_dir(),
               f"--tensorboard-dir: {args.tensorboard_dir} is not a directory")
        _check(importlib.util.find_spec("tensorboard") is not None,
               "--tensorboard-dir: tensorboard is not installed (pip install tensorboard)")
    if args.wandb_project is not None:
        _check(importlib.util.find_spec("wandb") is not None, "--wandb-project: wandb is not installed (pip install wandb)")
        _check(bool(args.wandb_exp_name), "--wandb-project needs --wandb-exp-name")
        if args.wandb_save_dir is None and args.save is not None:
            args.wandb_save_dir = str(Path(args.save) / "wandb")
    if args.exit_signal_handler:
        # With --parcae, SIGTERM is a preemption notice: the live job moves this worker's
        # state away instead of stopping; a scheduled run cannot be resumed (--load).
        _check(not args.parcae, "--exit-signal-handler cannot be combined with --parcae, which handles SIGTERM itself")
        _check(args.save is not None, "--exit-signal-handler needs --save")


def _check_trainable(shape: ModelShape, parallelism: Parallelism, micro_batch_size: int | None = None,
                     global_batch_size: int | None = None) -> None:
    """The first of `ModelShape.problems`, in flag names."""
    problems = shape.problems(parallelism, micro_batch_size, global_batch_size, _FLAG_NAMES)
    _check(not problems, problems[0] if problems else "")


def _check_live_job(args: argparse.Namespace) -> None:
    """The flags of a worker in a job that `parcae coordinator` drives."""
    _check(args.parcae, "--parcae-etcd needs --parcae")
    _check(args.parcae_layout_schedule is None, "--parcae-etcd and --parcae-layout-schedule exclude each other")
    _check(args.parcae_job is not None, "--parcae-etcd needs --parcae-job")
    _check(args.parcae_worker_id is None or 0 <= args.parcae_worker_id < 2**31,
           f"--parcae-worker-id must be from 0 to 2^31-1, got {args.parcae_worker_id}")
    _check(args.parcae_instance is None or 0 < len(args.parcae_instance) <= 253,
           "--parcae-instance must be 1 to 253 characters")
    _check(args.parcae_failure_domain is None or 0 < len(args.parcae_failure_domain) <= 253,
           "--parcae-failure-domain must be 1 to 253 characters")
    _check(args.parcae_pool is None or 0 < len(args.parcae_pool) <= 253, "--parcae-pool must be 1 to 253 characters")
    if args.parcae_metadata_endpoint is not None:
        _check(args.parcae_notice in NOTICE_WATCHERS,
               f"--parcae-metadata-endpoint needs --parcae-notice {', '.join(list(NOTICE_WATCHERS)[:-1])} "
               f"or {list(NOTICE_WATCHERS)[-1]}")
        try:
            Endpoint(args.parcae_metadata_endpoint)
        except ValueError as exc:
            raise ArgumentError(f"--parcae-metadata-endpoint: {exc}") from None
    _check(args.parcae_grace_seconds >= 0, f"--parcae-grace-seconds must be >= 0, got {args.parcae_grace_seconds}")
    _check(args.parcae_lease_seconds > 0, f"--parcae-lease-seconds must be positive, got {args.parcae_lease_seconds}")
    _check(args.parcae_first_step_timeout > 0,
           f"--parcae-first-step-timeout must be positive, got {args.parcae_first_step_timeout}")
    _check(args.parcae_copy_interval >= 0, f"--parcae-copy-interval must be >= 0, got {args.parcae_copy_interval}")
    try:
        check_etcd_arguments(args, prefix="parcae-")
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _parse_layout_schedule(args: argparse.Namespace) -> int:
    """Check the schedule's syntax; returns the workers that start idle (they join later)."""
    from reconfig.schedule import joining_workers, parse_layout_schedule

    _check(args.parcae, "--parcae-layout-schedule needs --parcae")
    _check(args.load is None, "--parcae-layout-schedule cannot be combined with --load")
    try:
        return joining_workers(parse_layout_schedule(args.parcae_layout_schedule))
    except ValueError as exc:
        raise ArgumentError(f"--parcae-layout-schedule: {exc}") from None


def _check_layout_schedule(args: argparse.Namespace, total_workers: int, shape: ModelShape,
                           initial: Parallelism) -> None:
    """Plan every change now (vocabulary size aside), so an impossible one fails before training."""
    from reconfig.schedule import parse_layout_schedule, plan_schedule

    try:
        plan_schedule(parse_layout_schedule(args.parcae_layout_schedule), initial, total_workers, shape,
                      args.use_distributed_optimizer)
    except ValueError as exc:
        raise ArgumentError(f"--parcae-layout-schedule: {exc}") from None


def stage_layers(num_layers: int, pipeline: int, first: int | None, last: int | None) -> tuple[int, ...]:
    """Layers per pipeline stage (`partition_layers`: even, or Megatron's uneven first/last
    stages), with errors that name the flags."""
    for name, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        _check(value is None or (value > 0 and pipeline > 1), f"{name} needs a positive value and more than one stage")
    try:
        return partition_layers(num_layers, pipeline, first, last)
    except ValueError as exc:
        if first is None and last is None:
            raise ArgumentError(f"--num-layers {num_layers} is not divisible by "
                                f"--pipeline-model-parallel-size {pipeline}") from None
        raise ArgumentError(f"--num-layers {num_layers} does not fit the uneven first/last stages given: {exc}") from None


def _resolve_transformer_impl(args: argparse.Namespace) -> None:
    """`local` unless Transformer Engine is asked for: no TE layer has been taken through an
    in-place change, a snapshot or a recovery here, and TE names its parameters differently,
    so a job cannot mix the two. torch is imported (seconds) only when TE is asked for, so
    `parcae replay` parses flags without paying for torch."""
    if args.transformer_impl is None:
        args.transformer_impl = "local"
    if args.transformer_impl == "local":
        return
    _check(importlib.util.find_spec("transformer_engine") is not None,
           "--transformer-impl transformer_engine: Transformer Engine is not installed "
           "(pip install 'megatron-parcae[gpu]'), or use --transformer-impl local")
    import torch

    _check(torch.cuda.is_available(), "--transformer-impl transformer_engine needs a GPU; use --transformer-impl local")


def _validate_data(args: argparse.Namespace) -> None:
    try:
        _, validation_share, _ = parse_split(args.split)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    _check(args.eval_interval is None or args.eval_interval > 0,
           f"--eval-interval must be positive, got {args.eval_interval}")
    _check(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.eval_iters == 0:
        args.eval_interval = None
    _check(args.eval_interval is None or validation_share > 0,
           f"--eval-interval needs a validation share in --split, got {args.split}")
    _validate_tokenizer(args)
    if args.mock_data:
        _check(args.vocab_size is not None or args.vocab_file is not None
               or args.tokenizer_type == "HuggingFaceTokenizer",
               "--mock-data needs --vocab-size or a --vocab-file")
        args.data_blend = None
        return
    _check(bool(args.data_path), "--data-path is required (or --mock-data)")
    try:
        args.data_blend = parse_blend(args.data_path)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    for prefix in args.data_blend.prefixes:
        for suffix in (".bin", ".idx"):
            _check(Path(prefix + suffix).is_file(), f"--data-path: missing {prefix + suffix}")
    _check(args.tokenizer_type is not None, "--tokenizer-type is required with --data-path")
    if args.model == "bert":
        _check(args.tokenizer_type.startswith("BertWordPiece") or args.tokenizer_type == "HuggingFaceTokenizer",
               "BERT needs a BertWordPiece --tokenizer-type (or HuggingFaceTokenizer)")
    if args.tokenizer_type not in TOKENIZERS:
        return  # NullTokenizer and HuggingFaceTokenizer: _validate_tokenizer
    _check(args.vocab_file is not None and Path(args.vocab_file).is_file(),
           f"--vocab-file: missing file {args.vocab_file}")
    if args.tokenizer_type == "GPT2BPETokenizer":
        _check(args.merge_file is not None and Path(args.merge_file).is_file(),
               f"--merge-file: missing file {args.merge_file}")


def _validate_tokenizer(args: argparse.Namespace) -> None:
    """What NullTokenizer and HuggingFaceTokenizer need (the others' files are checked with
    --data-path). transformers is looked for, not imported: that takes seconds."""
    kind = args.tokenizer_type
    _check(args.tokenizer_model is None or kind == "HuggingFaceTokenizer",
           "--tokenizer-model needs --tokenizer-type HuggingFaceTokenizer")
    if kind == "NullTokenizer":
        _check(args.vocab_size is not None and args.vocab_size > 0,
               "--tokenizer-type NullTokenizer needs a positive --vocab-size")
        _check(args.model != "bert",
               "--tokenizer-type NullTokenizer: BERT needs a tokenizer with [CLS], [SEP] and [MASK] tokens")
    elif kind == "HuggingFaceTokenizer":
        _check(args.tokenizer_model is not None and Path(args.tokenizer_model).is_dir(),
               f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model, a local tokenizer folder "
               f"(got {args.tokenizer_model})")
        _check(importlib.util.find_spec("transformers") is not None,
               "--tokenizer-type HuggingFaceTokenizer: transformers is not installed (pip install transformers)")


def exit_on_argument_error(prog: str, error: ArgumentError) -> NoReturn:
    """Print one line (from one rank only) and exit 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: error: {error}", file=sys.stderr)
    sys.exit(2)
