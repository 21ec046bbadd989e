"""A layer profile from the model's shape and three measured device rates: the prior a
job starts with when nobody has timed its layers (`parcae profile --analytic`).

Each unit's forward time is its matmul FLOPs at the device's measured matmul rate plus
its elementwise traffic (layernorms, softmax, activations, residuals) at the measured
memory bandwidth; backward takes twice the forward (two matmuls per forward one); the
optimizer step streams every parameter's state once. Activation bytes follow the
per-layer estimate of Korthikanti et al. ("Reducing Activation Recomputation in Large
Transformer Models", 2022): s*b*(17h + 2.5*a*s) values, scaled by the bytes of a value.
The result has the format `PipelineModel` reads (liveput/throughput.py), so a measured
profile and this one are interchangeable; the coordinator corrects either from the step
times the workers report (liveput/learned.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_parcae.liveput.throughput import PROFILE_FORMAT, PROFILE_VERSION
from reconfig.layout import ModelShape

GRADIENT_BYTES_PER_PARAM = 4  # megatron DDP reduces gradients in fp32 here


@dataclass(frozen=True)
class DeviceRates:
    """What one worker's device does per second, measured at the model's own shapes."""

    name: str
    matmul_flops_per_second: float
    memory_bytes_per_second: float
    memory_bytes: float  # usable device memory

    def __post_init__(self) -> None:
        for field in ("matmul_flops_per_second", "memory_bytes_per_second", "memory_bytes"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field}: expected a positive number, got {getattr(self, field)!r}")


def layer_matmul_flops(shape: ModelShape, tokens: int, seq_length: int) -> float:
    """Forward FLOPs of one transformer layer on `tokens` tokens (QKV, attention scores and
    context, projection, two MLP matmuls)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return 2.0 * tokens * (4 * h * h + 2 * h * f) + 4.0 * tokens * seq_length * h


def _unit(forward_flops: float, forward_bytes: float, params: float, activation_bytes: float,
          output_bytes: float, device: DeviceRates, state_bytes_per_param: float) -> dict[str, float]:
    forward_s = forward_flops / device.matmul_flops_per_second + forward_bytes / device.memory_bytes_per_second
    # Adam reads and writes every state byte of a parameter and reads its gradient.
    optimizer_s = params * (2 * state_bytes_per_param + GRADIENT_BYTES_PER_PARAM) / device.memory_bytes_per_second
    return {"forward_ms": 1000 * forward_s, "backward_ms": 2000 * forward_s, "optimizer_ms": 1000 * optimizer_s,
            "activation_bytes": activation_bytes, "output_bytes": output_bytes}


def analytic_profile(shape: ModelShape, *, model: str, micro_batch_size: int, global_batch_size: int,
                     seq_length: int, value_bytes: int, device: DeviceRates, link_bytes_per_second: float,
                     tensor_parallel_bytes_per_second: float, max_tensor_parallel: int) -> dict[str, Any]:
    """The layer profile (PipelineModel's format) of `shape` on `device`; `value_bytes`
    is the size of an activation value (2 in bf16/fp16, 4 in fp32)."""
    b, s = micro_batch_size, seq_length
    tokens = b * s
    h, a, v = shape.hidden_size, shape.num_attention_heads, shape.vocab_size
    f = shape.ffn_hidden_size
    state = shape.state_bytes_per_param
    hidden_bytes = tokens * h * value_bytes
    units = {u.name: u.params for u in shape.units()}
    # Elementwise traffic: two layernorms, two residuals, bias adds, the MLP activation
    # over f, and softmax with its mask over the a x s x s scores, each read and written.
    layer_bytes = 2 * value_bytes * (tokens * (10 * h + 2 * f) + 3 * b * a * s * s)
    layer_activation = value_bytes * tokens * (17 * h + 2.5 * a * s)
    layer = _unit(layer_matmul_flops(shape, tokens, s), layer_bytes, units["layer.0"], layer_activation,
                  hidden_bytes, device, state)
    embedding_params = sum(p for name, p in units.items() if name.startswith("embedding"))
    embedding = _unit(0.0, 3 * hidden_bytes, embedding_params, tokens * 8, hidden_bytes, device, state)
    # The output layer's matmul and the cross-entropy over the vocabulary's logits.
    logits_bytes = tokens * v * value_bytes
    head = _unit(2.0 * tokens * h * v, 4 * logits_bytes + 2 * hidden_bytes, units.get("head", 0), logits_bytes,
                 0.0, device, state)
    return {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION,
        "model": model, "device": f"{device.name} (analytic)",
        "micro_batch_size": micro_batch_size, "global_batch_size": global_batch_size,
        "gpu_memory_bytes": device.memory_bytes,
        "link_bytes_per_second": link_bytes_per_second,
        "tensor_parallel_bytes_per_second": tensor_parallel_bytes_per_second,
        "max_tensor_parallel": max_tensor_parallel,
        "memory_bytes_per_param": state + GRADIENT_BYTES_PER_PARAM,
        "gradient_bytes_per_param": GRADIENT_BYTES_PER_PARAM,
        "model_shape": shape.to_dict(),
        "embedding": embedding, "layers": [dict(layer) for _ in range(shape.num_layers)], "head": head,
    }
