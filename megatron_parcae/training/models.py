"""megatron-core GPT and BERT model chunks for the current parallel state.

Builds the TransformerConfig from Megatron-LM flags, the model chunk of this rank's
pipeline stage (local spec on CPU, Transformer Engine spec on request), deterministic
initial weights, and the Float16/DDP wrappers, in the order megatron-core needs.
"""

from __future__ import annotations

import argparse
import importlib.util
import math

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from reconfig.tensors import initialize_deterministically


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """The vocabulary padded to a multiple of make-vocab-size-divisible-by x lcm(T, 8).

    Megatron pads to a multiple of divisible-by x T, which makes the model's shape depend
    on the layout; with lcm(T, 8) every T in 1, 2, 4, 8 gives the same model, so a job
    can change T without changing what it trains.
    """
    multiple = args.make_vocab_size_divisible_by * math.lcm(args.tensor_model_parallel_size, 8)
    return int(math.ceil(vocab_size / multiple) * multiple)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    P = args.pipeline_model_parallel_size
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,  # None: hidden size / heads
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=P,
        num_layers_in_first_pipeline_stage=args.stage_layers[0] if P > 1 and args.decoder_first_pipeline_num_layers else None,
        num_layers_in_last_pipeline_stage=args.stage_layers[-1] if P > 1 and args.decoder_last_pipeline_num_layers else None,
        # Megatron-LM turns sequence parallelism off at T = 1; here it follows T through changes.
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        num_query_groups=args.num_query_groups,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        # Fused kernels and CUDA-side initialisation exist only on GPUs.
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False,
        # Megatron-LM's own softmax kernel and apex's persistent LayerNorm, where installed
        # (megatron-core asserts rather than falls back when they are asked for and absent).
        masked_softmax_fusion=(not args.no_masked_softmax_fusion and on_gpu
                               and _installed("scaled_masked_softmax_cuda")),
        bias_dropout_fusion=on_gpu,
        bias_activation_fusion=on_gpu,
        persist_layer_norm=on_gpu and _installed("apex"),
        apply_rope_fusion=False,
        # Transformer Engine's attention picks its backend itself unless told (arguments.py
        # allows --use-flash-attn with Transformer Engine's layers only).
        attention_backend=AttnBackend.flash if args.use_flash_attn else AttnBackend.auto,
        # As Megatron-LM: a stage frees its output once sent, and backward runs on autograd's
        # engine directly (which also keeps CPU support's device mapping on in recomputation
        # and sequence-parallel backward).
        deallocate_pipeline_outputs=True,
    )


class SequenceParallelTorchNorm:
    """torch's LayerNorm or RMSNorm with its parameters marked sequence-parallel, so that
    megatron-core all-reduces their gradients over the TP group. The local spec's torch
    norm refuses sequence parallelism for want of that mark; Apex and Transformer Engine
    norms set it themselves."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        kind = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = kind(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def _layer_spec(args: argparse.Namespace, config: TransformerConfig):
    te = args.transformer_impl == "transformer_engine"
    if args.model == "gpt":
        from megatron.core.models.gpt import gpt_layer_specs as specs

        if te:
            return specs.get_gpt_layer_with_transformer_engine_spec()
        spec = specs.get_gpt_layer_local_spec(normalization=args.normalization)
        if not (config.sequence_parallel and not _installed("apex")):
            return spec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
        return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                          layer_norm=SequenceParallelTorchNorm)
    from megatron.core.models.bert import bert_layer_specs as specs

    return specs.get_bert_layer_with_transformer_engine_spec() if te else specs.bert_layer_local_spec


def build_model_chunk(args: argparse.Namespace, config: TransformerConfig, vocab_size: int) -> torch.nn.Module:
    """This rank's stage of the model, with layout-independent initial weights."""
    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    common = dict(
        config=config,
        transformer_layer_spec=_layer_spec(args, config),
        vocab_size=vocab_size,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    if args.model == "gpt":
        from megatron.core.models.gpt import GPTModel

        chunk = GPTModel(max_sequence_length=args.max_position_embeddings, rotary_percent=args.rotary_percent,
                         rotary_base=args.rotary_base, **common)
    else:
        from megatron.core.models.bert.bert_model import BertModel

        chunk = BertModel(num_tokentypes=0 if args.bert_no_binary_head else 2,
                          max_sequence_length=args.max_position_embeddings,
                          add_binary_head=not args.bert_no_binary_head, **common)
    if torch.cuda.is_available():
        chunk.cuda(torch.cuda.current_device())
    initialize_deterministically(chunk, args.seed, args.init_method_std, args.num_layers,
                                 ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    return chunk


def wrap_for_training(chunk: torch.nn.Module, config: TransformerConfig,
                      args: argparse.Namespace) -> DistributedDataParallel:
    """Float16Module (bf16/fp16) then megatron-core DDP, as Megatron-LM wraps models."""
    if config.bf16 or config.fp16:
        chunk = Float16Module(config, chunk)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
