"""Several processes on one GPU (PARCAE_ONE_GPU=1): multi-process layout changes with
CUDA models on a machine that has a single GPU.

NCCL refuses two ranks on one GPU, so in this mode every plane is gloo
(`reconfig.world.process_group_backend`), the data plane lives in host memory
(`reconfig.planes.data_device`), and each process takes GPU LOCAL_RANK modulo the GPUs
there are. gloo carries few collectives of CUDA tensors (none coalesced, no
reduce-scatter), so megatron-core's own on device tensors (DDP's gradient reduction, the
distributed optimizer's gathers, the gradient norm) run one at a time on host copies
(`route_collectives_through_host`). Pipeline stages exchange activations with
point-to-point sends of device tensors, which gloo does not carry: P = 1 only. The mode
is for checking changes on one GPU, not for speed.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist

from reconfig import compat

ENV = "PARCAE_ONE_GPU"


def one_gpu() -> bool:
    """Whether this process shares its GPU with the job's other processes."""
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 1 (several processes share one GPU) or 0, not {value!r}")
    return value == "1"


# torch.distributed's collectives that megatron-core (its DDP, optimizers and dist
# checkpointing) calls on device tensors.
_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "all_gather_into_tensor",
                "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base", "all_to_all_single")
# The device types whose tensors go through the host (a test names "cpu" to see the path).
STAGED_DEVICE_TYPES = ("cuda",)


class _Done:
    """The handle of a collective that has already run (megatron-core may wait on it)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _tensors(value) -> list:
    if torch.is_tensor(value):
        return [value]
    return [t for t in value if torch.is_tensor(t)] if isinstance(value, (list, tuple)) else []


def _to_host(value):
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    return [_to_host(t) for t in value] if isinstance(value, (list, tuple)) else value


def _through_host(collective):
    @functools.wraps(collective)
    def staged(*args, **kwargs):
        values = [*args, *kwargs.values()]
        if not any(t.device.type in STAGED_DEVICE_TYPES for v in values for t in _tensors(v)):
            return collective(*args, **kwargs)
        async_op = kwargs.pop("async_op", False)
        host_args, host_kwargs = [_to_host(a) for a in args], {k: _to_host(v) for k, v in kwargs.items()}
        collective(*host_args, **host_kwargs, async_op=False)
        # Every tensor back, outputs last: an input can be a view into the output (a
        # reduce-scatter's shard of its buffer, a gather's of the gathered one).
        pairs = [*zip(args, host_args), *((kwargs[k], host_kwargs[k]) for k in kwargs)]
        for device_value, host_value in reversed(pairs):
            for device_tensor, host_tensor in zip(_tensors(device_value), _tensors(host_value)):
                device_tensor.copy_(host_tensor)
        return _Done() if async_op else None

    staged.through_host = True
    return staged


@contextlib.contextmanager
def _one_at_a_time(group=None, device=None, async_ops=False):
    """megatron-core's coalescing of a bucket group's collectives, with each run as issued."""
    yield _Done()


def _routed(collective):
    return collective if getattr(collective, "through_host", False) else _through_host(collective)


def route_collectives_through_host() -> None:
    """Run megatron-core's collectives on device tensors on host copies, one at a time:
    gloo's are what this mode has. Idempotent; call before the model is built."""
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _routed(getattr(dist, name)))
    compat.route_bucket_collectives(_routed, _one_at_a_time)
