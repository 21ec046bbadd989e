"""A plain megatron-core program, as a Megatron user has one: a GPTModel at T1P1 built
with megatron-core's own API, whose checkpoints go through `model.sharded_state_dict()`
and `dist_checkpointing`. The checkpoint tests run it beside the project's training.

    plain_megatron.py load DIR --batch-at N -- TRAINING FLAGS
    plain_megatron.py save DIR --batch-at N -- TRAINING FLAGS

`load` reads the checkpoint folder DIR into the model, `save` writes the model's own
initial weights there; both then print, as JSON, the model's lm loss on the global batch
a training run with TRAINING FLAGS reads after N samples: the mean over its
micro-batches of the masked token mean, as the training loop logs it. Only the model's
shape and the batch are taken from the flags (and megatron-core's CPU support from the
project, which megatron-core needs on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_parcae.training.arguments import parse_args
from megatron_parcae.training.data.datasets import build_datasets, build_tokenizer, collate
from megatron_parcae.training.device import prepare_device
from megatron_parcae.training.models import padded_vocab_size


def plain_model(args: argparse.Namespace, vocab_size: int) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, hidden_dropout=0.0, attention_dropout=0.0,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, bias_activation_fusion=False, persist_layer_norm=False)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def batch_loss(model: GPTModel, args: argparse.Namespace, consumed: int) -> float:
    dataset, _ = build_datasets(args, build_tokenizer(args))
    losses = []
    model.eval()
    with torch.no_grad():
        for start in range(consumed, consumed + args.global_batch_size, args.micro_batch_size):
            batch = collate([dataset[i] for i in range(start, start + args.micro_batch_size)])
            s = batch["tokens"].shape[1]
            causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
            per_token = model(batch["tokens"], batch["position_ids"], causal, labels=batch["labels"])
            mask = batch["loss_mask"].float()
            losses.append(float((per_token.float() * mask).sum() / mask.sum()))
    return sum(losses) / len(losses)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("load", "save"))
    parser.add_argument("directory")
    parser.add_argument("--batch-at", type=int, required=True)
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    cli, flags = parser.parse_args(sys.argv[1:split]), sys.argv[split + 1:]
    args = parse_args(flags, prog="plain_megatron", model="gpt", world_size=1)
    prepare_device()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(args.seed)
    model = plain_model(args, padded_vocab_size(build_tokenizer(args).vocab_size, args))
    if cli.command == "load":
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), cli.directory))
    else:
        Path(cli.directory).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), cli.directory)
    print(json.dumps({"loss": batch_loss(model, args, cli.batch_at)}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
