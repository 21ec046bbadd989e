"""Several processes on one GPU (PARCAE_ONE_GPU=1, reconfig/one_gpu.py): the
choices that make it work, checked on CPU with CUDA's answers stood in for. The mode
itself runs on a GPU in scripts/gpu_check.sh (c)."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import SMALL_GPT, losses, torchrun, with_hooks

from megatron_parcae.training import device
from reconfig import planes
from reconfig.one_gpu import ENV, one_gpu
from reconfig.world import process_group_backend


@pytest.fixture
def a_gpu(monkeypatch):
    """torch answering as on a machine with one GPU, its chosen device recorded."""
    chosen = []
    monkeypatch.setattr(os, "environ", {**os.environ})  # prepare_device's NCCL settings stay here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_sharing_puts_every_plane_on_gloo_and_the_data_plane_in_host_memory(a_gpu, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert process_group_backend() == "gloo"
    assert planes.data_device() == torch.device("cpu")
    received, moved = planes.data_buffer(4, torch.float32), planes.on_data_plane(torch.ones(3))
    assert received.device.type == moved.device.type == "cpu"
    assert planes.plane_of(received) == planes.plane_of(moved) == planes.DATA


@pytest.mark.parametrize("value", ["", "0"])
def test_without_sharing_a_gpu_keeps_nccl_and_its_device(a_gpu, monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    assert process_group_backend() == "cpu:gloo,cuda:nccl"
    assert planes.data_device() == torch.device("cuda", 0)


def test_processes_sharing_take_the_gpus_there_are(a_gpu, monkeypatch):
    routed = []
    monkeypatch.setattr(device, "route_collectives_through_host", lambda: routed.append(True))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv(ENV, "1")
    device.prepare_device()
    monkeypatch.setenv(ENV, "0")
    device.prepare_device()
    assert a_gpu == [0, 3]  # shared: GPU 3 mod 1; not shared: LOCAL_RANK's own
    assert routed == [True]  # gloo's collectives of device tensors through the host, when shared


def test_on_cpu_the_mode_changes_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for value in ("", "1"):
        monkeypatch.setenv(ENV, value)
        assert process_group_backend() == "gloo" and planes.data_device() == torch.device("cpu")


def test_a_value_other_than_0_or_1_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match="PARCAE_ONE_GPU must be 1"):
        one_gpu()


@pytest.mark.slow
def test_collectives_through_the_host_train_as_direct_ones(tiny_data, tmp_path, monkeypatch):
    """megatron-core's collectives on host copies, one at a time (what the mode does with
    CUDA tensors, here with CPU ones: tests/hooks/through_host.py), through the
    distributed optimizer's reduce-scatter and gather and a change: the losses of direct
    collectives."""
    flags = SMALL_GPT + ["--use-distributed-optimizer", "--train-iters", "6", "--parcae",
                         "--parcae-layout-schedule", "3:1,1,2"]
    direct = losses(torchrun("pretrain_gpt.py", 2, flags))
    with_hooks(monkeypatch, "through_host", PARCAE_TEST_ROUTED=str(tmp_path))
    routed = losses(torchrun("pretrain_gpt.py", 2, flags))
    assert routed == direct
    counts = {p.name: int(p.read_text()) for p in tmp_path.glob("rank-*")}
    assert sorted(counts) == ["rank-0", "rank-1"] and min(counts.values()) > 0, counts
