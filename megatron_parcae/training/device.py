"""The process's device and its torch.distributed set-up."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_parcae.training.cpu import enable_cpu_support
from reconfig.world import process_group_backend

# Healthy collectives that can outlast the short timeout of a live job's collectives:
# a synchronous save's, and the first one of a group on NCCL (its communicator forms then).
SAVE_TIMEOUT = timedelta(minutes=30)
SETUP_TIMEOUT = timedelta(minutes=10)


def prepare_device() -> None:
    """The GPU of LOCAL_RANK, or megatron-core's CPU support when there is none.

    On GPUs a failed or timed-out NCCL collective aborts its communicators and raises in
    the training thread (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) instead of ending the process
    (torch's default), so a survivor keeps its state and recovers as on CPU; a value the
    user set is kept."""
    if torch.cuda.is_available():
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
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
    """How long a collective waits for a peer before the peer counts as failed: one lease
    period in a job that `parcae coordinator` drives (a process silent that long is lost
    anyway), megatron-core's default of 30 minutes otherwise."""
    if getattr(args, "parcae_etcd", None):
        return timedelta(seconds=args.parcae_lease_seconds)
    return timedelta(minutes=30)
