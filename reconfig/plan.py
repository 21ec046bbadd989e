"""Migration plans: which worker takes which slot, and who sends whom which state.

The planner turns (old layout, who survives / leaves with notice / joins, target
parallelism) into a `MigrationPlan`: the worker -> slot assignment that moves the fewest
bytes (min-cost matching, as SpotServe does) and, for every destination, the slices of
every state unit it lacks, each from exactly one live holder. The executor follows the
plan; the liveput cost model reads its byte counts; both get it as JSON through etcd.

Geometry of a state unit (see layout.StateUnit): its split tensors are a unit square,
axis 0 the TP-partitioned dimension (TP rank t of T holds [t/T, (t+1)/T)), axis 1 the
rest, flattened; its replicated params are the segment [0, 1) of axis 1. Parameters (and,
with the plain optimizer, the optimizer state with them) are replicated over DP. With the
distributed optimizer the optimizer state is sharded over DP along axis 1: DP rank d of
D holds [d/D, (d+1)/D) of it, of the split and of the replicated part. Megatron's own
shards follow its flattened gradient buckets; the executor maps between the two inside a
(stage, tp) column, which needs every member of the column alive, as here.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from reconfig.layout import (
    Layout,
    ModelShape,
    Parallelism,
    StateUnit,
    require_fields,
    require_int,
)
from reconfig.placement import ONE_GPU, Placement

PARAMS_AND_OPTIMIZER = "params+optimizer"
PARAMS = "params"
OPTIMIZER = "optimizer"
STATES = (PARAMS_AND_OPTIMIZER, PARAMS, OPTIMIZER)
# Kinds, from cheapest to costliest. When T and P both change the plan is "tensor":
# every split tensor is re-sliced, which dominates re-cutting the stages.
MIGRATION_KINDS = ("none", "intra-stage", "inter-stage", "pipeline", "tensor")


class LostStateError(ValueError):
    """A state unit has no live holder: the job must resume from a checkpoint."""

    def __init__(self, lost_units: tuple[str, ...], state: str, lost_workers: tuple[int, ...]):
        self.lost_units = lost_units
        self.state = state
        self.lost_workers = lost_workers
        super().__init__(f"{_describe_units(lost_units)} lost ({state}): no surviving replica and no notice "
                         f"(workers lost without notice: {', '.join(map(str, lost_workers)) or 'none'})")


def _describe_units(names: Iterable[str]) -> str:
    """'layers 4-7, 9, head' from unit names: short enough for a log line."""
    layers = sorted(int(n.split(".")[1]) for n in names if n.startswith("layer."))
    runs: list[list[int]] = []  # [first, last] of each run of consecutive layers
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    parts = [f"layer{'s' if len(layers) > 1 else ''} {text}"] if layers else []
    return ", ".join(parts + sorted(n for n in names if not n.startswith("layer.")))


def _worker_set(where: str, value: Any) -> frozenset[int]:
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"{where}: expected a list of worker ids, got {type(value).__name__}")
    return frozenset(require_int(f"{where} entry", w, 0) for w in value)


@dataclass(frozen=True)
class Copies:
    """Snapshots of the old layout's state in its workers' host memory (reconfig/copies.py):
    each worker keeps its own and its ward's, taken together every few steps, and
    `holder[w]` (on another instance) keeps worker w's. A plan recovering from them rolls
    every survivor back to the newest snapshot of `generation` they all hold, and fills a
    lost worker's slices from its holder."""

    generation: int
    holder: Mapping[int, int]

    def __post_init__(self) -> None:
        require_int("copies.generation", self.generation, 1)
        if not isinstance(self.holder, Mapping):
            raise ValueError(f"copies.holder: expected an object, got {type(self.holder).__name__}")
        checked = {require_int("copies.holder key", w, 0): require_int(f"copies.holder[{w}]", h, 0)
                   for w, h in self.holder.items()}
        if any(w == h for w, h in checked.items()):
            raise ValueError("copies.holder: a worker cannot hold its own copy")
        object.__setattr__(self, "holder", checked)

    def to_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "holder": [[w, h] for w, h in sorted(self.holder.items())]}

    @classmethod
    def from_dict(cls, d: Any) -> Copies:
        require_fields("copies", d, {"generation", "holder"})
        pairs = d["holder"]
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise ValueError("copies.holder: expected a list of [worker, holder] pairs")
        return cls(d["generation"], {w: h for w, h in pairs})


