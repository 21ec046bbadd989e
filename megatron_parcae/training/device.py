"""The process's device and its torch.distributed set-up."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_parcae.training.cpu import enable_cpu_support
from reconfig.one_gpu import one_gpu, route_collectives_through_host
from reconfig.world import process_group_backend

# Healthy collectives that can outlast the short timeout of a live job's collectives:
# a synchronous save's, and the first one of a group on NCCL (its communicator forms then).
SAVE_TIMEOUT = timedelta(minutes=30)
SETUP_TIMEOUT = timedelta(minutes=10)


def prepare_device() -> None:
    """The GPU of LOCAL_RANK (modulo the GPUs there are where processes share them,
    reconfig/one_gpu.py, whose collectives then go through the host), or megatron-core's
    CPU support when there is none.

    On GPUs a failed or timed-out NCCL collective aborts its communicators and raises in
    the training thread (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) instead of ending the process
    (torch's default), so a survivor keeps its state and recovers as on CPU; communicators
    form without blocking (TORCH_NCCL_USE_COMM_NONBLOCKING), so that forming one with a
    peer that died can be aborted and gives up after SETUP_TIMEOUT. A value the user set
    is kept."""
    if torch.cuda.is_available():
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        os.environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(SETUP_TIMEOUT.total_seconds())))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count() if one_gpu() else local_rank)
        if one_gpu():
            route_collectives_through_host()
    else:
        enable_cpu_support()


def initialize_distributed() -> None:
    """torch.distributed from torchrun's environment (a single process runs without torchrun)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    prepare_device()
    dist.init_process_group(process_group_backend(), timeout=timedelta(minutes=10))


def collective_timeout(args: argparse.Namespace) -> timedelta:
    """How long a collective of a running layout's step waits for a peer before the peer
    counts as failed: one lease period in a job that `parcae coordinator` drives (a
    process silent that long is lost anyway), megatron-core's default of 30 minutes
    otherwise. What waits longer says so (reconfig/timeouts.py)."""
    if getattr(args, "parcae_etcd", None):
        return timedelta(seconds=args.parcae_lease_seconds)
    return timedelta(minutes=30)


def first_step_timeout(args: argparse.Namespace) -> timedelta:
    """How long a collective of a layout's first step (and its first snapshot) waits:
    --parcae-first-step-timeout, never less than a step's."""
    return max(collective_timeout(args), timedelta(seconds=args.parcae_first_step_timeout))
