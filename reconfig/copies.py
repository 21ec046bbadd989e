"""Snapshots of a layout's state in host memory, each kept twice: by its worker and by a
buddy on another instance.

Every few steps (and after the first step of each layout) every worker of the layout
takes its state out of the model (`execute.export_held_state`: the distributed
optimizer's shards are gathered, so each snapshot is its DP column's whole state), keeps
it, and sends a copy to its buddy while receiving its ward's. A worker lost without
notice then costs at most the steps since: the survivors roll back to the newest snapshot
they all hold and take the lost worker's slices from its buddy (`plan.Copies`), retraining
the steps in between. Only a worker lost together with its buddy sends the job back to
its checkpoint.

A worker's DP peers (same stage, same tensor rank) take identical snapshots, so a buddy
that is one already holds the copy: nothing is sent to it.

Host memory per worker is its own snapshot and its ward's copy, each in a block
allocated once per layout and reused every K steps (`planes.HostArena`), plus the
chunk in flight (reconfig/transfer.py). Taking a snapshot therefore overwrites the
previous one: from the moment a worker starts taking one until its exchange has checked it
holds none, and a worker lost in that window sends the job back to its checkpoint. A
checked snapshot is pending until every worker of the layout has confirmed its exchange,
then committed: whenever one worker has committed a snapshot every worker holds it
(committed or pending). A copy that arrives damaged is never kept: the workers take the
exchange again together. The newest snapshot every holder has is the smallest of the
holders' newest complete ones (`execute.migrate` agrees on it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reconfig import planes, transfer
from reconfig.execute import Counters, HeldState, MigrationError, Runtime, export_held_state
from reconfig.optimizer_state import STATE_KEYS, LossScale
from reconfig.tensors import ParamShard
from reconfig.world import World

_TAG = 7_000_000  # apart from the tags of a migration's transfers
ATTEMPTS = 3  # exchanges of one snapshot's copies before it is given up


@dataclass
class Snapshot:
    """One worker's state at an iteration boundary of one generation, and its ward's."""

    generation: int
    iteration: int
    consumed_samples: int
    own: HeldState
    ward: int | None
    ward_state: HeldState | None

    @property
    def key(self) -> int:
        """Orders snapshots: newer generations first, then iterations (a rollback can take
        a new generation's first snapshot at an iteration an older one reached)."""
        return snapshot_key(self.generation, self.iteration)

    def nbytes(self) -> int:
        """Host memory held (a DP peer's copy is this worker's own snapshot, counted once)."""
        ward = self.ward_state
        states = [self.own] if ward is None or ward is self.own else [self.own, ward]
        return sum(t.numel() * t.element_size() for state in states
                   for tensors in state.tensors.values() for t in tensors.values())


def snapshot_key(generation: int, iteration: int) -> int:
    return generation << 32 | iteration


def _detached(held: HeldState) -> HeldState:
    """`held` without references to the live model's parameters (a snapshot outlives its
    layout; the parameter's place is taken by its host copy, which has its shape)."""
    shards = {n: ParamShard(n, held.tensors[n]["param"], s.partition_dim, s.partition_stride)
              for n, s in held.shards.items()}
    return HeldState(shards, held.tensors, held.tp_rank, held.tp_size, held.counters)


def _header(snapshot: Snapshot, block: torch.Tensor | None) -> tuple[bytes, torch.Tensor]:
    """A snapshot's own state as (JSON header, flat fp32 payload) for its buddy: `block`,
    the arena the state was exported into, where it holds the state in the header's order."""
    held = snapshot.own
    names = list(held.tensors)
    scale = held.counters.loss_scale
    header = {
        "generation": snapshot.generation, "iteration": snapshot.iteration, "tp_rank": held.tp_rank,
        "tp_size": held.tp_size,
        "step": held.counters.step, "scheduler_steps": held.counters.scheduler_steps,
        "loss_scale": None if scale is None else [scale.scale, scale.growth_tracker, scale.hysteresis_tracker],
        "params": [[n, list(held.tensors[n]["param"].shape), held.shards[n].partition_dim,
                    held.shards[n].partition_stride] for n in names],
    }
    parts = [held.tensors[n][k] for n in names for k in STATE_KEYS]
    if block is not None and _laid_out_in(block, parts):
        payload = block
    else:
        payload = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0)
    return json.dumps(header).encode(), payload


