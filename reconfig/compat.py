"""Every reach into private torch and megatron-core state, each checked before use.

In-place layout changes, async checkpoints and CPU support need a few things neither
library makes public (docs/megatron-core.md says why each is needed). Each such reach
is one function here, and before touching its attribute it checks that the installed
library is a version the reach was verified on and that the attribute exists; otherwise
it raises `CompatError` naming the attribute, the installed version and the verified
ones. Nothing here creates an attribute: a release that renamed one must fail loudly,
not run on a copy the library never reads. tests/test_compat.py checks every reach
against the installed versions.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import multiprocessing
import re
import signal
import sys
from dataclasses import dataclass
from multiprocessing.managers import SyncManager

# Inclusive (major, minor) ranges every reach below was verified on: torch from
# megatron-core 0.16's own floor (2.6) to 2.15, checked in the sources of 2.6, 2.13,
# 2.14 and 2.15; megatron-core is pinned to 0.16.
SUPPORTED = {"torch": ((2, 6), (2, 15)), "megatron-core": ((0, 16), (0, 16))}
_VERSION_MODULE = {"torch": "torch", "megatron-core": "megatron.core.package_info"}

# parallel_state's module state is every global named like this: groups, rank lists,
# cached sizes and ranks. Each is None at import, except one dict of groups.
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PARALLEL_STATE_GLOBAL = re.compile(r"^_[A-Z][A-Z0-9_]*$")
# The globals destroy_model_parallel leaves stale in 0.16 (reset by reset_parallel_state).
_STALE_AFTER_DESTROY = ("_EMBEDDING_GLOBAL_RANKS", "_PIPELINE_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS",
                        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
                        "_MODEL_PARALLEL_GLOBAL_RANKS", "_MPU_DATA_PARALLEL_WORLD_SIZE", "_MPU_DATA_PARALLEL_RANK")


class CompatError(RuntimeError):
    """Private torch / megatron-core state this project needs is missing, or the
    installed version is not one its use was verified on."""


def installed_version(library: str) -> str:
    return importlib.import_module(_VERSION_MODULE[library]).__version__


def _range(library: str) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED[library]
    low, high = f"{lo_major}.{lo_minor}", f"{hi_major}.{hi_minor}"
    return f"{library} {low}.x" if low == high else f"{library} {low} to {high}"


@dataclass(frozen=True)
class Reach:
    """One private attribute: `path` (dotted) inside `module` of `library`."""

    library: str
    module: str
    path: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"

    def check(self) -> None:
        """Raise CompatError unless this reach is usable with the installed libraries."""
        _verify(self)

    def _owner(self) -> object:
        self.check()
        owner = importlib.import_module(self.module)
        for part in self.path.split(".")[:-1]:
            owner = getattr(owner, part)
        return owner

    def get(self) -> object:
        return getattr(self._owner(), self.path.rsplit(".", 1)[-1])

    def set(self, value: object) -> None:
        """Replace the attribute's value (it exists: check() made sure)."""
        setattr(self._owner(), self.path.rsplit(".", 1)[-1], value)


@functools.cache
def _verify(reach: Reach) -> None:
    """Reach.check (a success is remembered, a failure is raised again on every call)."""
    version = installed_version(reach.library)
    numbers = re.match(r"(\d+)\.(\d+)", version)
    low, high = SUPPORTED[reach.library]
    if numbers is None or not low <= (int(numbers[1]), int(numbers[2])) <= high:
        raise CompatError(f"{reach.name} is private {reach.library} state that megatron-parcae uses; it was "
                          f"verified on {_range(reach.library)}, and {reach.library} {version} is installed")
    owner: object = importlib.import_module(reach.module)
    for part in reach.path.split("."):
        if not hasattr(owner, part):
            raise CompatError(f"{reach.name} does not exist in {reach.library} {version} (megatron-parcae "
                              f"needs it; verified on {_range(reach.library)})")
        owner = getattr(owner, part)


_C10D = "torch.distributed.distributed_c10d"
_PS = "megatron.core.parallel_state"
_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"

