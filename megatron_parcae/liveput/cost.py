"""What a layout change costs, in seconds of lost training, from the planner's plan.

Two ways to change layout are priced (the assumptions the constants encode):

In place (`MigrationCostModel.plan_cost`), what megatron-parcae's executor does; the
planner's `MigrationPlan` says who moves which bytes, and the time is
- world: re-initialising the world (`world_init_seconds`, a store handshake among
  processes that already run) whenever its members or slots change. No rendezvous
  round is paid: a new instance starts its process and registers in etcd in the
  background while training goes on, and the coordinator admits only registered
  workers, at an iteration boundary (Parcae's `rendezvous_seconds`, its torchelastic
  rendezvous, is paid by restarts only);
- process groups: the executor rebuilds megatron-core's parallel_state, and each rank
  creates the NCCL communicators of the groups it belongs to (see `rank_groups`), one
  after another, at `group_create_seconds_with_new_worker` for a group holding a worker
  that joins (new NCCL peers), `group_create_seconds_survivors_only` otherwise. Groups of
  other ranks cost it nothing: with no device bound to WORLD (reconfig/world.py binds
  none), torch's new_group returns at once on a non-member, and a group's communicators
  form among its members only (NCCL's at the group's first collective; no barrier over
  the world unless TORCH_DIST_INIT_BARRIER=1), so disjoint groups form side by side and
  the rank whose groups take longest sets the time. Parcae's artifact charges every
  group of the job one after another (D + P + 1 + D*P of its DeepSpeed engine); only
  `reactive_restart_cost`, its baseline, is priced that way;
- model build: a worker whose stage or TP rank changes builds its new model chunk,
  `model_build_seconds_per_param` per transformer-layer parameter it holds (Parcae's
  build time is per layer; embeddings are single tensors, cheap to allocate); workers
  build in parallel, the slowest counts. A worker keeping its slot's state keeps its
  chunk. A joining worker (standby or new) is idle: it builds as soon as the plan is
  published, while the old layout trains on, unless some worker was lost without
  notice (then nothing trains until the new layout runs, and its build counts);
- state transfer: a byte between two instances crosses the network, where each
  instance's NIC carries what its workers send and what they receive (full duplex),
  timed by the measured p2p table (`p2p_bytes_to_microseconds`); a byte between two
  workers of one instance (the plan's `placement` says which) crosses the instance's own
  GPU links (NVLink or PCIe), `intra_instance_bytes_per_second` for what each worker
  sends and for what it receives. Both kinds run side by side: the busiest NIC or GPU
  link sets the time. With one GPU per instance every byte takes the network. Receivers
  take the bytes into staging buffers while they build their chunk, so build and
  transfer overlap: the longer of the two counts.
No process restarts, no checkpoint is read: an intra-stage change (a survivor takes a
lost rank's place, or D shrinks) costs only the world and its groups.

Checkpoint restart (`restart_cost`), what is left when state is lost (a stage with no
live replica and no notice, or a leaving worker that cannot send its state within the
grace period): processes start again, rendezvous (when workers join), the groups are
created (as above), every worker builds its stage, the checkpoint is saved and loaded
(`checkpoint_save_load_seconds`) and every worker reads its stage's state through its
own link, all in parallel (megatron-core's distributed checkpoint, from storage that
serves them all at once). A cold start (the job starts, or a replay starts mid-trace as
in Parcae's simulator) is a restart with nothing to save. `reactive_restart_cost` is a
restart of Parcae's engine, priced as Parcae's artifact prices its reactive baseline
(its DeepSpeed engine's group count, every stage's state reloaded in turn).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reconfig.layout import ModelShape, Parallelism
from reconfig.plan import MigrationPlan

DEFAULT_CONSTANTS = Path(__file__).with_name("parcae_cost_constants.json")

_SECONDS_FIELDS = (
    "interval_seconds", "rendezvous_seconds", "world_init_seconds", "group_create_seconds_with_new_worker",
    "group_create_seconds_survivors_only", "process_start_seconds", "model_build_seconds_per_param",
    "checkpoint_save_load_seconds", "grace_period_seconds",
)


class CostConstantsError(ValueError):
    """A cost-constants file that cannot be used; says which file, which field and why."""


@dataclass(frozen=True)
class CostConstants:
    """Calibrated constants of the migration cost model (file format: parcae_cost_constants.json)."""

    interval_seconds: float
    p2p_bytes: tuple[int, ...]  # message sizes of the p2p table, increasing
    p2p_seconds: tuple[float, ...]  # measured time of each size
    rendezvous_seconds: float
    world_init_seconds: float
    group_create_seconds_with_new_worker: float
    group_create_seconds_survivors_only: float
    process_start_seconds: float
    model_build_seconds_per_param: float
    checkpoint_save_load_seconds: float
    grace_period_seconds: float
    intra_instance_bytes_per_second: float  # between two GPUs of one instance
    host_copy_bytes_per_second: float  # between a GPU and pinned host memory
    models: dict[str, ModelShape]

    @classmethod
    def load(cls, path: str | Path = DEFAULT_CONSTANTS) -> CostConstants:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise CostConstantsError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CostConstantsError(f"{path}: not JSON: {exc}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = "cost constants") -> CostConstants:
        if not isinstance(data, dict):
            raise CostConstantsError(f"{where}: expected a JSON object")
        values: dict[str, Any] = {}
        for name in _SECONDS_FIELDS:
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise CostConstantsError(f"{where}: {name}: expected a non-negative number, got {value!r}")
            values[name] = float(value)
        if values["interval_seconds"] <= 0:
            raise CostConstantsError(f"{where}: interval_seconds must be positive")
        for name in ("intra_instance_bytes_per_second", "host_copy_bytes_per_second"):
            rate = data.get(name)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
                raise CostConstantsError(f"{where}: {name}: expected a positive number, got {rate!r}")
            values[name] = float(rate)
        table = data.get("p2p_bytes_to_microseconds")
        if not isinstance(table, dict) or not table:
            raise CostConstantsError(f"{where}: p2p_bytes_to_microseconds: expected an object of size -> microseconds")
        points = []
        for size, micros in table.items():
            if not size.isdigit() or int(size) < 1 or isinstance(micros, bool) \
                    or not isinstance(micros, (int, float)) or not (math.isfinite(micros) and micros > 0):
                raise CostConstantsError(f"{where}: p2p_bytes_to_microseconds[{size!r}]: expected a positive "
                                         f"integer size and a positive time, got {micros!r}")
            points.append((int(size), micros / 1e6))
        points.sort()
        models = data.get("models", {})
        if not isinstance(models, dict):
            raise CostConstantsError(f"{where}: models: expected an object of name -> model shape")
        shapes = {}
        for name, shape in models.items():
            try:
                shapes[name] = ModelShape.from_dict(shape)
            except (ValueError, TypeError) as exc:
                raise CostConstantsError(f"{where}: models.{name}: {exc}") from None
        return cls(p2p_bytes=tuple(p[0] for p in points), p2p_seconds=tuple(p[1] for p in points),
                   models=shapes, **values)

    def model(self, name: str) -> ModelShape:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(sorted(self.models)) or "none"
            raise CostConstantsError(f"no model shape named {name!r} in the cost constants (known: {known})") from None

    def intra_instance_seconds(self, nbytes: float) -> float:
        """Time to move `nbytes` between two GPUs of one instance."""
        return nbytes / self.intra_instance_bytes_per_second

    def transfer_seconds(self, nbytes: float) -> float:
        """Time of one point-to-point message of `nbytes` between instances: the measured
        table, interpolated linearly between sizes, scaled linearly beyond its largest size."""
        if nbytes <= 0:
            return 0.0
        sizes, times = self.p2p_bytes, self.p2p_seconds
        i = bisect.bisect_left(sizes, nbytes)
        if i == 0:
            return times[0]
        if i == len(sizes):
            return times[-1] * nbytes / sizes[-1]
        lo, hi = sizes[i - 1], sizes[i]
        return times[i - 1] + (times[i] - times[i - 1]) * (nbytes - lo) / (hi - lo)


@dataclass(frozen=True)
class MigrationCost:
    """Seconds a layout change takes, by part; `restart` when state had to come from a checkpoint.

    In place, building chunks overlaps receiving state, and held state goes to host memory
    and back (`staging_seconds`); a restart builds, then reloads.
    """

    world_seconds: float
    groups_seconds: float
    build_seconds: float
    transfer_seconds: float
    restart: bool = False
    staging_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        if self.restart:
            return self.world_seconds + self.groups_seconds + self.build_seconds + self.transfer_seconds
        return (self.world_seconds + self.groups_seconds + self.staging_seconds
                + max(self.build_seconds, self.transfer_seconds))


NO_COST = MigrationCost(0.0, 0.0, 0.0, 0.0)


def rank_groups(parallelism: Parallelism, joined: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: (megatron-core groups it communicates over, of them holding a joined rank).

    Counted: its tensor-, pipeline- and data-parallel groups, its embedding group (first
    and last stage of a pipeline all-reduce the tied embedding's gradient), its
    model-parallel group (T x P ranks: the gradient norm of clipping) and the world; groups
    of one rank are not, as they never create an NCCL communicator. `joined[r]`: rank r's
    worker joins.
    """
    T, P, D = parallelism.tp, parallelism.pp, parallelism.dp
    grid = joined.reshape(P, D, T)  # rank = t + T * (d + D * p)
    first_or_last = np.zeros((P, 1, 1), dtype=bool)
    first_or_last[[0, -1]] = P > 1
    groups = np.zeros((P, D, T), dtype=int)
    with_new = np.zeros((P, D, T), dtype=int)
    for exists, holds_new in (
            (T > 1, grid.any(axis=2, keepdims=True)),  # tensor-parallel: one (stage, replica)
            (P > 1, grid.any(axis=0, keepdims=True)),  # pipeline: one (replica, tp rank)
            (D > 1, grid.any(axis=1, keepdims=True)),  # data-parallel: one (stage, tp rank)
            (first_or_last, (grid[0] | grid[-1])[None]),  # embedding: first + last stage
            (T * P > 1, grid.any(axis=(0, 2), keepdims=True)),  # model-parallel: one replica
            (T * P * D > 1, grid.any(keepdims=True))):  # the world
        groups += exists
        with_new += exists & holds_new
    return groups.ravel(), with_new.ravel()


