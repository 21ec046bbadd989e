"""What a layout change costs, in seconds of lost training, from the planner's plan.

Two ways to change layout are priced (the assumptions the constants encode):

In place (`MigrationCostModel.plan_cost`), what megatron-parcae's executor does; the
planner's `MigrationPlan` says who moves which bytes, and the time is
- world: releasing the old layout and re-initialising the world (`world_init_seconds`,
  a store handshake among processes that already run) whenever its members or slots change. No rendezvous
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
- model build: every worker of the new layout builds its model chunk, as the executor
  (reconfig/execute.py) drops the old layout and builds the new one on every change,
  `model_build_seconds_per_param` per parameter of its stage's transformer layers (each
  weight is drawn whole, then sliced for its TP rank; Parcae's build time is per layer;
  embeddings are single tensors, cheap to allocate); workers build in parallel, the
  slowest counts;
- state transfer: a byte between two instances crosses the network, where each
  instance's NIC carries what its workers send and what they receive (full duplex),
  timed by the measured p2p table (`p2p_bytes_to_microseconds`), or by the network the
  job's workers measure at its start (`CostConstants.on_network`); a byte between two
  workers of one instance (the plan's `placement` says which) crosses the instance's own
  GPU links (NVLink or PCIe), `intra_instance_bytes_per_second` for what each worker
  sends and for what it receives. Both kinds run side by side: the busiest NIC or GPU
  link sets the time. With one GPU per instance every byte takes the network;
- staging: held state goes to host memory before the old layout is dropped and into
  the new one once built (`host_copy_bytes_per_second`).
The executor does these one after another (every state is received before the new
layout is built), so the parts add up. They are the phases the executor times and each
change's event reports (reconfig/phases.py: export and import are the staging, build
the groups and the model): `phase_seconds` predicts each, and `fitted` gives the model
whose rates (seconds per byte, per group, per parameter, per change) are fitted on
measured phases (the live coordinator refits it after every change; a benchmark fits it
offline); a phase so fitted is priced at its rates, the others by the constants.
No process restarts, no checkpoint is read: an intra-stage change (a survivor takes a
lost rank's place, or D shrinks) moves no state.

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

`ParcaeCostModel` prices every change as Parcae's artifact does, from the same constants.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from reconfig import phases
from reconfig.layout import HEAD, POSITION_EMBEDDING, WORD_EMBEDDING, ModelShape, Parallelism, layer_unit
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

    def on_network(self, latency_seconds: float, bytes_per_second: float) -> CostConstants:
        """These constants on a network measured between the job's instances: the p2p table
        becomes a message's latency plus its bytes at the measured rate (two points, from
        one byte to a tebibyte, so `transfer_seconds` interpolates that line)."""
        sizes = (1, 2**40)
        return dataclasses.replace(self, p2p_bytes=sizes,
                                   p2p_seconds=tuple(latency_seconds + n / bytes_per_second for n in sizes))

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
    """Seconds a layout change takes, by part; `restart` when state had to come from a
    checkpoint. The parts happen one after another: held state goes to host memory and
    back (`staging_seconds`), state arrives, then the new layout is built."""

    world_seconds: float
    groups_seconds: float
    build_seconds: float
    transfer_seconds: float
    restart: bool = False
    staging_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.world_seconds + self.groups_seconds + self.staging_seconds + self.build_seconds
                + self.transfer_seconds)


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


PhaseRates = Mapping[str, Mapping[str, float]]  # phase -> quantity it grows with -> seconds per unit


class MigrationCostModel:
    """Seconds of training lost to a layout change, for one model on one kind of cluster;
    `phase_rates` (see `fitted`) price the phases of an in-place change they name."""

    # Whether a change always moves at least the state its new stages lack: the optimizer
    # prunes with that bound; Parcae's charges move bytes by their own rule and do not.
    moves_missing_state = True

    def __init__(self, constants: CostConstants, shape: ModelShape, phase_rates: PhaseRates | None = None):
        self.constants = constants
        self.shape = shape
        self.phase_rates = {phase: dict(rates) for phase, rates in (phase_rates or {}).items()}
        self._layer_params: dict[tuple[Parallelism, int], float] = {}
        self._state_bytes: dict[Parallelism, float] = {}

    def layer_params(self, parallelism: Parallelism, stage: int) -> float:
        """Transformer-layer parameters a rank of `stage` builds: all of them whatever its
        TP rank, as it draws every weight whole and keeps its slice
        (reconfig/tensors.initialize_deterministically)."""
        key = (parallelism, stage)
        params = self._layer_params.get(key)
        if params is None:
            params = self._layer_params[key] = sum(
                u.params for u in parallelism.stage_units(self.shape, stage) if u.name.startswith("layer."))
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
        old, new = plan.request.old, plan.new
        if new == old:
            return NO_COST
        terms, leaving = self._terms(plan)
        if terms[phases.EXPORT]["bytes"] + leaving > self.constants.grace_period_seconds:
            return self.restart_cost(new.parallelism, joining=bool(new.workers - old.workers))
        return MigrationCost(sum(terms[phases.WORLD].values()), terms[phases.BUILD]["groups"],
                             terms[phases.BUILD]["parameters"], sum(terms[phases.EXCHANGE].values()),
                             staging_seconds=terms[phases.EXPORT]["bytes"] + terms[phases.IMPORT]["bytes"])

    def phase_quantities(self, plan: MigrationPlan) -> dict[str, dict[str, float]]:
        """What each phase of carrying out `plan` in place grows with: the bytes of state
        one rank holds most of, in the old layout (export) and the new (import); one change
        (world: the old layout's release, WORLD, the agreement on progress); the bytes
        through the busiest NIC or GPU link (exchange); the groups of the busiest rank and
        the transformer-layer parameters of the largest stage (build)."""
        return self._phases(plan)[0]

    def phase_seconds(self, plan: MigrationPlan) -> dict[str, float]:
        """Seconds of each phase of carrying out `plan` in place (reconfig/phases.py), to
        set beside the phases its LayoutChange event reports; they add up to
        `plan_cost(plan).seconds` unless that is a restart."""
        return {phase: sum(seconds.values()) for phase, seconds in self._terms(plan)[0].items()}

    def _terms(self, plan: MigrationPlan) -> tuple[dict[str, dict[str, float]], float]:
        """(seconds of each phase by the quantity it grows with, seconds until the leaving
        workers' bytes are out): at a phase's fitted rates where it has them."""
        quantities, priced, leaving = self._phases(plan)
        for phase, rates in self.phase_rates.items():
            priced[phase] = {name: rates[name] * amount for name, amount in quantities[phase].items()}
        return priced, leaving

    def _phases(self, plan: MigrationPlan) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]], float]:
        """(the quantities of `phase_quantities`, their seconds as the constants price them
        (the p2p table, the two group rates), the leaving workers' seconds)."""
        c, old, new = self.constants, plan.request.old, plan.new
        network, local, busiest = self._link_loads(plan)
        transfer, leaving = self._transfer_seconds(plan, network, local)
        joined = np.array([w not in old.workers for w in new.slots])
        held_old, held_new = self.state_bytes(old.parallelism), self.state_bytes(new.parallelism)
        params = max(self.layer_params(new.parallelism, s) for s in range(new.pp))
        quantities = {phases.EXPORT: {"bytes": held_old}, phases.WORLD: {"changes": 1.0},
                      phases.EXCHANGE: {"bytes": float(busiest)},
                      phases.BUILD: {"groups": float(rank_groups(new.parallelism, joined)[0].max()),
                                     "parameters": params},
                      phases.IMPORT: {"bytes": held_new}}
        priced = {phases.EXPORT: {"bytes": held_old / c.host_copy_bytes_per_second},
                  phases.WORLD: {"changes": c.world_init_seconds},
                  phases.EXCHANGE: {"bytes": transfer},
                  phases.BUILD: {"groups": self.groups_seconds(new.parallelism, joined),
                                 "parameters": params * c.model_build_seconds_per_param},
                  phases.IMPORT: {"bytes": held_new / c.host_copy_bytes_per_second}}
        return quantities, priced, leaving

    def fitted(self, observed: Sequence[tuple[MigrationPlan, Mapping[str, float]]]) -> MigrationCostModel:
        """This model with the rates of each phase fitted on the measured phases of
        carried-out plans (a LayoutChange's `phases`), by non-negative least squares over
        all of them, whatever their kind. A phase keeps its price until its observations
        tell each of its rates apart: one change cannot split build's seconds between
        groups and parameters, and changes that move no byte say nothing of exchange's
        rate (a fit on them would make it free)."""
        rates: dict[str, dict[str, float]] = {}
        quantities = [self.phase_quantities(plan) for plan, _ in observed]
        for phase in phases.PHASES:
            rows = [(q[phase], measured[phase]) for q, (_, measured) in zip(quantities, observed) if phase in measured]
            if not rows:
                continue
            names = list(rows[0][0])
            matrix = np.array([[q[n] for n in names] for q, _ in rows])
            scale = np.linalg.norm(matrix, axis=0)  # bytes and groups differ by orders of magnitude
            if not scale.all() or np.linalg.matrix_rank(matrix / scale) < len(names):
                continue
            solution, _ = nnls(matrix / scale, np.array([seconds for _, seconds in rows]))
            rates[phase] = dict(zip(names, map(float, solution / scale)))
        return MigrationCostModel(self.constants, self.shape, {**self.phase_rates, **rates})

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

    def _link_loads(self, plan: MigrationPlan) -> tuple[dict[tuple[str, bool], int], dict[tuple[int, bool], int], int]:
        """(bytes through each instance's NIC by (instance, sends), bytes over each worker's
        GPU links by (worker, sends), the most of either). Bytes between instances load the
        NICs of both instances, bytes inside one the GPU links of both workers."""
        instance = plan.request.placement.instance
        network: dict[tuple[str, bool], int] = {}
        local: dict[tuple[int, bool], int] = {}
        for (src, dst), nbytes in plan.bytes_by_link().items():
            here, there = instance(src), instance(dst)
            load, ends = (local, (src, dst)) if here == there else (network, (here, there))
            load[ends[0], True] = load.get((ends[0], True), 0) + nbytes
            load[ends[1], False] = load.get((ends[1], False), 0) + nbytes
        return network, local, max([*network.values(), *local.values()], default=0)

    def _transfer_seconds(self, plan: MigrationPlan, network: dict[tuple[str, bool], int],
                          local: dict[tuple[int, bool], int]) -> tuple[float, float]:
        """(seconds until every byte of `plan` has arrived, seconds until the leaving
        workers' bytes are out: their grace period must cover it), from `_link_loads`."""
        c, instance = self.constants, plan.request.placement.instance
        busiest = max(c.transfer_seconds(max(network.values(), default=0)),
                      c.intra_instance_seconds(max(local.values(), default=0)))
        leaving = max((max(c.transfer_seconds(network.get((instance(w), True), 0)),
                           c.intra_instance_seconds(local.get((w, True), 0))) for w in plan.request.leaving),
                      default=0.0)
        return busiest, leaving

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


class ParcaeCostModel(MigrationCostModel):
    """The charges of Parcae's artifact (its liveput simulator), from the same constants:
    `--cost-model parcae`, so that liveput is compared with Parcae's on its own costs.

    Its engine (DeepSpeed, no tensor parallelism) restarts its communication on every
    change, and any change but an intra-stage one rebuilds every stage. An *engine
    restart* of layout (D, P) costs the rendezvous when workers join, the world's
    initialisation, D + P + 1 + D*P process groups one after another (at the new-worker
    rate when workers join, the survivors' rate otherwise), a process start and the
    model build (ceil(L / P) transformer layers' parameters at the per-parameter rate,
    plus one message of vocabulary x positions fp32 values). A change then costs:
    - intra-stage (same P, every stage keeps at least the new D replicas): the world's
      initialisation, the groups at the survivors' rate and a process start;
    - inter-stage (same P, some stage short of replicas): the largest stage that needs a
      replica sent, or the stages left with no replica (and the last stage, left with
      one) sent one after another if that is longer, plus an engine restart;
    - repartition (P changes): new stages in order take the free survivor that holds
      most of them (the first such in Parcae's order of nodes), and the bytes the last one
      is missing are charged, plus, when D > 1,
      the largest new stage sent to its replicas, plus an engine restart.
    Messages are timed by the p2p table, a stage's state (the model split as Parcae
    splits it, `stage_bytes`) by the model's bytes per parameter (12 for Parcae's
    tables: fp32 weights and Adam's two moments). Changes are
    priced in expectation over preemptions by the same scenarios as ours.
    """

    moves_missing_state = False

    def __init__(self, constants: CostConstants, shape: ModelShape):
        super().__init__(constants, shape)
        self._stage_bytes: dict[Parallelism, list[dict[str, float]]] = {}

    def stage_bytes(self, parallelism: Parallelism) -> list[dict[str, float]]:
        """Per stage: bytes of each block it holds, the model split as Parcae's engine
        splits it (not as megatron-core does): its blocks are the embeddings, each layer and
        the output layer (tied word embedding and head); with B blocks, every stage takes
        (B - 1) // P of them, the first one more, and the (B - 1) % P left over go one each
        to the stages before the last, nearest it first."""
        found = self._stage_bytes.get(parallelism)
        if found is None:
            if parallelism.tp != 1:
                raise ValueError(f"Parcae's cost model has no tensor parallelism (layout {parallelism})")
            shape, pp = self.shape, parallelism.pp
            output = shape.unit(HEAD).params + (shape.unit(WORD_EMBEDDING).params if shape.tied_embeddings else 0)
            blocks = [("embedding", shape.unit(WORD_EMBEDDING).params + shape.unit(POSITION_EMBEDDING).params)]
            blocks += [(name, shape.unit(name).params) for name in map(layer_unit, range(shape.num_layers))]
            blocks.append(("output", output))
            share, left = divmod(len(blocks) - 1, pp)
            counts = [share + (s == 0) + (pp - 1 - left <= s < pp - 1) for s in range(pp)]
            starts = np.cumsum([0] + counts)
            found = self._stage_bytes[parallelism] = [
                {name: params * shape.state_bytes_per_param for name, params in blocks[starts[s]:starts[s + 1]]}
                for s in range(pp)]
        return found

    def engine_groups(self, parallelism: Parallelism) -> int:
        """Process groups Parcae's engine creates, one after another."""
        return parallelism.dp + parallelism.pp + 1 + parallelism.dp * parallelism.pp

    def engine_restart(self, parallelism: Parallelism, joining: bool) -> MigrationCost:
        """What restarting Parcae's engine into `parallelism` costs, before any state moves."""
        c = self.constants
        rate = c.group_create_seconds_with_new_worker if joining else c.group_create_seconds_survivors_only
        world = (c.rendezvous_seconds if joining else 0.0) + c.world_init_seconds + c.process_start_seconds
        # Parcae builds ceil(layers / P) layers per stage, whatever its split of the state
        layers = math.ceil(self.shape.num_layers / parallelism.pp) * self.shape.unit(layer_unit(0)).params
        build = layers * c.model_build_seconds_per_param + c.transfer_seconds(
            self.shape.vocab_size * self.shape.max_position_embeddings * 4)
        return MigrationCost(world, self.engine_groups(parallelism) * rate, build, 0.0)

    def plan_cost(self, plan: MigrationPlan) -> MigrationCost:
        """Parcae's charge for the change `plan` makes (who moves which bytes is Parcae's
        rule, not the plan's)."""
        c, old, new = self.constants, plan.request.old, plan.new
        if new == old:
            return NO_COST
        before, after = old.parallelism, new.parallelism
        survivors = plan.request.survivors
        # each survivor's old stage, in Parcae's order of nodes: replica by replica, stage by stage
        held = [s.pp for s in sorted((before.slot(old.rank_of(w)) for w in survivors), key=lambda s: (s.dp, s.pp))]
        if after.pp == before.pp and after.stage_layers == before.stage_layers:
            replicas = np.bincount(held, minlength=before.pp)
            if replicas.min() >= after.dp:
                return MigrationCost(c.world_init_seconds + c.process_start_seconds,
                                     self.engine_groups(after) * c.group_create_seconds_survivors_only, 0.0, 0.0)
            sizes = [c.transfer_seconds(sum(units.values())) for units in self.stage_bytes(after)]
            short = [s for s in range(after.pp) if replicas[s] < after.dp]
            emptied = [s for s in short if replicas[s] == 0 or (s == after.pp - 1 and replicas[s] == 1)]
            transfer = max(max(sizes[s] for s in short), sum(sizes[s] for s in emptied))
        else:
            old_stages, new_stages = self.stage_bytes(before), self.stage_bytes(after)
            free = [old_stages[s] for s in held]
            lacking = 0.0
            for units in new_stages:  # each new stage takes the free survivor holding most of it
                total = sum(units.values())
                kept = [sum(b for name, b in units.items() if name in have) for have in free]
                lacking = total - max(kept, default=0.0)
                if kept:
                    free.pop(int(np.argmax(kept)))
            transfer = c.transfer_seconds(lacking)  # the artifact charges the last stage's bytes
            if after.dp > 1:
                transfer += max(c.transfer_seconds(sum(units.values())) for units in new_stages)
        restart = self.engine_restart(after, joining=after.world_size > len(survivors))
        return dataclasses.replace(restart, transfer_seconds=transfer)

    def restart_cost(self, target: Parallelism, joining: bool, cold: bool = False) -> MigrationCost:
        """A cold start is a repartition from nothing: an engine restart with every worker
        joining, plus the largest stage sent to its replicas when D > 1. State lost without
        notice (which Parcae's simulator never meets) adds saving and loading a checkpoint
        and reading the largest stage's state."""
        c = self.constants
        largest = max(c.transfer_seconds(sum(units.values())) for units in self.stage_bytes(target))
        if cold:
            reload = largest if target.dp > 1 else 0.0
        else:
            reload = c.checkpoint_save_load_seconds + largest
        return dataclasses.replace(self.engine_restart(target, joining or cold), transfer_seconds=reload, restart=True)


COST_MODELS = {"megatron-parcae": MigrationCostModel, "parcae": ParcaeCostModel}
