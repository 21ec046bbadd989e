"""Every private torch / megatron-core reach (reconfig/compat.py) against the installed
versions: an upgrade that renames or drops one fails here, by name, not mid-training."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import random as mcore_random

from helpers import REPO
from reconfig import compat, world


@pytest.fixture
def fresh_checks():
    """Forget remembered successes, before and after, so a test's changes cannot leak."""
    compat._verify.cache_clear()
    yield
    compat._verify.cache_clear()


@pytest.mark.parametrize("reach", compat.REACHES, ids=lambda r: r.name)
def test_every_reach_exists_in_the_installed_versions(reach):
    reach.check()


def test_an_unverified_version_is_refused_by_name(monkeypatch, fresh_checks):
    monkeypatch.setitem(compat.SUPPORTED, "torch", ((1, 0), (1, 13)))
    installed = compat.installed_version("torch")
    with pytest.raises(compat.CompatError, match=r"_world\.pg_map .*torch 1\.0 to 1\.13.*torch " + re.escape(installed)):
        compat.process_group_map()


def test_a_missing_attribute_is_refused_and_never_created(fresh_checks):
    renamed = compat.Reach("megatron-core", "megatron.core.tensor_parallel.random", "_RENAMED_TRACKER")
    with pytest.raises(compat.CompatError, match=r"random\._RENAMED_TRACKER does not exist in megatron-core 0\.16"):
        renamed.set(object())
    assert not hasattr(mcore_random, "_RENAMED_TRACKER")


def test_parallel_state_reset_restores_its_import_time_values():
    """reset_parallel_state sets every global to None or {}: that must be what a fresh
    import of parallel_state holds, or the reset would invent state."""
    spec = importlib.util.spec_from_file_location(ps.__name__, ps.__file__)
    fresh = importlib.util.module_from_spec(spec)  # not registered: the real module is untouched
    spec.loader.exec_module(fresh)
    state = {name: value for name, value in vars(fresh).items() if compat._PARALLEL_STATE_GLOBAL.match(name)}
    assert {reach.path for reach in compat.PARALLEL_STATE_GLOBALS} <= state.keys()
    assert all(value is None or value == {} for value in state.values())


def test_world_and_megatron_groups_are_released_in_process():
    """One gloo rank on an in-memory store: megatron-core's groups are found, destroyed
    and its globals reset; WORLD's store and torch's group count stay reachable."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        compat.default_store().set("k", b"v")
        assert compat.default_store().get("k") == b"v"
        ps.initialize_model_parallel()
        assert compat.megatron_process_groups() and len(compat.process_group_map()) > 1
        world.release_parallel_state()
        assert len(compat.process_group_map()) == 1  # WORLD alone
        assert ps._DATA_PARALLEL_GROUP is None and ps._PIPELINE_GLOBAL_RANKS is None
    finally:
        dist.destroy_process_group()
    compat.GROUP_COUNT.set(5)
    compat.reset_group_count()
    assert compat.GROUP_COUNT.get() == 0


def test_the_rng_tracker_is_the_one_megatron_returns():
    saved = compat.RNG_TRACKER.get(), compat.RNG_TRACKER_INITIALIZED.get()
    tracker = object()
    try:
        compat.install_rng_tracker(tracker)
        assert mcore_random.get_cuda_rng_tracker() is tracker
    finally:
        compat.RNG_TRACKER.set(saved[0])
        compat.RNG_TRACKER_INITIALIZED.set(saved[1])


def test_write_results_queue_is_none_or_a_queue():
    queue = compat.write_results_queue()
    assert queue is None or hasattr(queue, "get_nowait")


@pytest.mark.parametrize("method, parameters", [
    ("_init_optimizer_states_with_dummy_values", ["self"]),
    ("_get_model_param_range_map", ["self", "param"]),
    ("_get_main_param_and_optimizer_states", ["self", "model_param"]),
])
def test_distributed_optimizer_methods_take_what_compat_passes(method, parameters):
    assert list(inspect.signature(getattr(DistributedOptimizer, method)).parameters) == parameters


_QUEUE_UNDER_NOTICE = """
import os, signal, sys
from reconfig import compat
signal.signal(signal.SIGTERM, lambda *_: None)  # the trainer hears the notice and goes on
compat.install_write_results_queue()
results = compat.write_results_queue()
print(os.getpgid(0), flush=True)
sys.stdin.readline()  # the test signals the whole process group meanwhile
results.put("written")
print(results.get(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.slow
def test_checkpoint_results_queue_survives_a_notice_and_dies_with_the_trainer():
    trainer = subprocess.Popen([sys.executable, "-c", _QUEUE_UNDER_NOTICE], cwd=REPO, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        group = int(trainer.stdout.readline())
        manager = next(p for p in psutil.Process(trainer.pid).children() if "multiprocessing" in " ".join(p.cmdline()))
        os.killpg(group, signal.SIGTERM)  # as a cloud or torchrun notifies a process group
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline().strip() == "written"
        trainer.kill()
        trainer.wait()
        manager.wait(timeout=10)  # gone with its trainer, not orphaned
    finally:
        trainer.kill()
        trainer.wait()


_SLOW_PEER = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from reconfig.world import patient

rank, port = int(sys.argv[1]), int(sys.argv[2])
usual = timedelta(seconds=1)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=usual)
with patient(None, timedelta(seconds=30), usual):  # rank 1 is 3 s late: waited for
    if rank:
        time.sleep(3)
    dist.all_reduce(torch.ones(1))
try:  # the usual timeout is back: rank 1 late again breaks the collective on rank 0
    if rank:
        time.sleep(4)
    dist.all_reduce(torch.ones(1))
    print("no timeout", flush=True)
except RuntimeError:
    print("timed out", flush=True)
import os
os._exit(0)  # not torch's shutdown, which waits out the store's timeout for the late peer
"""


@pytest.mark.slow
def test_a_patient_collective_waits_longer_then_the_usual_timeout_is_back():
    port = 20000 + os.getpid() % 20000
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ranks = [subprocess.Popen([sys.executable, "-c", _SLOW_PEER, str(r), str(port)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out0, err0 = ranks[0].communicate(timeout=120)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert "timed out" in out0, (out0, err0[-2000:])
