"""Model FLOPs of one training step, counted from the model's shape, for the TFLOP/s per
GPU that Megatron-LM's `--log-throughput` prints.

Matrix multiplications only (2 FLOPs per multiply-add), the backward pass twice the
forward, no activation recomputation, the full s x s attention matrix: what Megatron-LM
counts for a dense model without grouped-query attention or gated linear units.
"""

from __future__ import annotations


def model_flops_per_step(model: str, num_layers: int, hidden_size: int, ffn_hidden_size: int, seq_length: int,
                         vocab_size: int, global_batch_size: int, binary_head: bool = False) -> float:
    """FLOPs of forward and backward over one global batch of `model` ("gpt" or "bert")."""
    h, f, s = hidden_size, ffn_hidden_size, seq_length
    attention = 2 * h * 3 * h + 2 * s * h + 2 * s * h + 2 * h * h  # QKV, scores, scores x V, projection
    mlp = 2 * h * f + 2 * f * h
    per_token = num_layers * (attention + mlp) + 2 * h * vocab_size  # logits
    per_sequence = 0
    if model == "bert":
        per_token += 2 * h * h  # the LM head's transform before the logits
        if binary_head:
            per_sequence = 2 * h * h + 2 * h * 2  # pooler and the two-way classifier
    elif model != "gpt":
        raise ValueError(f"model must be gpt or bert, got {model!r}")
    return 3.0 * global_batch_size * (s * per_token + per_sequence)
