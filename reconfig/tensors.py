"""Layout-independent names and tensor-parallel slices of a megatron-core model's parameters.

A parameter's local name (`decoder.layers.0.mlp.linear_fc1.weight` on stage 3) depends on
the layout; its global name (`decoder.layers.12.mlp.linear_fc1.weight`) does not. With the
global name and the full (un-split) tensor, any layout's local shard can be cut out, which
is what deterministic initialisation, checkpoints and state migration all need.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch

_LOCAL_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.")  # GPT's block is the decoder, BERT's the encoder
TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class ParamShard:
    """Where one local parameter sits in the full model."""

    global_name: str
    param: torch.nn.Parameter
    partition_dim: int | None  # None: every TP rank holds the whole tensor
    partition_stride: int

    def full_shape(self, tp_size: int) -> tuple[int, ...]:
        shape = list(self.param.shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= tp_size
        return tuple(shape)

    def cut(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This shard's part of a full tensor (Megatron's strided split for stride > 1)."""
        if self.partition_dim is None or tp_size == 1:
            return full
        stride = self.partition_stride
        chunks = torch.chunk(full, tp_size * stride, dim=self.partition_dim)
        return torch.cat(chunks[tp_rank::tp_size], dim=self.partition_dim)


def transformer_layers(chunk: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer layers of a GPT (decoder) or BERT (encoder) chunk."""
    block = getattr(chunk, "decoder", None) or getattr(chunk, "encoder", None)
    return getattr(block, "layers", None) or torch.nn.ModuleList()


def _layer_numbers(chunk: torch.nn.Module) -> list[int]:
    return [layer.layer_number - 1 for layer in transformer_layers(chunk)]


def param_shards(chunk: torch.nn.Module) -> Iterator[ParamShard]:
    """Every parameter of one model chunk (unwrapped) with its global name."""
    global_layers = _layer_numbers(chunk)
    tied = bool(getattr(chunk, "share_embeddings_and_output_weights", False))
    for local_name, param in chunk.named_parameters():
        name = _LOCAL_LAYER.sub(lambda m: f"{m.group(1)}.layers.{global_layers[int(m.group(2))]}.", local_name)
        if tied and name == TIED_OUTPUT:
            name = WORD_EMBEDDING  # the last stage's copy of the tied word embedding
        split = bool(getattr(param, "tensor_model_parallel", False))
        yield ParamShard(
            global_name=name,
            param=param,
            partition_dim=getattr(param, "partition_dim", None) if split else None,
            partition_stride=getattr(param, "partition_stride", 1) if split else 1,
        )


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def name_seed(seed: int, global_name: str) -> int:
    """A seed per (run seed, parameter), so initial values do not depend on the layout."""
    return (seed * 1_000_003 + zlib.crc32(global_name.encode())) % (2**63)


def initialize_deterministically(chunk: torch.nn.Module, seed: int, std: float, num_layers: int,
                                 tp_rank: int, tp_size: int) -> None:
    """Re-draw every weight matrix from (seed, global name), then keep this rank's shard.

    Megatron seeds its generators per pipeline and tensor rank, so the same --seed gives
    a different model under another layout. Vectors (norms, biases) are constants in
    megatron-core's initialisation and are left as built. Output projections use the
    scaled std of Megatron's output-layer init.
    """
    scaled = std / (2.0 * num_layers) ** 0.5
    with torch.no_grad():
        for shard in param_shards(chunk):
            if shard.param.dim() < 2:
                continue
            name = shard.global_name
            sigma = scaled if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            gen = torch.Generator().manual_seed(name_seed(seed, name))
            full = torch.empty(shard.full_shape(tp_size), dtype=torch.float32).normal_(0.0, sigma, generator=gen)
            shard.param.copy_(shard.cut(full, tp_rank, tp_size))