PROCESS_GROUP_MAP = Reach("torch", _C10D, "_world.pg_map")
GROUP_COUNT = Reach("torch", _C10D, "_world.group_count")
DEFAULT_STORE = Reach("torch", _C10D, "_get_default_store")
SET_GROUP_TIMEOUT = Reach("torch", _C10D, "_set_pg_timeout")
# The two aborts were verified on torch 2.13 only; like every reach, each is checked at use.
ABORT_GROUP = Reach("torch", "torch.distributed", "ProcessGroup.abort")
DROP_ABORTED_GROUP = Reach("torch", _C10D, "_abort_process_group")
MEGATRON_GROUP_LIST = Reach("megatron-core", _PS, "_global_process_group_list")
PARALLEL_STATE_GLOBALS = tuple(Reach("megatron-core", _PS, name) for name in _STALE_AFTER_DESTROY)
WRITE_RESULTS_QUEUE = Reach("megatron-core", "megatron.core.dist_checkpointing.strategies.filesystem_async",
                            "_results_queue")
RNG_TRACKER = Reach("megatron-core", "megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER")
RNG_TRACKER_INITIALIZED = Reach("megatron-core", "megatron.core.tensor_parallel.random",
                                "_CUDA_RNG_STATE_TRACKER_INITIALIZED")
CUDA_RNG_STATE_GET = Reach("megatron-core", "megatron.core.tensor_parallel.random", "_get_cuda_rng_state")
CUDA_RNG_STATE_SET = Reach("megatron-core", "megatron.core.tensor_parallel.random", "_set_cuda_rng_state")
INIT_OPTIMIZER_STATES = Reach("megatron-core", _DISTRIB_OPTIMIZER,
                              "DistributedOptimizer._init_optimizer_states_with_dummy_values")
PARAM_RANGE_MAP = Reach("megatron-core", _DISTRIB_OPTIMIZER, "DistributedOptimizer._get_model_param_range_map")
MAIN_PARAM_AND_STATES = Reach("megatron-core", _DISTRIB_OPTIMIZER,
                              "DistributedOptimizer._get_main_param_and_optimizer_states")
_BUCKETS = "megatron.core.distributed.param_and_grad_buffer"
BUCKET_COALESCING = Reach("megatron-core", _BUCKETS, "_coalescing_manager")
BUCKET_ALL_GATHER = Reach("megatron-core", _BUCKETS, "dist_all_gather_func")
BUCKET_REDUCE_SCATTER = Reach("megatron-core", _BUCKETS, "dist_reduce_scatter_func")

REACHES = (PROCESS_GROUP_MAP, GROUP_COUNT, DEFAULT_STORE, SET_GROUP_TIMEOUT, ABORT_GROUP, DROP_ABORTED_GROUP,
           MEGATRON_GROUP_LIST, *PARALLEL_STATE_GLOBALS,
           WRITE_RESULTS_QUEUE, RNG_TRACKER, RNG_TRACKER_INITIALIZED, CUDA_RNG_STATE_GET, CUDA_RNG_STATE_SET,
           INIT_OPTIMIZER_STATES, PARAM_RANGE_MAP,
           MAIN_PARAM_AND_STATES, BUCKET_COALESCING, BUCKET_ALL_GATHER, BUCKET_REDUCE_SCATTER)


# ---- torch.distributed -------------------------------------------------------------


def process_group_map() -> dict:
    """Every process group this process holds, WORLD included (torch has no public list)."""
    return PROCESS_GROUP_MAP.get()


def set_group_timeout(timeout, group=None) -> None:
    """Change how long `group`'s collectives (WORLD's by default) wait, on each of its
    backends (torch sets it only at creation in public)."""
    SET_GROUP_TIMEOUT.get()(timeout, group)


def abort_group(group) -> None:
    """Abort `group` on each of its backends, from any thread: NCCL aborts its
    communicators, so that collectives blocked on a failed peer return with an error.
    gloo's abort does not interrupt an operation in flight (torch 2.13); a gloo peer that
    dies is noticed as its connections close. The group stays registered: the thread
    that runs the collectives drops it (`drop_aborted_group`)."""
    ABORT_GROUP.check()
    group.abort()


def drop_aborted_group(group=None) -> None:
    """Abort `group` (every group, WORLD included, by default) and forget it, as
    destroy_process_group does but without its graceful shutdown, which can hang on a
    broken NCCL communicator."""
    DROP_ABORTED_GROUP.get()(group)