@dataclass(frozen=True)
class MigrationRequest:
    """What happened to the old layout's workers. Old workers in no set were lost without
    notice; workers that hold no state (new arrivals, last generation's standbys) join.
    With `copies`, the state comes from the old layout's snapshots (see Copies), not from
    what the workers hold now."""

    old: Layout
    survivors: frozenset[int]
    leaving: frozenset[int]  # may send during their grace period, then exit
    joining: frozenset[int]
    distributed_optimizer: bool = False
    placement: Placement = ONE_GPU  # instances of the workers: blocks of ranks stay on one
    copies: Copies | None = None

    def __post_init__(self) -> None:
        if self.copies is not None and not isinstance(self.copies, Copies):
            raise ValueError(f"request.copies: expected Copies, got {type(self.copies).__name__}")
        if not isinstance(self.old, Layout):
            raise ValueError(f"request.old: expected a Layout, got {type(self.old).__name__}")
        if not isinstance(self.placement, Placement):
            raise ValueError(f"request.placement: expected a Placement, got {type(self.placement).__name__}")
        for name in ("survivors", "leaving", "joining"):
            object.__setattr__(self, name, _worker_set(f"request.{name}", getattr(self, name)))
        if not isinstance(self.distributed_optimizer, bool):
            raise ValueError(f"request.distributed_optimizer: expected true or false, "
                             f"got {self.distributed_optimizer!r}")
        old = self.old.workers
        for name in ("survivors", "leaving"):
            stray = getattr(self, name) - old
            if stray:
                raise ValueError(f"request.{name}: worker(s) {sorted(stray)} have no slot in the old layout")
        if self.survivors & self.leaving:
            raise ValueError(f"request: worker(s) {sorted(self.survivors & self.leaving)} both survive and leave")
        if self.joining & old:
            raise ValueError(f"request.joining: worker(s) {sorted(self.joining & old)} hold a slot in the old "
                             f"layout; list them as survivors")

    @property
    def lost(self) -> frozenset[int]:
        return self.old.workers - self.survivors - self.leaving

    @property
    def available(self) -> frozenset[int]:
        """Workers that can take a slot in the new layout."""
        return self.survivors | self.joining

    def to_dict(self) -> dict[str, Any]:
        return {"old": self.old.to_dict(), "survivors": sorted(self.survivors), "leaving": sorted(self.leaving),
                "joining": sorted(self.joining), "distributed_optimizer": self.distributed_optimizer,
                "placement": self.placement.to_dict(),
                **({} if self.copies is None else {"copies": self.copies.to_dict()})}

    @classmethod
    def from_dict(cls, d: Any) -> MigrationRequest:
        require_fields("request", d, {"old", "survivors", "leaving", "joining", "distributed_optimizer", "placement"},
                       frozenset({"copies"}))
        copies = Copies.from_dict(d["copies"]) if "copies" in d else None
        return cls(Layout.from_dict(d["old"]), d["survivors"], d["leaving"], d["joining"],
                   d["distributed_optimizer"], Placement.from_dict(d["placement"]), copies)

    def sender(self, worker: int) -> tuple[int, int | None] | None:
        """Who can send the state of the old layout's `worker`: (sender, None) for itself,
        alive; (holder, worker) for the holder of its copy; None when it is lost."""
        if worker in self.survivors or worker in self.leaving:
            return worker, None
        holder = None if self.copies is None else self.copies.holder.get(worker)
        if holder is not None and (holder in self.survivors or holder in self.leaving):
            return holder, worker
        return None


Range = tuple[Fraction, Fraction]
_FRACTION = re.compile(r"^\d+(/[1-9]\d*)?$")


