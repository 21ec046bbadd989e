"""WORLD and megatron-core's parallel groups across layout changes in a running process.

torch.distributed has one WORLD per process; when the job's membership or rank order
changes it is destroyed and created anew on a store scoped to the generation, so a
message or key of an older generation can never reach the new one. megatron-core's
`destroy_model_parallel` neither destroys the groups it created nor resets all of its
globals (docs/megatron-core.md); `release_parallel_state` does both, so
twenty layout changes leave as many live groups as one.

No wait on a peer is unbounded: members meet on the store before WORLD is created
(`reform`, `sync`), a wait the caller finds in vain (a newer generation supersedes it, a
peer is gone) is abandoned, and collectives time out, so a peer that died or stalled
breaks WORLD (`WorldBroken`) instead of hanging the others. A collective's timeout is
set by what it waits for (reconfig/timeouts.py): one lease period in a running layout's
steps, longer inside `patient` blocks (a layout's first step, an exchange, a save).
While a group waits longer than a lease period, `World.watch` looks out for a failed
peer as a meeting does, and aborts the groups when it finds one, so that collectives
blocked on it return. A broken WORLD's groups are aborted, never destroyed gracefully:
shutting a broken NCCL communicator down can hang.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from reconfig import compat
from reconfig.one_gpu import one_gpu

_TIMEOUT = timedelta(minutes=10)
_MEET_POLL_SECONDS = 0.05
_GENERATION_KEY = re.compile(r"^g(\d+)(/|$)")
# What gloo and NCCL say when a peer is gone or silent (they raise plain RuntimeErrors).
# Once one gloo operation times out, its context closes every pair, and the operations
# queued behind it (a checkpoint's barrier behind the plan agreement in flight) say only that.
_PEER_FAILURE = re.compile(r"gloo|NCCL|[Cc]onnection (closed|reset|refused)|[Tt]imed out|[Bb]roken pipe"
                           r"|timeout caused pair closure")


def process_group_backend() -> str:
    """WORLD's backends: on GPUs, CPU tensors (the small control collectives: plan
    agreement, progress, sizes, headers, logged losses) go over gloo and device tensors
    (parameters, gradients, optimizer state) over NCCL; gloo alone on CPU. Keeping the
    control plane on gloo also keeps its timeouts and failure detection alike on both.
    reconfig.planes makes every tensor the project hands to a collective. Processes that
    share one GPU (reconfig/one_gpu.py) have gloo alone too: NCCL refuses them."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and not one_gpu() else "gloo"


