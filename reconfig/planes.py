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

from reconfig.one_gpu import one_gpu

CONTROL = "control"
DATA = "data"
_ATTRIBUTE = "_parcae_plane"


def data_device() -> torch.device:
    """Where this process's data-plane tensors live: its GPU, or the CPU without one or
    where processes share a GPU (gloo carries host tensors; reconfig/one_gpu.py)."""
    if not torch.cuda.is_available() or one_gpu():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


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


def host_copy(tensor: torch.Tensor, into: HostArena | None = None) -> torch.Tensor:
    """An fp32 host copy of `tensor`, in pinned memory when it comes from a GPU (the copy
    back to a device is then a fast DMA), taken from `into` where given; call
    `host_copies_done` before relying on it."""
    if into is not None:
        return into.take(tensor.shape).copy_(tensor.detach(), non_blocking=tensor.device.type != "cpu")
    if tensor.device.type == "cpu":
        return tensor.detach().float().clone()
    host = torch.empty(tensor.shape, dtype=torch.float32, pin_memory=True)
    return host.copy_(tensor.detach(), non_blocking=True)


class HostArena:
    """One block of fp32 host memory handed out in pieces, in the order asked, and handed
    out again from its start after `reset`: a layout's snapshots reuse it every K steps
    instead of pinning new memory each time."""

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None
        self._used = 0
        self.allocations = 0  # blocks allocated over the arena's life

    def reset(self, elements: int) -> None:
        """Hand out `elements` from the start again; a new block only if the size differs."""
        if self._block is None or self._block.numel() != elements:
            self._block = None
            self._block = host_buffer(elements)
            self.allocations += 1
        self._used = 0

    def take(self, shape: Sequence[int] | torch.Size) -> torch.Tensor:
        elements = int(torch.Size(shape).numel())
        if self._block is None or self._used + elements > self._block.numel():
            raise RuntimeError(f"host arena of {0 if self._block is None else self._block.numel()} elements "
                               f"has no room for {elements} more")
        piece = self._block[self._used: self._used + elements].view(shape)
        self._used += elements
        return piece

    def used(self) -> torch.Tensor:
        """The pieces handed out since `reset`, as one flat tensor."""
        assert self._block is not None
        return self._block[: self._used]

    @property
    def nbytes(self) -> int:
        return 0 if self._block is None else self._block.numel() * 4


def host_copies_done() -> None:
    """Wait for the GPU to finish the `host_copy`s issued so far."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def control_barrier() -> None:
    """A barrier over WORLD on the control plane (dist.barrier picks the GPU where NCCL is one
    of WORLD's backends)."""
    dist.all_reduce(control_tensor([0]))


def as_data_plane(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, already on the data plane's device (a view of a staging buffer, or of
    host memory where the data plane is the CPU), marked as a data-plane tensor."""
    return _mark(tensor, DATA)


def host_buffer(elements: int) -> torch.Tensor:
    """An fp32 host tensor to stage transfers in: pinned where a GPU copies into it. Its
    owner keeps it to reuse it (torch's pinned allocator rounds up and keeps blocks)."""
    return torch.empty(elements, dtype=torch.float32, pin_memory=torch.cuda.is_available())