def _range_to_json(r: Range) -> list[str]:
    return [f"{f.numerator}/{f.denominator}" for f in r]


def _range_from_json(where: str, value: Any) -> Range:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, str) and _FRACTION.match(v) for v in value)):
        raise ValueError(f"{where}: expected [\"a/b\", \"c/d\"], got {value!r}")
    lo, hi = Fraction(value[0]), Fraction(value[1])
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"{where}: {value[0]}..{value[1]} is not a non-empty part of [0, 1]")
    return lo, hi


@dataclass(frozen=True)
class Transfer:
    """One message: `src` sends `dst` a slice of one state unit.

    The slice is split_range (axis 0, the TP-partitioned dimension; None when no split
    tensor goes) x shard_range (axis 1; (0, 1) except for distributed-optimizer shards),
    plus the shard_range part of the replicated params when `replicated`.
    """

    src: int
    dst: int
    unit: str
    state: str  # PARAMS_AND_OPTIMIZER (plain optimizer), PARAMS or OPTIMIZER (distributed)
    split_range: Range | None
    shard_range: Range
    replicated: bool
    nbytes: int
    copy_of: int | None = None  # src sends from its copy of this lost worker's state

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "unit": self.unit, "state": self.state,
                "split_range": None if self.split_range is None else _range_to_json(self.split_range),
                "shard_range": _range_to_json(self.shard_range), "replicated": self.replicated,
                "nbytes": self.nbytes, **({} if self.copy_of is None else {"copy_of": self.copy_of})}

    @classmethod
    def from_dict(cls, d: Any, where: str = "transfer") -> Transfer:
        require_fields(where, d, set(cls.__dataclass_fields__) - {"copy_of"}, frozenset({"copy_of"}))
        if not isinstance(d["unit"], str) or not d["unit"]:
            raise ValueError(f"{where}.unit: expected a unit name, got {d['unit']!r}")
        if d["state"] not in STATES:
            raise ValueError(f"{where}.state: expected one of {', '.join(STATES)}, got {d['state']!r}")
        if not isinstance(d["replicated"], bool):
            raise ValueError(f"{where}.replicated: expected true or false, got {d['replicated']!r}")
        split = None if d["split_range"] is None else _range_from_json(f"{where}.split_range", d["split_range"])
        if split is None and not d["replicated"]:
            raise ValueError(f"{where}: sends neither split nor replicated params")
        return cls(require_int(f"{where}.src", d["src"], 0), require_int(f"{where}.dst", d["dst"], 0), d["unit"],
                   d["state"], split, _range_from_json(f"{where}.shard_range", d["shard_range"]), d["replicated"],
                   require_int(f"{where}.nbytes", d["nbytes"], 0),
                   None if d.get("copy_of") is None else require_int(f"{where}.copy_of", d["copy_of"], 0))


