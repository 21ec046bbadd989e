"""Take a layout's megatron-core objects apart, so that reference counting frees them as
soon as the layout is dropped.

megatron-core and torch tie a layout's objects into reference cycles, which only
Python's cyclic collector frees: at a time nobody chooses, and a full collection over a
large model takes seconds. Until then the old layout's parameters, gradient buffers and
optimizer state stay on the device beside the new layout's. The cycles of megatron-core
0.16 on the local and Transformer Engine specs:

- the TransformerConfig, which every module holds, points at the DDP wrapper and the
  optimizer through the pipeline schedule's hooks (`no_sync_func`, `grad_scale_func`);
- DDP keeps each parameter's gradient accumulator alive, and the accumulator's hook
  closes over DDP;
- module hooks close over what holds them: DDP's forward pre-hooks (overlapped parameter
  gathers), megatron-core's state-dict hooks (bound methods of the module).

RoPE's `lru_cache` on `forward` is no cycle, but it keeps the rotary module (its `self`
is part of the key) and its tables alive from a class attribute.
"""

from __future__ import annotations

import sys

import torch

# TransformerConfig attributes the training step points at one layout's DDP and optimizer.
_SCHEDULE_HOOKS = ("no_sync_func", "grad_sync_func", "param_sync_func", "grad_scale_func",
                   "finalize_model_grads_func")
# (module, class) whose `forward` is an lru_cache keyed by the module instance.
_CACHED_FORWARDS = (
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "MultimodalRotaryEmbedding"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding"),
)


def take_apart(config, model_chunks: list[torch.nn.Module]) -> None:
    """Cut the reference cycles of a layout that is being dropped; its objects are unusable after."""
    for name in _SCHEDULE_HOOKS:
        if getattr(config, name, None) is not None:
            setattr(config, name, None)
    for chunk in model_chunks:
        accumulators = getattr(chunk, "grad_accs", None)  # megatron-core DDP's
        if isinstance(accumulators, list):
            accumulators.clear()
        for module in chunk.modules():
            for name, hooks in vars(module).items():
                if name.endswith("hooks") and isinstance(hooks, dict):
                    hooks.clear()
    clear_cached_forwards()


def clear_cached_forwards() -> None:
    """Empty the module-keyed caches of the megatron-core versions that have them (a
    module not imported yet has nothing cached)."""
    for module_name, class_name in _CACHED_FORWARDS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        cache_clear = getattr(getattr(cls, "forward", None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
