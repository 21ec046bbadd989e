"""WORLD and megatron-core's parallel groups across layout changes in a running process.

torch.distributed has one WORLD per process; when the job's membership or rank order
changes it is destroyed and created anew on a store scoped to the generation, so a
message or key of an older generation can never reach the new one. megatron-core's
`destroy_model_parallel` neither destroys the groups it created nor resets all of its
globals (docs/megatron-core.md); `release_parallel_state` does both, so
twenty layout changes leave as many live groups as one.

No wait on a peer is unbounded: members meet on the store before WORLD is created
(`reform`, `sync`), a wait the caller finds in vain (a newer generation supersedes it, a
peer is gone) is abandoned, and collectives time out after `collective_timeout`, so a
peer that died or stalled breaks WORLD (`WorldBroken`) instead of hanging the others.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from reconfig import compat

_TIMEOUT = timedelta(minutes=10)
_MEET_POLL_SECONDS = 0.05
# What gloo and NCCL say when a peer is gone or silent (they raise plain RuntimeErrors).
_PEER_FAILURE = re.compile(r"gloo|NCCL|[Cc]onnection (closed|reset|refused)|[Tt]imed out|[Bb]roken pipe")


def process_group_backend() -> str:
    """WORLD's backends: on GPUs, CPU tensors (the small control collectives: plan
    agreement, progress, sizes, headers, logged losses) go over gloo and device tensors
    (parameters, gradients, optimizer state) over NCCL; gloo alone on CPU. Keeping the
    control plane on gloo also keeps its timeouts and failure detection alike on both.
    reconfig.planes makes every tensor the project hands to a collective."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


class WorldBroken(RuntimeError):
    """This process's WORLD cannot go on: a peer died or stalled past the collective
    timeout, or the one being formed was abandoned."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc`, raised by a collective, means a peer failed (not a bug of this process)."""
    if isinstance(exc, (WorldBroken, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and _PEER_FAILURE.search(str(exc)) is not None


@contextmanager
def patient(group, timeout: timedelta, usual: timedelta) -> Iterator[None]:
    """Let `group`'s collectives wait up to `timeout` inside the block, `usual` after it.

    The usual timeout is short where a silent peer must count as failed soon (one lease
    period); a synchronous save or the first set-up of NCCL communicators can take longer
    on a healthy job, and must not break WORLD."""
    if timeout <= usual:
        yield
        return
    compat.set_group_timeout(timeout, group)
    try:
        yield
    finally:
        compat.set_group_timeout(usual, group)


def live_process_groups() -> int:
    """Process groups this process holds, WORLD included (for leak checks)."""
    return len(compat.process_group_map())


def release_parallel_state() -> None:
    """Destroy megatron-core's groups and reset every parallel_state global."""
    groups = compat.megatron_process_groups()
    ps.destroy_model_parallel()
    compat.reset_parallel_state()
    for group in groups:
        if group in compat.process_group_map():
            dist.destroy_process_group(group)


class World:
    """This process's place in the job: a stable worker id and the current WORLD.

    `collective_timeout` bounds every collective of WORLD (and, passed on by the
    runtime, of megatron-core's groups); `meet_timeout` bounds a wait for peers to reach
    the same point, which a peer's failure (`break_generation`) or `abandon(members,
    seconds waited)` cuts short: it says why the wait is in vain ("" while it is not).
    """

    def __init__(self, worker: int, members: Sequence[int], store: dist.Store, backend: str,
                 collective_timeout: timedelta = _TIMEOUT, meet_timeout: timedelta = _TIMEOUT,
                 abandon: Callable[[tuple[int, ...], float], str] = lambda peers, waited: "") -> None:
        self.worker = worker
        self.members = tuple(members)
        self._store = store
        self._backend = backend
        self.collective_timeout = collective_timeout
        self.meet_timeout = meet_timeout
        self._abandon = abandon

    @classmethod
    def from_torchrun(cls) -> World:
        """Adopt the WORLD torchrun made: worker id = torchrun rank, its store for later generations."""
        store = compat.default_store()  # kept alive here after WORLD is destroyed
        return cls(dist.get_rank(), range(dist.get_world_size()), store, dist.get_backend())

    def reform(self, members: Sequence[int], key: str) -> None:
        """Make WORLD exactly `members` (worker ids in rank order), on the store prefix `key`.

        Keys are `parcae/<key>/...` in the store; `key` starts with `g<generation>/`, so one
        prefix holds all of a generation's keys (etcd.keys.JobKeys.world_store drops them).

        Every member calls it with the same arguments; it returns when all have joined.
        A process that is not a member only leaves the current WORLD.
        """
        members = tuple(members)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.members = members if self.worker in members else ()
        if self.members:
            self.sync(f"{key}/arrived")
            compat.reset_group_count()
            dist.init_process_group(self._backend, store=dist.PrefixStore(f"parcae/{key}/", self._store),
                                    rank=members.index(self.worker), world_size=len(members),
                                    timeout=self.collective_timeout)

    def sync(self, key: str) -> None:
        """Wait until every member of WORLD has reached the point `key` (`g<generation>/...`:
        on the store, so a slow peer is no collective timeout); WorldBroken if the wait
        is abandoned or too slow."""
        store = dist.PrefixStore(f"parcae/{key}/", self._store)
        store.set(str(self.worker), b"1")  # who came, for the message of a timeout
        arrived = store.add("count", 1)  # one key to poll, however many members
        generation = key.split("/")[0]
        started = time.monotonic()
        deadline = started + self.meet_timeout.total_seconds()
        while arrived < len(self.members):
            why = self._abandon(self.members, time.monotonic() - started)
            if why:
                raise WorldBroken(f"worker {self.worker} stopped waiting at {key}: {why}")
            if self._store.check([f"parcae/{generation}/broken"]):
                raise WorldBroken(f"a peer broke in {generation} while worker {self.worker} waited at {key}")
            if time.monotonic() > deadline:
                missing = [str(w) for w in self.members if not store.check([str(w)])]
                raise WorldBroken(f"workers {', '.join(missing)} did not reach {key} within "
                                  f"{self.meet_timeout.total_seconds():g} s")
            time.sleep(_MEET_POLL_SECONDS)
            arrived = int(store.get("count"))

    def leave(self) -> None:
        """Leave WORLD: this worker has no slot, or its WORLD broke."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.members = ()

    def break_generation(self, generation: int) -> None:
        """Leave WORLD after a failure in `generation`, and end its peers' waits at its
        meeting points (`sync`): the one they wait for may be the worker that died."""
        self._store.set(f"parcae/g{generation}/broken", b"1")
        self.leave()
