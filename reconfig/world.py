"""WORLD and megatron-core's parallel groups across layout changes in a running process.

torch.distributed has one WORLD per process; when the job's membership or rank order
changes it is destroyed and created anew on a store scoped to the generation, so a
message or key of an older generation can never reach the new one. megatron-core's
`destroy_model_parallel` neither destroys the groups it created nor resets all of its
globals (../shared/notes/megatron-core-0.16.md); `release_parallel_state` does both, so
twenty layout changes leave as many live groups as one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as ps

# parallel_state's module state: groups, rank lists, cached sizes and ranks (all None
# before the first initialize_model_parallel, one dict of groups).
_PARALLEL_STATE_GLOBAL = re.compile(r"^_[A-Z][A-Z0-9_]*$")
_TIMEOUT = timedelta(minutes=10)


def live_process_groups() -> int:
    """Process groups this process holds, WORLD included (for leak checks)."""
    return len(dist.distributed_c10d._world.pg_map)


def release_parallel_state() -> None:
    """Destroy megatron-core's groups and reset every parallel_state global."""
    groups = [g for g in (ps._global_process_group_list or []) if g is not None]
    ps.destroy_model_parallel()
    for name, value in list(vars(ps).items()):
        if _PARALLEL_STATE_GLOBAL.match(name):
            setattr(ps, name, {} if isinstance(value, dict) else None)
    for group in groups:
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


class World:
    """This process's place in the job: a stable worker id and the current WORLD."""

    def __init__(self, worker: int, members: Sequence[int], store: dist.Store, backend: str) -> None:
        self.worker = worker
        self.members = tuple(members)
        self._store = store
        self._backend = backend

    @classmethod
    def from_torchrun(cls) -> World:
        """Adopt the WORLD torchrun made: worker id = torchrun rank, its store for later generations."""
        store = dist.distributed_c10d._get_default_store()  # kept alive here after WORLD is destroyed
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
            dist.init_process_group(self._backend, store=dist.PrefixStore(f"parcae/{key}/", self._store),
                                    rank=members.index(self.worker), world_size=len(members), timeout=_TIMEOUT)

    def leave(self) -> None:
        """Leave the job for good."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.members = ()