@dataclass(frozen=True)
class MigrationPlan:
    request: MigrationRequest
    new: Layout
    transfers: tuple[Transfer, ...]
    kind: str
    uses_grace_period: bool  # some transfer comes from a leaving worker

    @property
    def standby(self) -> frozenset[int]:
        """Available workers left without a slot: they hold nothing and wait."""
        return self.request.available - self.new.workers

    def bytes_total(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def bytes_by_link(self) -> dict[tuple[int, int], int]:
        links: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            links[t.src, t.dst] = links.get((t.src, t.dst), 0) + t.nbytes
        return links

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request.to_dict(), "new": self.new.to_dict(), "kind": self.kind,
                "uses_grace_period": self.uses_grace_period, "transfers": [t.to_dict() for t in self.transfers]}

    @classmethod
    def from_dict(cls, d: Any) -> MigrationPlan:
        require_fields("plan", d, {"request", "new", "kind", "uses_grace_period", "transfers"})
        request, new = MigrationRequest.from_dict(d["request"]), Layout.from_dict(d["new"])
        if d["kind"] not in MIGRATION_KINDS:
            raise ValueError(f"plan.kind: expected one of {', '.join(MIGRATION_KINDS)}, got {d['kind']!r}")
        if not isinstance(d["transfers"], list):
            raise ValueError(f"plan.transfers: expected a list, got {type(d['transfers']).__name__}")
        transfers = tuple(Transfer.from_dict(t, f"plan.transfers[{i}]") for i, t in enumerate(d["transfers"]))
        _check_workers(request, new)
        senders = request.survivors | request.leaving
        for i, t in enumerate(transfers):
            if t.src not in senders:
                raise ValueError(f"plan.transfers[{i}].src: worker {t.src} is neither a survivor nor leaving")
            if t.dst not in new.workers:
                raise ValueError(f"plan.transfers[{i}].dst: worker {t.dst} has no slot in the new layout")
            if t.copy_of is not None and request.sender(t.copy_of) != (t.src, t.copy_of):
                raise ValueError(f"plan.transfers[{i}].copy_of: worker {t.src} holds no copy of worker {t.copy_of} "
                                 "that the request lets it send")
        grace = any(t.src in request.leaving for t in transfers)
        if d["uses_grace_period"] is not grace:
            raise ValueError(f"plan.uses_grace_period: is {d['uses_grace_period']!r}, the transfers say {grace}")
        return cls(request, new, transfers, d["kind"], grace)


def _check_workers(request: MigrationRequest, new: Layout) -> None:
    unavailable = new.workers - request.available
    if unavailable:
        raise ValueError(f"new layout: worker(s) {sorted(unavailable)} are neither survivors nor joining")
    request.placement.check(new)


@dataclass(frozen=True)
class _State:
    """One kind of per-parameter state and how it is spread over DP."""

    name: str
    bytes_per_param: int
    sharded: bool  # distributed-optimizer state: sharded over DP along axis 1


def _states(shape: ModelShape, distributed_optimizer: bool) -> tuple[_State, ...]:
    if distributed_optimizer:
        return (_State(PARAMS, shape.param_bytes_per_param, False),
                _State(OPTIMIZER, shape.optimizer_bytes_per_param, True))
    return (_State(PARAMS_AND_OPTIMIZER, shape.state_bytes_per_param, False),)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