def _laid_out_in(block: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """Whether `parts` lie one after another from the start of `block`, filling it."""
    offset = 0
    for part in parts:
        if part.untyped_storage().data_ptr() != block.untyped_storage().data_ptr() \
                or part.storage_offset() != block.storage_offset() + offset or not part.is_contiguous():
            return False
        offset += part.numel()
    return offset == block.numel()


def _int(d: dict, key: str, minimum: int = 0) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MigrationError(f"copy from a buddy: {key} is {value!r}")
    return value


def _parse(raw: bytes, payload: torch.Tensor, src: int, generation: int, iteration: int) -> HeldState:
    """A ward's copy, checked against what this worker expects before it is kept."""
    try:
        d = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MigrationError(f"copy from worker {src}: unreadable header ({exc})") from None
    if not isinstance(d, dict) or not isinstance(d.get("params"), list):
        raise MigrationError(f"copy from worker {src}: header is not an object with params")
    if (_int(d, "generation"), _int(d, "iteration")) != (generation, iteration):
        raise MigrationError(f"copy from worker {src} is of generation {d['generation']} iteration "
                             f"{d['iteration']}, expected {generation} {iteration}")
    scale = d.get("loss_scale")
    if scale is not None and not (isinstance(scale, list) and len(scale) == 3):
        raise MigrationError(f"copy from worker {src}: loss_scale is {scale!r}")
    counters = Counters(_int(d, "step"), _int(d, "scheduler_steps"), None if scale is None else LossScale(*scale))
    shards, tensors, offset = {}, {}, 0
    for entry in d["params"]:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(isinstance(x, int) and x >= 0 for x in entry[1])
                and (entry[2] is None or isinstance(entry[2], int)) and isinstance(entry[3], int)):
            raise MigrationError(f"copy from worker {src}: bad parameter entry {entry!r}")
        name, shape = entry[0], torch.Size(entry[1])
        tensors[name] = {}
        for key in STATE_KEYS:
            end = offset + shape.numel()
            if end > payload.numel():
                raise MigrationError(f"copy from worker {src}: payload ends before {name} {key}")
            tensors[name][key] = payload[offset:end].view(shape)
            offset = end
        shards[name] = ParamShard(name, tensors[name]["param"], entry[2], entry[3])
    if offset != payload.numel():
        raise MigrationError(f"copy from worker {src}: {payload.numel() - offset} values beyond its parameters")
    return HeldState(shards, tensors, _int(d, "tp_rank"), _int(d, "tp_size", 1), counters)


class SnapshotStore:
    """This worker's newest snapshot and the memory it lives in (see the module
    docstring). It lives as long as the worker: a snapshot outlasts the layout it was
    taken of, until a newer one is taken."""

    def __init__(self) -> None:
        self.committed: Snapshot | None = None
        self.pending: Snapshot | None = None  # exchanged and checked here, not yet confirmed by every worker
        self._own = planes.HostArena()
        self._ward = planes.HostArena()
        self.damaged_exchanges = 0  # exchanges of copies that did not check, each taken again

    @property
    def generation(self) -> int:
        """The generation of the newest committed snapshot (0: none)."""
        return 0 if self.committed is None else self.committed.generation

    @property
    def allocations(self) -> int:
        """Host blocks allocated for snapshots so far (once per layout for each of own and ward)."""
        return self._own.allocations + self._ward.allocations

    def host_bytes(self) -> int:
        """Host memory held for snapshots."""
        return self._own.nbytes + self._ward.nbytes

    def _ward_block(self, peer: int, tag: int, elements: int) -> torch.Tensor:
        self._ward.reset(elements)
        return self._ward.take((elements,))

    def take(self, runtime: Runtime, world: World, generation: int, iteration: int, consumed_samples: int,
             buddy: int | None, ward: int | None, peers: frozenset[int]) -> Snapshot | None:
        """Snapshot this worker's state, swap copies with buddy and ward, and commit once
        every worker of the layout has (collective over WORLD, point to point with the
        buddy and the ward unless they are among its DP `peers`). None: the copies
        arrived damaged ATTEMPTS times; nothing was committed."""
        self.committed = self.pending = None  # its memory is reused now
        own = _detached(export_held_state(runtime, self._own))
        snapshot = Snapshot(generation, iteration, consumed_samples, own, ward, own if ward in peers else None)
        rank_of = {w: r for r, w in enumerate(world.members)}
        sends = [transfer.Outgoing(rank_of[buddy], _TAG, *_header(snapshot, self._own.used()))] \
            if buddy is not None and buddy not in peers else []
        receives = [transfer.Incoming(rank_of[ward], _TAG)] if ward is not None and ward not in peers else []
        for _ in range(ATTEMPTS):
            try:
                arrived = transfer.exchange(sends, receives, world.collective_timeout, self._ward_block,
                                            what=f"snapshot copies of generation {generation} iteration {iteration}")
                break
            except transfer.TransferBroken:
                self.damaged_exchanges += 1
        else:
            return None
        if receives:
            message = arrived.messages[rank_of[ward], _TAG]
            snapshot.ward_state = _parse(message.header, message.payload, ward, generation, iteration)
        self.pending = snapshot
        done = planes.control_tensor([1])
        dist.all_reduce(done)  # every worker has its ward's copy: commit
        self.committed, self.pending = snapshot, None
        return snapshot

    def newest(self, generation: int) -> int:
        """The key of the newest complete snapshot of `generation` held here; -1 if none."""
        found = [s.key for s in (self.committed, self.pending) if s is not None and s.generation == generation
                 and (s.ward is None or s.ward_state is not None)]
        return max(found, default=-1)

    def restore(self, key: int) -> tuple[HeldState, dict[int, HeldState], int]:
        """(own state, ward's state by worker, consumed samples) of the snapshot `key`."""
        for s in (self.committed, self.pending):
            if s is not None and s.key == key:
                return s.own, ({} if s.ward_state is None else {s.ward: s.ward_state}), s.consumed_samples
        raise MigrationError(f"no snapshot of generation {key >> 32} iteration {key & 0xFFFFFFFF} is held here")
