"""The device of every tensor this project hands to a collective, stated in one place.

WORLD has two planes (`reconfig.world.process_group_backend`). The control plane carries
small collectives (plan agreement, progress, sizes and headers of transfers, logged
losses, checkpoint polls) as CPU tensors over gloo, so that timeouts and failure
detection behave alike on CPU and GPU. The data plane carries parameters, gradients and
optimizer state as tensors on the rank's device: NCCL on GPUs, gloo on CPU.

Every tensor the project passes to a collective is made or placed here, and carries its
plane, so a check can find a collective whose tensor bypassed this module: on CPU both
planes are CPU tensors and a misplaced one would otherwise pass unnoticed until a GPU
run. `tests/collective_probe.py` is that check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

CONTROL = "control"
DATA = "data"
_ATTRIBUTE = "_parcae_plane"


def data_device() -> torch.device:
    """Where this process's data-plane tensors live: its GPU, or the CPU without one."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _mark(tensor: torch.Tensor, plane: str) -> torch.Tensor:
    setattr(tensor, _ATTRIBUTE, plane)
    return tensor


def plane_of(tensor: torch.Tensor) -> str | None:
    """CONTROL or DATA for a tensor made here; None for one made elsewhere."""
    return getattr(tensor, _ATTRIBUTE, None)


def control_tensor(values: Sequence[int | float], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A control-plane tensor holding `values`."""
    return _mark(torch.tensor(list(values), dtype=dtype), CONTROL)


def control_buffer(size: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty control-plane tensor to receive into."""
    return _mark(torch.empty(size, dtype=dtype), CONTROL)


def control_bytes(data: bytes) -> torch.Tensor:
    """`data` as a control-plane uint8 tensor (a transfer's JSON header)."""
    return _mark(torch.frombuffer(bytearray(data), dtype=torch.uint8), CONTROL)


def data_buffer(size: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed data-plane tensor (to receive into, or to sum disjoint parts in)."""
    return _mark(torch.zeros(size, dtype=dtype, device=data_device()), DATA)


def on_data_plane(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the data plane's device (no copy where it is there already)."""
    return _mark(tensor.to(data_device()), DATA)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """An fp32 host copy of `tensor`, in pinned memory when it comes from a GPU (the copy
    back to a device is then a fast DMA); call `host_copies_done` before relying on it."""
    if tensor.device.type == "cpu":
        return tensor.detach().float().clone()
    host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=True)
    return host.copy_(tensor.detach(), non_blocking=True)


def host_copies_done() -> None:
    """Wait for the GPU to finish the `host_copy`s issued so far."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def control_barrier() -> None:
    """A barrier over WORLD on the control plane (dist.barrier picks the GPU where NCCL is one
    of WORLD's backends)."""
    dist.all_reduce(control_tensor([0]))