class WorldBroken(RuntimeError):
    """This process's WORLD cannot go on: a peer died or stalled past the collective
    timeout, or the one being formed was abandoned."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc`, raised by a collective, means a peer failed (not a bug of this process)."""
    if isinstance(exc, (WorldBroken, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and _PEER_FAILURE.search(str(exc)) is not None


class _Groups:
    """What this process knows of its process groups beyond torch: the timeout each was
    last given here, and whether WORLD's generation failed (its groups are then aborted,
    not destroyed). One per process, as torch.distributed's WORLD is."""

    def __init__(self) -> None:
        self.given: dict[object, timedelta] = {}
        self.broken = ""  # why WORLD's generation failed ("" while it has not)
        self.lock = threading.Lock()  # releases against the watch's aborts


_groups = _Groups()


def _resolve(group):
    return dist.group.WORLD if group is None else group


def set_timeout(group, timeout: timedelta) -> None:
    """Make `group`'s (WORLD's for None) collectives wait up to `timeout` from now on."""
    group = _resolve(group)
    compat.set_group_timeout(timeout, group)
    _groups.given[group] = timeout


def set_timeouts(timeout: timedelta) -> None:
    """`set_timeout` on every group this process holds (WORLD, megatron-core's)."""
    for group in tuple(compat.process_group_map()):
        set_timeout(group, timeout)


def longest_timeout() -> timedelta | None:
    """The longest timeout given here to a group this process holds (None: none given)."""
    live = compat.process_group_map()
    return max((t for g, t in list(_groups.given.items()) if g in live), default=None)


@contextmanager
def patient(group, timeout: timedelta, usual: timedelta) -> Iterator[None]:
    """Let `group`'s collectives wait up to `timeout` inside the block, and after it what
    they waited before: `usual`, unless `set_timeout` gave the group another.

    The usual timeout is short where a silent peer must count as failed soon (one lease
    period); a synchronous save or the first set-up of NCCL communicators can take longer
    on a healthy job, and must not break WORLD. A block inside a longer one (a save in a
    layout's first step) keeps the longer timeout."""
    group = _resolve(group)
    before = _groups.given.get(group, usual)
    if timeout <= before:
        yield
        return
    set_timeout(group, timeout)
    try:
        yield
    finally:
        if group in compat.process_group_map():  # not released in the block (a failure)
            set_timeout(group, before)


def live_process_groups() -> int:
    """Process groups this process holds, WORLD included (for leak checks)."""
    return len(compat.process_group_map())


def _failing() -> bool:
    """Whether WORLD's generation failed: it was aborted, or a peer failure is being
    handled (a layout released in clean-up after a failed collective)."""
    exc = sys.exc_info()[1]
    return bool(_groups.broken) or (exc is not None and is_peer_failure(exc))


def _release(group) -> None:
    """Destroy `group` (WORLD and every other for None); abort it if WORLD failed."""
    with _groups.lock:
        if _failing():
            compat.drop_aborted_group(group)
        else:
            dist.destroy_process_group(group)
        _groups.given.pop(group, None)


def release_all() -> None:
    """Release every group this process holds, WORLD included (destroyed, or aborted if
    WORLD failed), and forget what they were given."""
    if dist.is_initialized():
        _release(None)
    _groups.given.clear()
    _groups.broken = ""


def release_parallel_state() -> None:
    """Destroy megatron-core's groups (abort them if WORLD failed) and reset every
    parallel_state global."""
    groups = compat.megatron_process_groups()
    ps.destroy_model_parallel()
    compat.reset_parallel_state()
    for group in groups:
        if group in compat.process_group_map():
            _release(group)


class World:
    """This process's place in the job: a stable worker id and the current WORLD.

    `collective_timeout` bounds every collective of WORLD (and, passed on by the
    runtime, of megatron-core's groups) outside `patient` blocks; `meet_timeout` bounds a
    wait for peers to reach the same point, which a peer's failure (`break_generation`)
    or `abandon(members, seconds waited)` cuts short: it says why the wait is in vain
    ("" while it is not). `watch` applies the same two tests to collectives that wait
    longer than `collective_timeout`.
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
        self.generation = 0  # of the newest key WORLD was formed or met on
        self.aborted = ""  # why `abort` aborted this WORLD's groups ("" while it has not)
        self._watching: threading.Thread | None = None
        self._closed = threading.Event()

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
        self.leave()
        self.members = members if self.worker in members else ()
        self.aborted = ""
        self._note_generation(key)
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
        if self.aborted:
            raise WorldBroken(f"worker {self.worker} cannot meet at {key}: {self.aborted}")
        self._note_generation(key)
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
        """Leave WORLD: this worker has no slot, or its WORLD broke (then its groups are
        aborted)."""
        release_all()
        self.members = ()
        self.aborted = ""

    def break_generation(self, generation: int) -> None:
        """Leave WORLD after a failure in `generation`, and end its peers' waits at its
        meeting points (`sync`) and in their long collectives (`watch`): the one they wait
        for may be the worker that died."""
        self._store.set(f"parcae/g{generation}/broken", b"1")
        _groups.broken = _groups.broken or f"generation {generation} broke"
        self.leave()

    def abort(self, why: str, generation: int | None = None) -> None:
        """Abort every group this process holds (WORLD, megatron-core's), from any thread:
        collectives blocked on a failed peer return (on NCCL), later ones fail, and the
        groups are released by abort. `why` says what failed; with `generation`, only if
        WORLD is still that generation's."""
        with _groups.lock:
            if generation is not None and generation != self.generation:
                return
            self.aborted = self.aborted or why
            _groups.broken = _groups.broken or why
            for group in tuple(compat.process_group_map()):
                compat.abort_group(group)

    def watch(self, period: float) -> None:
        """From now until `close`, every `period` seconds while some group waits longer
        than `collective_timeout` (a `patient` block), abort WORLD if a peer broke its
        generation or `abandon` finds the wait in vain: a peer that dies is noticed within
        a lease period whatever the collectives' timeout."""
        if self._watching is None:
            self._watching = threading.Thread(target=self._watch, args=(period,), name=f"parcae-watch {self.worker}",
                                              daemon=True)
            self._watching.start()

    def close(self) -> None:
        """Stop `watch`. Its thread may be inside a store read that an unreachable etcd
        holds for its whole retry bound; it is a daemon and stops at its next check, so
        it is waited for one second at most (a stopping worker must not wait on etcd)."""
        self._closed.set()
        if self._watching is not None:
            self._watching.join(timeout=1.0)
            self._watching = None

    def _watch(self, period: float) -> None:
        since = None  # when the current long wait began
        while not self._closed.wait(period):
            longest = longest_timeout() if dist.is_initialized() else None
            if self.aborted or not self.members or longest is None or longest <= self.collective_timeout:
                since = None
                continue
            since = time.monotonic() if since is None else since
            generation = self.generation
            try:
                why = self.why_in_vain(time.monotonic() - since)
            except RuntimeError:  # the store or etcd does not answer: asked again a period on
                continue
            if why:
                self.abort(why, generation)

    def why_in_vain(self, waited: float) -> str:
        """Why waiting on WORLD's members (for `waited` seconds) is in vain: a peer broke
        its generation, or `abandon` says ("" while it is not)."""
        if self._store.check([f"parcae/g{self.generation}/broken"]):
            return f"a peer broke generation {self.generation}"
        return self._abandon(self.members, waited)

    def _note_generation(self, key: str) -> None:
        found = _GENERATION_KEY.match(key)
        if found:
            self.generation = int(found[1])