def _cell_overlaps(old_cells: int, new_cells: int, grid: int) -> np.ndarray:
    """[i, j]: length of old cell i within new cell j, as a fraction of the axis."""
    positions = np.arange(grid)
    hits = np.zeros((old_cells, new_cells))
    np.add.at(hits, (positions * old_cells // grid, positions * new_cells // grid), 1.0 / grid)
    return hits


class _Piece(NamedTuple):
    """A slice a destination lacks, inside one old cell, so any holder of the cell can send it."""

    unit: str
    state: str
    split: tuple[int, int] | None  # axis-0 range in 1/split_grid units; None: no split tensor
    split_grid: int
    shard: tuple[int, int]  # axis-1 range in 1/shard_grid units
    shard_grid: int
    replicated: bool
    holder_key: tuple  # (old stages holding the unit, tp or None for any, dp shard or None for any)
    nbytes: int


class _Migration:
    """Facts shared by the matching and the transfer listing of one old -> new change.

    Coordinates are integers: axis 0 in units of 1/lcm(T_old, T_new), axis 1 of a sharded
    state in units of 1/lcm(D_old, D_new), so cell overlaps are exact.
    """

    def __init__(self, request: MigrationRequest, new: Parallelism, shape: ModelShape):
        self.request, self.new, self.shape = request, new, shape
        self.old = request.old.parallelism
        shape.check(self.old)
        shape.check(new)
        self.states = _states(shape, request.distributed_optimizer)
        self.g0 = math.lcm(self.old.tp, new.tp)
        self.g1 = math.lcm(self.old.dp, new.dp) if request.distributed_optimizer else 1
        self.old_units = [self.old.stage_units(shape, s) for s in range(self.old.pp)]
        self.new_units = [new.stage_units(shape, s) for s in range(new.pp)]
        self.old_unit_names = [frozenset(u.name for u in units) for units in self.old_units]
        holders: dict[str, list[int]] = {}
        for stage, units in enumerate(self.old_units):
            for u in units:
                holders.setdefault(u.name, []).append(stage)
        self.holding_stages = {name: tuple(stages) for name, stages in holders.items()}
        # Class of a worker: (stage, tp, dp) of its slot; dp matters only for sharded state.
        self.old_dp_classes = self.old.dp if request.distributed_optimizer else 1
        self.new_dp_classes = new.dp if request.distributed_optimizer else 1
        # A snapshot holds its DP column's whole state (distributed-optimizer shards gathered).
        self.whole_over_dp = request.copies is not None

    def check_not_lost(self) -> None:
        old, request = self.old, self.request
        alive = np.array([request.sender(w) is not None for w in request.old.slots])
        alive = alive.reshape(old.pp, old.dp, old.tp)  # rank = t + T*(d + D*p)
        for state in self.states:
            covered: dict[tuple[tuple[int, ...], bool], bool] = {}  # units of a stage share the answer
            lost = []
            for name, stages in self.holding_stages.items():
                key = (stages, self.shape.unit(name).split_params == 0)
                if key not in covered:
                    cells = alive[list(stages)].any(axis=0)  # (D, T): some holding stage has it
                    if key[1]:
                        cells = cells.any(axis=1, keepdims=True)  # any TP rank holds it whole
                    if not state.sharded or self.whole_over_dp:
                        cells = cells.any(axis=0, keepdims=True)  # any DP replica will do
                    covered[key] = bool(cells.all())
                if not covered[key]:
                    lost.append(name)
            if lost:
                raise LostStateError(tuple(lost), state.name, tuple(sorted(request.lost)))

    def old_class(self, worker: int) -> int:
        """Index of the worker's old (stage, tp, dp-shard); the last index means 'holds nothing'."""
        if worker not in self.request.survivors:
            return self.old.pp * self.old.tp * self.old_dp_classes
        slot = self.request.old.slot_of(worker)
        return (slot.pp * self.old.tp + slot.tp) * self.old_dp_classes + slot.dp % self.old_dp_classes

    def new_classes(self) -> np.ndarray:
        """New class index of every rank of the new layout."""
        ranks = np.arange(self.new.world_size)
        tp, dp, pp = ranks % self.new.tp, (ranks // self.new.tp) % self.new.dp, ranks // (self.new.tp * self.new.dp)
        return (pp * self.new.tp + tp) * self.new_dp_classes + dp % self.new_dp_classes

    def class_costs(self) -> np.ndarray:
        """Bytes a worker of old class o must receive to fill a slot of new class n.

        Needed bytes minus what it keeps; from stage x stage sums of unit sizes and
        per-axis cell overlaps, so its size is classes x classes, not workers x slots.
        """
        names = [u.name for u in self.shape.units()]
        index = {n: i for i, n in enumerate(names)}
        split = np.array([self.shape.unit(n).split_params for n in names], dtype=float)
        repl = np.array([self.shape.unit(n).replicated_params for n in names], dtype=float)

        def membership(stage_units: list[tuple[StateUnit, ...]]) -> np.ndarray:
            m = np.zeros((len(stage_units), len(names)))
            for s, units in enumerate(stage_units):
                m[s, [index[u.name] for u in units]] = 1.0
            return m

        a_old, a_new = membership(self.old_units), membership(self.new_units)
        kept_split, kept_repl = (a_old * split) @ a_new.T, (a_old * repl) @ a_new.T  # (P_old, P_new)
        need_split, need_repl = a_new @ split, a_new @ repl
        ov0 = _cell_overlaps(self.old.tp, self.new.tp, self.g0)
        po, to, do = self.old.pp, self.old.tp, self.old_dp_classes
        pn, tn, dn = self.new.pp, self.new.tp, self.new_dp_classes
        kept = np.zeros((po, to, do, pn, tn, dn))
        need = np.zeros((pn, tn, dn))
        for state in self.states:
            ov1 = (_cell_overlaps(self.old.dp, self.new.dp, self.g1) if state.sharded
                   else np.ones((do, dn)))
            share = 1.0 / self.new.dp if state.sharded else 1.0
            need += state.bytes_per_param * share * (need_split / tn + need_repl)[:, None, None]
            kept += state.bytes_per_param * (
                kept_split[:, None, None, :, None, None] * ov0[None, :, None, None, :, None]
                + kept_repl[:, None, None, :, None, None]) * ov1[None, None, :, None, None, :]
        costs = need.reshape(1, -1) - kept.reshape(po * to * do, pn * tn * dn)
        return np.rint(np.vstack([costs, need.reshape(1, -1)]))  # last row: holds nothing

    def pieces(self, old_class: int, new_class: int) -> list[_Piece]:
        """What a worker of `old_class` lacks in a slot of `new_class`, cut along old cells."""
        old, new = self.old, self.new
        holds_nothing = old_class == old.pp * old.tp * self.old_dp_classes
        o_stage, rest = divmod(old_class, old.tp * self.old_dp_classes)
        o_tp, o_dp = divmod(rest, self.old_dp_classes)
        n_stage, rest = divmod(new_class, new.tp * self.new_dp_classes)
        n_tp, n_dp = divmod(rest, self.new_dp_classes)
        g0, c0 = self.g0, self.g0 // old.tp
        need0 = (n_tp * g0 // new.tp, (n_tp + 1) * g0 // new.tp)
        out = []
        for unit in self.new_units[n_stage]:
            held = not holds_nothing and unit.name in self.old_unit_names[o_stage]
            stages = self.holding_stages[unit.name]
            for state in self.states:
                g1 = self.g1 if state.sharded else 1
                if state.sharded:
                    c1 = g1 // old.dp
                    need1 = (n_dp * g1 // new.dp, (n_dp + 1) * g1 // new.dp)
                    cells1 = range(need1[0] // c1, (need1[1] - 1) // c1 + 1)
                else:
                    c1, need1, cells1 = 1, (0, 1), range(1)
                den = g0 * g1
                for d in cells1:
                    r1 = _overlap(need1, (d * c1, (d + 1) * c1))
                    dp_key = d if state.sharded else None
                    same_shard = not state.sharded or d == o_dp or self.whole_over_dp
                    repl_pending = unit.replicated_params > 0 and not (held and same_shard)
                    repl_num = unit.replicated_params * state.bytes_per_param * (r1[1] - r1[0]) * g0
                    if unit.split_params:
                        for t in range(need0[0] // c0, (need0[1] - 1) // c0 + 1):
                            if held and same_shard and t == o_tp:
                                continue  # kept in place
                            r0 = _overlap(need0, (t * c0, (t + 1) * c0))
                            num = unit.split_params * state.bytes_per_param * (r0[1] - r0[0]) * (r1[1] - r1[0])
                            num += repl_num if repl_pending else 0
                            out.append(_Piece(unit.name, state.name, r0, g0, r1, g1, repl_pending,
                                              (stages, t, dp_key), (2 * num + den) // (2 * den)))
                            repl_pending = False
                    if repl_pending:  # a unit without split tensors: any TP rank holds it
                        out.append(_Piece(unit.name, state.name, None, g0, r1, g1, True, (stages, None, dp_key),
                                          (2 * repl_num + den) // (2 * den)))
        return out

    def holders(self, key: tuple) -> list[tuple[int, int | None]]:
        """(sender, copy_of) of every live holder of the cell `key` = (stages, tp|None, dp|None)
        (request.sender)."""
        stages, tp, dp = key
        old, layout, request = self.old, self.request.old, self.request
        tps = range(old.tp) if tp is None else (tp,)
        dps = range(old.dp) if dp is None or self.whole_over_dp else (dp,)
        found = (request.sender(layout.slots[t + old.tp * (d + old.dp * s)]) for s in stages for t in tps for d in dps)
        return [h for h in found if h is not None]


class _SenderPicker:
    """Least-loaded live holder, on the receiver's instance before the network, survivors
    before leaving workers (whose time is short)."""

    def __init__(self, migration: _Migration):
        self.migration = migration
        self.leaving = migration.request.leaving
        self.instance = migration.request.placement.instance
        self.load: dict[int, int] = {}
        self.heaps: dict[tuple, list[tuple[bool, bool, int, int]]] = {}

    def pick(self, key: tuple, nbytes: int, receiver: int) -> tuple[int, int | None]:
        """(sender, copy_of) for a slice of the cell `key` that `receiver` lacks."""
        here = self.instance(receiver)
        heap = self.heaps.get((key, here))
        if heap is None:
            heap = [(self.instance(w) != here, w in self.leaving, 0, w, -1 if of is None else of)
                    for w, of in self.migration.holders(key)]
            heapq.heapify(heap)
            self.heaps[key, here] = heap
        while True:  # entries go stale when their worker sends for another cell
            remote, leaving, load, worker, of = heap[0]
            current = self.load.get(worker, 0)
            if load == current:
                break
            heapq.heapreplace(heap, (remote, leaving, current, worker, of))
        self.load[worker] = current + nbytes
        heapq.heapreplace(heap, (remote, leaving, current + nbytes, worker, of))
        return worker, None if of < 0 else of


def _fractions(cache: dict, r: tuple[int, int], grid: int) -> Range:
    key = (r, grid)
    found = cache.get(key)
    if found is None:
        found = cache[key] = (Fraction(r[0], grid), Fraction(r[1], grid))
    return found


def plan_transfers(request: MigrationRequest, new: Layout, shape: ModelShape) -> MigrationPlan:
    """The plan for a given worker -> slot assignment (plan_migration chooses one).

    Raises LostStateError when some state has no live holder, ValueError on inconsistent
    input (a worker in `new` that is neither surviving nor joining, a model that does not fit).
    """
    _check_workers(request, new)
    migration = _Migration(request, new.parallelism, shape)
    migration.check_not_lost()
    return _list_transfers(migration, new)


def _list_transfers(migration: _Migration, new: Layout) -> MigrationPlan:
    request = migration.request
    picker = _SenderPicker(migration)
    new_classes = migration.new_classes()
    pieces: dict[tuple[int, int], list[_Piece]] = {}
    ranges: dict = {}
    transfers = []
    for rank, dst in enumerate(new.slots):
        classes = (migration.old_class(dst), int(new_classes[rank]))
        if classes not in pieces:
            pieces[classes] = migration.pieces(*classes)
        for p in pieces[classes]:
            src, copy_of = picker.pick(p.holder_key, p.nbytes, dst)
            transfers.append(Transfer(src, dst, p.unit, p.state,
                                      None if p.split is None else _fractions(ranges, p.split, p.split_grid),
                                      _fractions(ranges, p.shard, p.shard_grid), p.replicated, p.nbytes, copy_of))
    return MigrationPlan(request, new, tuple(transfers), _classify(request.old, new, transfers),
                         any(t.src in request.leaving for t in transfers))


def _classify(old: Layout, new: Layout, transfers: list[Transfer]) -> str:
    po, pn = old.parallelism, new.parallelism
    if po.tp != pn.tp:
        return "tensor"
    if po.stage_layers != pn.stage_layers:
        return "pipeline"
    if transfers:
        return "inter-stage"
    return "none" if old == new else "intra-stage"


def plan_migration(request: MigrationRequest, target: Parallelism, shape: ModelShape) -> MigrationPlan:
    """Move the job to `target`, choosing the worker -> slot assignment that moves the fewest bytes.

    Ties go to workers keeping their old rank, then to survivors over joining workers,
    so Megatron ranks stay put when nothing is gained by moving them. Available workers
    beyond target's world size are left on standby.
    """
    if not isinstance(target, Parallelism):
        raise ValueError(f"target: expected a Parallelism, got {type(target).__name__}")
    available = len(request.available)
    if available < target.world_size:
        raise ValueError(f"target {target.tp}x{target.pp}x{target.dp} (tp x pp x dp) needs {target.world_size} "
                         f"workers, only {available} are available (survivors and joining)")
    migration = _Migration(request, target, shape)
    migration.check_not_lost()
    candidates = sorted(request.survivors) + sorted(request.joining)
    if request.placement.gpus_per_instance == 1:
        slots = _match(migration, candidates, range(target.world_size))
    else:
        slots = _match_blocks(migration, candidates)
    return _list_transfers(migration, Layout(target, tuple(slots[r] for r in range(target.world_size))))


def _match(migration: _Migration, workers: list[int], ranks: range) -> dict[int, int]:
    """rank -> worker: the min-cost matching of `workers` to `ranks` of the new layout."""
    # Imported here: scipy.optimize costs every process that parses arguments 0.6 s.
    from scipy.optimize import linear_sum_assignment

    request = migration.request
    row_class = np.array([migration.old_class(w) for w in workers])
    cost = migration.class_costs()[row_class[:, None], migration.new_classes()[None, ranks.start:ranks.stop]]
    old_rank = np.array([request.old.rank_of(w) if w in request.survivors else -1 for w in workers])
    tie_break = np.where(old_rank < 0, 2.0, 1.0)[:, None] - (old_rank[:, None] == np.arange(ranks.start, ranks.stop))
    rows, cols = linear_sum_assignment(cost * 4.0 + tie_break)
    return {ranks.start + c: workers[r] for r, c in zip(rows, cols)}


def _match_blocks(migration: _Migration, candidates: list[int]) -> dict[int, int]:
    """rank -> worker with every placement block on one instance: instances are matched to
    blocks by the bytes their workers would receive (priced per pattern of old and new
    classes, so a thousand instances cost no more than a few patterns), then each chosen
    instance's workers to its block's ranks."""
    from scipy.optimize import linear_sum_assignment

    request, placement = migration.request, migration.request.placement
    if not placement.fits(migration.new):
        raise ValueError(f"tensor-parallel size {migration.new.tp} does not divide the "
                         f"{placement.gpus_per_instance} GPUs of an instance")
    instances = list(placement.instances(candidates).values())
    blocks = placement.blocks(migration.new.world_size)
    if len(instances) < len(blocks):
        raise ValueError(f"target needs {len(blocks)} instances, only {len(instances)} are available")
    class_costs, new_classes = migration.class_costs(), migration.new_classes()
    patterns: dict[tuple, float] = {}

    def bytes_needed(workers: list[int], block: range) -> float:
        old = tuple(sorted(migration.old_class(w) for w in workers))
        new = tuple(sorted(int(c) for c in new_classes[block.start:block.stop]))
        key = (old, new)
        if key not in patterns:
            sub = class_costs[np.array(old)[:, None], np.array(new)[None, :]]
            rows, cols = linear_sum_assignment(sub)
            patterns[key] = float(sub[rows, cols].sum())
        return patterns[key]

    unfit = float(class_costs.sum() * migration.new.world_size + 1.0) * 4.0 + 4.0 * len(candidates)
    cost = np.full((len(instances), len(blocks)), unfit)
    for i, workers in enumerate(instances):
        old_blocks = [placement.block(request.old.rank_of(w)) if w in request.survivors else -1 for w in workers]
        newcomer = 2.0 * sum(b < 0 for b in old_blocks) + sum(b >= 0 for b in old_blocks)
        for b, block in enumerate(blocks):
            if len(workers) >= len(block):
                cost[i, b] = bytes_needed(workers, block) * 4.0 + newcomer - old_blocks.count(b)
    rows, cols = linear_sum_assignment(cost)
    if (cost[rows, cols] >= unfit).any():
        raise ValueError(f"target needs {len(blocks)} instances with up to {placement.gpus_per_instance} "
                         f"live workers each; the available instances do not have them")
    slots: dict[int, int] = {}
    for i, b in zip(rows, cols):
        slots.update(_match(migration, instances[i], blocks[b]))
    return slots