class MigrationCostModel:
    """Seconds of training lost to a layout change, for one model on one kind of cluster."""

    def __init__(self, constants: CostConstants, shape: ModelShape):
        self.constants = constants
        self.shape = shape
        self._layer_params: dict[tuple[Parallelism, int], float] = {}
        self._state_bytes: dict[Parallelism, float] = {}
        self._same_chunk: dict[tuple[Parallelism, Parallelism], np.ndarray] = {}

    def layer_params(self, parallelism: Parallelism, stage: int) -> float:
        """Transformer-layer parameters held by one rank of `stage` (its TP share)."""
        key = (parallelism, stage)
        params = self._layer_params.get(key)
        if params is None:
            params = self._layer_params[key] = sum(
                u.split_params / parallelism.tp + u.replicated_params
                for u in parallelism.stage_units(self.shape, stage) if u.name.startswith("layer."))
        return params

    def groups_seconds(self, parallelism: Parallelism, joined: np.ndarray) -> float:
        """Seconds until every rank has its groups: the slowest rank's, as ranks form
        their own groups one after another and disjoint groups at once."""
        c = self.constants
        groups, with_new = rank_groups(parallelism, joined)
        return float((with_new * c.group_create_seconds_with_new_worker
                      + (groups - with_new) * c.group_create_seconds_survivors_only).max())

    def plan_cost(self, plan: MigrationPlan) -> MigrationCost:
        """Cost of carrying out `plan` in place; a restart when the grace period is too short."""
        c, old, new = self.constants, plan.request.old, plan.new
        if new == old:
            return NO_COST
        transfer, leaving = self._transfer_seconds(plan)
        stage_out = self.state_bytes(old.parallelism) / c.host_copy_bytes_per_second
        if stage_out + leaving > c.grace_period_seconds:
            return self.restart_cost(new.parallelism, joining=bool(new.workers - old.workers))
        workers = old.workers
        old_rank = np.array([old.rank_of(w) if w in workers else -1 for w in new.slots])
        joined = old_rank < 0
        stopped = bool(plan.request.lost)  # the old layout cannot train while joiners get ready
        rebuilds = self._rebuilds(old.parallelism, new.parallelism, old_rank)
        if not stopped:
            rebuilds &= ~joined  # idle joiners build before the switch
        stages = np.arange(new.parallelism.world_size) // (new.tp * new.dp)
        build = max((self.layer_params(new.parallelism, int(s)) for s in np.unique(stages[rebuilds])), default=0.0)
        return MigrationCost(c.world_init_seconds, self.groups_seconds(new.parallelism, joined),
                             build * c.model_build_seconds_per_param, transfer,
                             staging_seconds=stage_out + self.state_bytes(new.parallelism) / c.host_copy_bytes_per_second)

    def state_bytes(self, parallelism: Parallelism) -> float:
        """The most training state one rank of `parallelism` holds (its stage's TP share).
        A change stages it in host memory (reconfig/execute.py): out of the old layout
        before it is dropped, into the new one once built."""
        held = self._state_bytes.get(parallelism)
        if held is None:
            held = self._state_bytes[parallelism] = max(
                sum(u.split_params / parallelism.tp + u.replicated_params for u in parallelism.stage_units(self.shape, s))
                for s in range(parallelism.pp)) * self.shape.state_bytes_per_param
        return held

    def _transfer_seconds(self, plan: MigrationPlan) -> tuple[float, float]:
        """(seconds until every byte of `plan` has arrived, seconds until the leaving
        workers' bytes are out: their grace period must cover it). Bytes between instances
        load the NICs of both instances, bytes inside one the GPU links of both workers."""
        c, instance = self.constants, plan.request.placement.instance
        network: dict[tuple[str, bool], int] = {}  # (instance, sends) -> bytes through its NIC
        local: dict[tuple[int, bool], int] = {}  # (worker, sends) -> bytes over its instance's GPU links
        for (src, dst), nbytes in plan.bytes_by_link().items():
            here, there = instance(src), instance(dst)
            load, ends = (local, (src, dst)) if here == there else (network, (here, there))
            load[ends[0], True] = load.get((ends[0], True), 0) + nbytes
            load[ends[1], False] = load.get((ends[1], False), 0) + nbytes
        busiest = max(c.transfer_seconds(max(network.values(), default=0)),
                      c.intra_instance_seconds(max(local.values(), default=0)))
        leaving = max((max(c.transfer_seconds(network.get((instance(w), True), 0)),
                           c.intra_instance_seconds(local.get((w, True), 0))) for w in plan.request.leaving),
                      default=0.0)
        return busiest, leaving

    def _rebuilds(self, old: Parallelism, new: Parallelism, old_rank: np.ndarray) -> np.ndarray:
        """Per new rank: whether its worker builds a model chunk (it joins, or its stage's
        layers, its first/last role or its TP slice change)."""
        same_chunk = self._same_chunk.get((old, new))
        if same_chunk is None:
            def chunks(p: Parallelism) -> list[tuple]:
                return [(p.layers_of_stage(s), s == 0, s == p.pp - 1, p.tp) for s in range(p.pp)]

            old_chunks, new_chunks = chunks(old), chunks(new)
            same_chunk = np.array([[a == b for b in new_chunks] for a in old_chunks])  # (P_old, P_new)
            self._same_chunk[old, new] = same_chunk
        ranks = np.arange(new.world_size)
        new_stage, new_tp = ranks // (new.tp * new.dp), ranks % new.tp
        safe = np.maximum(old_rank, 0)
        keeps = (old_rank >= 0) & same_chunk[safe // (old.tp * old.dp), new_stage] & (safe % old.tp == new_tp)
        return ~keeps

    def restart_cost(self, target: Parallelism, joining: bool, cold: bool = False) -> MigrationCost:
        """Cost of stopping every process and resuming `target` from a checkpoint; `cold`:
        the job starts from a stored checkpoint (nothing runs, nothing to save, all join)."""
        c = self.constants
        groups = self.groups_seconds(target, np.full(target.world_size, joining or cold))
        return self._restart(target, joining or cold, groups, c.transfer_seconds(self.state_bytes(target)), cold)

    def reactive_restart_cost(self, target: Parallelism, joining: bool, cold: bool = False) -> MigrationCost:
        """A restart of Parcae's own engine, as its artifact prices its reactive baseline:
        DeepSpeed's D + P + 1 + D*P groups, every stage's state reloaded one after another."""
        c = self.constants
        joining = joining or cold
        rate = c.group_create_seconds_with_new_worker if joining else c.group_create_seconds_survivors_only
        groups = (target.dp + target.pp + 1 + target.dp * target.pp) * rate
        reload = sum(c.transfer_seconds(sum(u.params for u in target.stage_units(self.shape, s))
                                        * self.shape.state_bytes_per_param) for s in range(target.pp))
        return self._restart(target, joining, groups, reload, cold)

    def _restart(self, target: Parallelism, joining: bool, groups_seconds: float, reload_seconds: float,
                 cold: bool) -> MigrationCost:
        c = self.constants
        world = c.process_start_seconds + c.world_init_seconds + (c.rendezvous_seconds if joining else 0.0)
        build = max(self.layer_params(target, s) for s in range(target.pp)) * c.model_build_seconds_per_param
        save_load = 0.0 if cold else c.checkpoint_save_load_seconds
        return MigrationCost(world, groups_seconds, build, save_load + reload_seconds, restart=True)
