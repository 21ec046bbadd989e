"""Several processes on one GPU (PARCAE_ONE_GPU=1): multi-process layout changes with
CUDA models on a machine that has a single GPU.

NCCL refuses two ranks on one GPU, so in this mode every plane is gloo
(`reconfig.world.process_group_backend`), the data plane lives in host memory
(`reconfig.planes.data_device`), and each process takes GPU LOCAL_RANK modulo the GPUs
there are. megatron-core's own collectives on device tensors (DDP's gradient all-reduce)
go through gloo's copies to the host. Pipeline stages exchange activations with
point-to-point sends of device tensors, which gloo does not carry: P = 1 only. The mode
is for checking changes on one GPU, not for speed.
"""

from __future__ import annotations

import os

ENV = "PARCAE_ONE_GPU"


def one_gpu() -> bool:
    """Whether this process shares its GPU with the job's other processes."""
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 1 (several processes share one GPU) or 0, not {value!r}")
    return value == "1"