def reset_group_count() -> None:
    """Restart torch's per-process count that names groups (and their store keys).

    torch resets it when WORLD is destroyed, but a WORLD whose creation failed counted
    one anyway; peers whose counts differ never meet on the store.
    """
    GROUP_COUNT.set(0)


def default_store():
    """The store WORLD was created on (torchrun's), to keep using after WORLD is destroyed."""
    get_default_store = DEFAULT_STORE.get()
    return get_default_store()


# ---- megatron.core.parallel_state --------------------------------------------------


def megatron_process_groups() -> list:
    """The process groups megatron-core created in this process (destroy_model_parallel
    forgets them without destroying them)."""
    return [g for g in (MEGATRON_GROUP_LIST.get() or []) if g is not None]


def reset_parallel_state() -> None:
    """Put every parallel_state global back to its import-time value (None, or an empty
    dict), including the ones destroy_model_parallel leaves stale."""
    for reach in PARALLEL_STATE_GLOBALS:
        reach.check()
    ps = importlib.import_module(_PS)
    for name, value in list(vars(ps).items()):
        if _PARALLEL_STATE_GLOBAL.match(name):
            setattr(ps, name, {} if isinstance(value, dict) else None)


# ---- dist_checkpointing, tensor_parallel -------------------------------------------


def write_results_queue():
    """megatron-core's per-process queue of async checkpoint write results (None until
    the first save or `install_write_results_queue`)."""
    return WRITE_RESULTS_QUEUE.get()


def install_write_results_queue() -> None:
    """Give megatron-core that queue now, served by a manager process that ignores SIGTERM
    and SIGINT and dies with this process. megatron-core makes it on the first save with
    a plain manager in this process's group: a preemption notice sent to the group kills
    it mid-save (the save fails), and a trainer killed outright leaves it behind."""
    if WRITE_RESULTS_QUEUE.get() is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_serve_until_parent_dies)
    WRITE_RESULTS_QUEUE.set(manager.Queue())  # the queue's proxy keeps the manager alive


def _serve_until_parent_dies() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def install_rng_tracker(tracker: object) -> None:
    """Make `tracker` the one megatron-core's get_cuda_rng_tracker() returns (CPU runs
    need one that forks the CPU generator). Activation recomputation saves and restores
    the CUDA generator besides the CPU one and the tracker's: with the tracker on the CPU
    there is no CUDA generator, so its state is an empty placeholder."""
    RNG_TRACKER.set(tracker)
    RNG_TRACKER_INITIALIZED.set(True)
    CUDA_RNG_STATE_GET.set(_no_cuda_rng_state)
    CUDA_RNG_STATE_SET.set(_restore_no_cuda_rng_state)


def _no_cuda_rng_state(*args, **kwargs):
    import torch

    return torch.empty(0, dtype=torch.uint8)


def _restore_no_cuda_rng_state(*args, **kwargs) -> None:
    pass


# ---- DDP's buckets ------------------------------------------------------------------


def route_bucket_collectives(wrap, coalescing) -> None:
    """Give megatron-core's gradient and parameter buckets `wrap(gather)` and
    `wrap(reduce_scatter)`, bound at its import, and `coalescing` in place of torch's
    coalescing manager."""
    for reach in (BUCKET_ALL_GATHER, BUCKET_REDUCE_SCATTER):
        reach.set(wrap(reach.get()))
    BUCKET_COALESCING.set(coalescing)


# ---- DistributedOptimizer ----------------------------------------------------------


def init_distributed_optimizer_states(opt) -> None:
    """Create Adam's state of a DistributedOptimizer before its first step, so that it
    can be written (its public load path mishandles Adam's step without TE/Apex)."""
    INIT_OPTIMIZER_STATES.check()
    opt._init_optimizer_states_with_dummy_values()


def param_range(opt, param):
    """The range of `param`'s flattened elements whose state this DP rank keeps."""
    PARAM_RANGE_MAP.check()
    return opt._get_model_param_range_map(param)["param"]


def main_param_and_optimizer_states(opt, param) -> dict:
    """This DP rank's slice of `param`'s fp32 main weight and Adam moments, as views
    that can be read and written in place."""
    MAIN_PARAM_AND_STATES.check()
    return opt._get_main_param_and_optimizer_states(param)
