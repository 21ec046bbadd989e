"""Where a job keeps its state in etcd, what each value must look like, and typed access.

Every key of a job, all under `/parcae/<job>/`:

    members/<worker>    MemberRecord      on the worker's lease: present while it is alive
    notices/<worker>    NoticeRecord      on the worker's lease: it got SIGTERM, leaves by `deadline`
    steps/<worker>      StepReport        on the worker's lease: its latest measured step times
    leader              LeaderRecord      on the coordinator's leader lease
    coordinator         CoordinatorState  what a restarted coordinator continues from
    generation          JSON integer      the newest published generation (absent = 0)
    plans/<generation>  PlanEnvelope      that generation's layout, and the migration to it or a save-and-exit
    changes/<generation> ChangeReport     the phases of the in-place change to it, as measured; on no lease
    progress            ProgressRecord    how far training got; on no lease, it outlives the workers
    done                DoneRecord        training ended
    network             NetworkRecord     the network between two instances, measured once at the start; on no lease
    cost                CostRecord        dollars so far by pool, projected finish and cost; on no lease
    provisioning        ProvisioningRecord the instances the coordinator wants of each on-demand pool; on no lease
    store/...           (torch store)     the WORLDs' rendezvous (etcd/store.py), `parcae/g<N>/` per generation

Every value is JSON and is validated on read and on write against the record's declared
schema (types, ranges, required keys, no unknown keys): etcd is a network path, so
nothing read from it is trusted, and a malformed payload is refused with an error that
names the key and the reason. A key added to a record later declares the value that
records written before it existed read as (`Field.absent`), so a job's older records
stay readable. A plan is published for generation g only in a transaction that sees
generation g-1, so no plan is ever applied twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence, TypeVar

from megatron_parcae.control.etcd.client import Compare, Delete, EtcdClient, Get, KeyValue, Put, StartedTxn
from predictor.forecast import AvailabilityForecast
from reconfig.layout import Layout, ModelShape
from reconfig.phases import PHASES
from reconfig.plan import MIGRATION_KINDS, MigrationPlan

JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_PAYLOAD_BYTES = 1_500_000  # etcd refuses larger requests by default (--max-request-bytes)
MAX_WORKER_ID = 2**31 - 1
MAX_GENERATION = 2**53  # exact in a JSON double
MAX_TIMESTAMP = 1e11  # wall-clock seconds since the epoch; far beyond any real date
PLANS_KEPT = 16  # older plans are deleted when a new one is published
CHANGES_KEPT = PLANS_KEPT  # change reports kept: the coordinator reads them beside their plans
CHECKED_PLANS_KEPT = 4  # plan payloads a process remembers having checked (the newest are the ones read again)
HISTORY_KEPT = 10_080  # intervals of availability history the coordinator keeps (a week of minutes)
DECISIONS_KEPT = 16  # published decisions the coordinator keeps for `parcae status`, as many as the plans kept
TRAIN, SAVE_AND_EXIT = "train", "save-and-exit"
PLAN_ACTIONS = (TRAIN, SAVE_AND_EXIT)  # what a plan asks of its layout's workers (PlanEnvelope.action)
# "restart": resumed from a checkpoint; "save-and-exit": the job stopped after a checkpoint
DECISION_KINDS = ("start", "restart", SAVE_AND_EXIT, *MIGRATION_KINDS)
TRANSFORMER_IMPLS = ("local", "transformer_engine")  # --transformer-impl: a job runs one of them


_REQUIRED = object()  # the `Field.absent` of a key every record has


class SchemaError(ValueError):
    """A payload read from (or about to be written to) etcd does not match its schema."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"refused {where}: {why}")
        self.where = where
        self.why = why


@dataclass(frozen=True)
class Field:
    """One key of a payload: its JSON type and the range allowed.

    For `str` and `dict`, `low`/`high` bound the length; for numbers, the value.
    `nullable` admits JSON null (the key must still be present). `absent`, for a key
    added after records were first written, is what a record without the key holds;
    writers always write it.
    """

    kind: type
    low: float | None = None
    high: float | None = None
    nullable: bool = False
    absent: Any = _REQUIRED

    def check(self, value: Any, where: str) -> Any:
        if value is None and self.nullable:
            return None
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.kind) or (isinstance(value, bool) and self.kind is not bool):
            raise SchemaError(where, f"expected {self.kind.__name__}, got {type(value).__name__}")
        if self.kind is float and not math.isfinite(value):
            raise SchemaError(where, f"expected a finite number, got {value}")
        size = len(value) if self.kind in (str, dict) else value
        if (self.low is not None and size < self.low) or (self.high is not None and size > self.high):
            what = "length" if self.kind in (str, dict) else "value"
            raise SchemaError(where, f"{what} {size} outside [{self.low}, {self.high}]")
        return value


def validate(data: Any, schema: Mapping[str, Field], where: str) -> dict[str, Any]:
    """Check a decoded JSON object against `schema`; return it with numbers normalised."""
    if not isinstance(data, dict):
        raise SchemaError(where, f"expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(schema))
    if unknown:
        raise SchemaError(where, f"unknown keys {unknown}")
    missing = sorted(name for name, f in schema.items() if name not in data and f.absent is _REQUIRED)
    if missing:
        raise SchemaError(where, f"missing required keys {missing}")
    return {name: f.check(data[name], f"{where}.{name}") if name in data else f.absent for name, f in schema.items()}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def parse_json(raw: bytes, where: str) -> Any:
    """Decode JSON from etcd: size-limited, UTF-8, no NaN/Infinity."""
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise SchemaError(where, f"{len(raw)} bytes, more than the {MAX_PAYLOAD_BYTES} allowed")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SchemaError(where, f"not valid JSON ({exc})") from None


def dump_json(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


R = TypeVar("R", bound="Record")


class Record:
    """Base of the payload dataclasses: schema-checked conversion to and from JSON."""

    SCHEMA: ClassVar[Mapping[str, Field]]

    @classmethod
    def from_dict(cls: type[R], data: Any, where: str = "payload") -> R:
        record = cls(**validate(data, cls.SCHEMA, where))
        record.check(where)
        return record

    def check(self, where: str) -> None:
        """Checks across fields; the base record has none."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def encode(self) -> bytes:
        """JSON bytes for etcd; refuses to write what a reader would refuse."""
        where = f"new {type(self).__name__}"
        validate(self.to_dict(), self.SCHEMA, where)
        self.check(where)
        data = dump_json(self.to_dict())
        if len(data) > MAX_PAYLOAD_BYTES:
            raise SchemaError(where, f"{len(data)} bytes, more than the {MAX_PAYLOAD_BYTES} allowed")
        return data

    @classmethod
    def decode(cls: type[R], raw: bytes, where: str) -> R:
        return cls.from_dict(parse_json(raw, where), where)


_WORKER = Field(int, 0, MAX_WORKER_ID)
_TIME = Field(float, 0, MAX_TIMESTAMP)
_NAME = Field(str, 1, 253)


@dataclass(frozen=True)
class MemberRecord(Record):
    """A live training process; `generation` is the newest plan it has applied (or failed
    to apply). `broken` is the newest generation whose WORLD failed under it (a peer died
    or stalled), 0 if none; `state_kept` says whether it still holds state, whole at its
    last applied step, and `state_of` the generation of the layout that state is of:
    `broken`'s (it failed while training) or an older one's (it failed mid-change and kept
    the state it brought into the change); 0 when it holds none. None (an older worker's
    record): `broken`'s if `state_kept`.
    `can_save`: it writes checkpoints (--save), so the coordinator may ask it to save and
    exit when the whole job is leaving. `model` is the model it trains
    (`ModelShape.to_dict()`), so that the coordinator plans only layouts it can be built in
    (a throughput table does not describe the model); None: not said (an older worker).
    `failure_domain` groups instances that may fail together (a zone, a rack, a switch), so
    that copies are kept across domains; None: not known. `transformer_impl` is its
    --transformer-impl (one of TRANSFORMER_IMPLS), so that no layout mixes two, whose
    parameters are named differently; None: not said (an older worker). `pool` is the
    pool of the coordinator config its instance was bought from (its price); None: not
    said, the provisioner's or the config's first pool."""

    worker_id: int
    instance: str  # the node it runs on: a preemption, notice or arrival concerns all of its workers
    pid: int
    registered_at: float
    generation: int
    broken: int = 0
    state_kept: bool = True
    local_rank: int = 0  # its GPU on the instance
    can_save: bool = False
    model: dict | None = None
    failure_domain: str | None = None
    state_of: int | None = None
    transformer_impl: str | None = None
    pool: str | None = None

    SCHEMA = {"worker_id": _WORKER, "instance": _NAME, "pid": Field(int, 1, 2**31 - 1), "registered_at": _TIME,
              "generation": Field(int, 0, MAX_GENERATION), "broken": Field(int, 0, MAX_GENERATION),
              "state_kept": Field(bool), "local_rank": Field(int, 0, 1023), "can_save": Field(bool, absent=False),
              "model": Field(dict, 1, 32, nullable=True, absent=None),
              "failure_domain": Field(str, 1, 253, nullable=True, absent=None),
              "state_of": Field(int, 0, MAX_GENERATION, nullable=True, absent=None),
              "transformer_impl": Field(str, 1, 32, nullable=True, absent=None),
              "pool": Field(str, 1, 253, nullable=True, absent=None)}

    def check(self, where: str) -> None:
        if self.broken > self.generation:
            raise SchemaError(where, f"broken generation {self.broken} is newer than generation {self.generation}")
        if self.state_of is not None and self.state_of > self.broken:
            raise SchemaError(where, f"state_of generation {self.state_of} is newer than broken generation "
                                     f"{self.broken}")
        if self.state_of is not None and self.state_kept != (self.state_of > 0):
            raise SchemaError(where, f"state_kept {str(self.state_kept).lower()} with state_of {self.state_of}")
        if self.transformer_impl is not None and self.transformer_impl not in TRANSFORMER_IMPLS:
            raise SchemaError(f"{where}.transformer_impl",
                              f"{self.transformer_impl!r} is not one of {', '.join(TRANSFORMER_IMPLS)}")
        self.shape(where)

    def kept_state_of(self) -> int:
        """The generation of the layout whose state it holds after its break; 0: none."""
        if not self.state_kept:
            return 0
        return self.broken if self.state_of is None else self.state_of

    def shape(self, where: str = "member") -> ModelShape | None:
        """The model it trains, None if not said; parsed once (check() parses it when the
        record is read, and the coordinator asks again for every member each reconcile)."""
        if "_shape" not in self.__dict__:
            object.__setattr__(self, "_shape",
                               None if self.model is None else _body(f"{where}.model", ModelShape, self.model))
        return self.__dict__["_shape"]


@dataclass(frozen=True)
class NoticeRecord(Record):
    """A worker was told it will be preempted (SIGTERM) and must be gone by `deadline`."""

    worker_id: int
    instance: str
    reason: str
    received_at: float
    deadline: float

    SCHEMA = {"worker_id": _WORKER, "instance": _NAME, "reason": Field(str, 1, 64), "received_at": _TIME, "deadline": _TIME}

    def check(self, where: str) -> None:
        if self.deadline < self.received_at:
            raise SchemaError(where, f"deadline {self.deadline} is before received_at {self.received_at}")


@dataclass(frozen=True)
class LeaderRecord(Record):
    """The coordinator currently holding the leader lease."""

    candidate: str
    pid: int
    acquired_at: float

    SCHEMA = {"candidate": _NAME, "pid": Field(int, 1, 2**31 - 1), "acquired_at": _TIME}


@dataclass(frozen=True)
class DoneRecord(Record):
    """Training reached its last iteration: standby workers and the coordinator exit."""

    generation: int
    iteration: int
    consumed_samples: int
    finished_at: float

    SCHEMA = {"generation": Field(int, 1, MAX_GENERATION), "iteration": Field(int, 0, 2**53),
              "consumed_samples": Field(int, 0, 2**53), "finished_at": _TIME}


@dataclass(frozen=True)
class ProgressRecord(Record):
    """How far the job's training got: the running layout's rank 0 writes it after every
    step and after a restart, a survivor of a broken layout raises it. It outlives the
    workers, so a restart from a checkpoint can tell the steps it lost even when every
    worker that trained them is gone."""

    generation: int
    iteration: int
    consumed_samples: int
    recorded_at: float
    copies: int = 0  # the generation of the workers' newest committed snapshots (reconfig/copies.py); 0: none
    raised: bool = False  # by a survivor (raise_progress): rank 0's own record, after its log, said less

    SCHEMA = {"generation": Field(int, 1, MAX_GENERATION), "iteration": Field(int, 0, 2**53),
              "consumed_samples": Field(int, 0, 2**53), "recorded_at": _TIME,
              "copies": Field(int, 0, MAX_GENERATION, absent=0), "raised": Field(bool, absent=False)}


@dataclass(frozen=True)
class StepReport(Record):
    """Measured training step time of one worker: mean `seconds` over the last `window` steps."""

    worker_id: int
    generation: int
    iteration: int
    seconds: float
    window: int
    consumed_samples: int
    reported_at: float

    SCHEMA = {
        "worker_id": _WORKER,
        "generation": Field(int, 0, MAX_GENERATION),
        "iteration": Field(int, 0, 2**53),
        "seconds": Field(float, 1e-9, 1e6),
        "window": Field(int, 1, 2**31 - 1),
        "consumed_samples": Field(int, 0, 2**53),
        "reported_at": _TIME,
    }


@dataclass(frozen=True)
class ChangeReport(Record):
    """The seconds of each phase (reconfig/phases.py) of the in-place change to
    `generation`, as its layout's rank 0 measured them (its LayoutChange event's):
    the coordinator fits its migration cost model on them."""

    generation: int
    kind: str  # the migration's (reconfig/plan.py's MIGRATION_KINDS)
    phases: dict

    SCHEMA = {"generation": Field(int, 1, MAX_GENERATION), "kind": Field(str, 1, 32),
              "phases": Field(dict, 1, len(PHASES))}

    def check(self, where: str) -> None:
        if self.kind not in MIGRATION_KINDS:
            raise SchemaError(f"{where}.kind", f"{self.kind!r} is not one of {', '.join(MIGRATION_KINDS)}")
        for phase, seconds in self.phases.items():
            if phase not in PHASES:
                raise SchemaError(f"{where}.phases", f"{phase!r} is not one of {', '.join(PHASES)}")
            Field(float, 0, 1e6).check(seconds, f"{where}.phases.{phase}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**53


_DECISION_SCHEMA = {
    "generation": Field(int, 1, MAX_GENERATION),
    "at": _TIME,
    "reason": Field(str, 1, 500),
    "kind": Field(str, 1, 32),
    "seconds": Field(float, 0, 1e9),
}


@dataclass(frozen=True)
class ProfileRecord(Record):
    """The model the coordinator's layer profile was measured on (`ModelShape.to_dict()`):
    a worker training another model refuses the job's plans, which would be priced and
    shaped for the wrong model."""

    source: str  # the profile's file name, for the message
    model: dict

    SCHEMA = {"source": Field(str, 1, 255), "model": Field(dict, 1, 32)}


@dataclass(frozen=True)
class CoordinatorState(Record):
    """What a restarted coordinator needs beyond the newest plan.

    `history` rows are [available, preempted, arrived] per interval, oldest first, the
    last ending at `boundary_at`; `previous` were available at that boundary and `seen`
    at some time since. `admitted` maps a worker of the layout to the process holding
    its slot, [pid, registered_at] from its member record. `decisions` are the newest
    published ones, for `parcae status`; `forecast` the last one made.
    """

    interval_seconds: float
    boundary_at: float
    history: list
    previous: list
    seen: list
    admitted: dict
    decisions: list
    forecast: dict | None

    SCHEMA = {
        "interval_seconds": Field(float, 1e-3, 1e9),
        "boundary_at": _TIME,
        "history": Field(list),
        "previous": Field(list),
        "seen": Field(list),
        "admitted": Field(dict),
        "decisions": Field(list),
        "forecast": Field(dict, nullable=True),
    }

    def check(self, where: str) -> None:
        if len(self.history) > HISTORY_KEPT:
            raise SchemaError(f"{where}.history", f"{len(self.history)} rows, more than {HISTORY_KEPT}")
        for i, row in enumerate(self.history):
            if not (isinstance(row, list) and len(row) == 3 and all(_is_count(v) for v in row)):
                raise SchemaError(f"{where}.history[{i}]", f"expected [available, preempted, arrived], got {row!r}")
        for name in ("previous", "seen"):
            for value in getattr(self, name):
                if not _is_count(value) or value > MAX_WORKER_ID:
                    raise SchemaError(f"{where}.{name}", f"{value!r} is not a worker id")
        for worker, process in self.admitted.items():
            ok = worker.isascii() and worker.isdigit() and int(worker) <= MAX_WORKER_ID and isinstance(process, list) \
                and len(process) == 2 and _is_count(process[0]) and isinstance(process[1], (int, float)) \
                and not isinstance(process[1], bool) and math.isfinite(process[1])
            if not ok:
                raise SchemaError(f"{where}.admitted",
                                  f"expected worker id -> [pid, registered_at], got {worker!r}: {process!r}")
        if len(self.decisions) > DECISIONS_KEPT:
            raise SchemaError(f"{where}.decisions", f"{len(self.decisions)} entries, more than {DECISIONS_KEPT}")
        for i, decision in enumerate(self.decisions):
            checked = validate(decision, _DECISION_SCHEMA, f"{where}.decisions[{i}]")
            if checked["kind"] not in DECISION_KINDS:
                raise SchemaError(f"{where}.decisions[{i}].kind", f"expected one of {', '.join(DECISION_KINDS)}")
        if self.forecast is not None:
            try:
                AvailabilityForecast.from_dict(self.forecast)
            except (ValueError, TypeError) as exc:
                raise SchemaError(f"{where}.forecast", str(exc)) from None


@dataclass(frozen=True)
class NetworkRecord(Record):
    """The network between two of the job's instances, as its workers measured it when
    the first layout on two instances was built (training/network.py): `message_bytes`
    went back and forth between a worker on each, one way taking the latency plus the
    bytes at the rate. The coordinator prices pipeline and data-parallel traffic, and the
    state a change sends between instances, with it rather than with what its profile
    and cost constants assume."""

    generation: int  # the layout that measured it
    instance: str
    peer_instance: str
    message_bytes: int
    latency_seconds: float
    bytes_per_second: float
    measured_at: float

    SCHEMA = {"generation": Field(int, 1, MAX_GENERATION), "instance": _NAME, "peer_instance": _NAME,
              "message_bytes": Field(int, 1, 2**40), "latency_seconds": Field(float, 0, 60),
              "bytes_per_second": Field(float, 1, 1e13), "measured_at": _TIME}

    def check(self, where: str) -> None:
        if self.instance == self.peer_instance:
            raise SchemaError(f"{where}.peer_instance", f"measured inside instance {self.instance}, not between two")


COST_UNITS = ("samples", "iterations")  # what a deadline counts
MAX_POOLS = 64


@dataclass(frozen=True)
class CostRecord(Record):
    """What the job has cost and where it is heading, as the coordinator counts it
    (provisioning/ledger.py): dollars by pool since `started_at`, paid up to `counted_at`
    for the `instances` (by pool) held then, which cost `hourly_dollars` an hour. With a
    deadline: `done` of `target` `unit`s (samples or iterations), due at `deadline_at`;
    the finish projected at the job's recent rate and the dollars by then (None while it
    has no rate). A restarted coordinator goes on counting from it."""

    started_at: float
    counted_at: float
    dollars: dict
    instances: dict
    hourly_dollars: float
    unit: str | None = None
    done: int = 0
    target: int | None = None
    deadline_at: float | None = None
    projected_finish_at: float | None = None
    projected_dollars: float | None = None
    budget: float | None = None

    SCHEMA = {"started_at": _TIME, "counted_at": _TIME, "dollars": Field(dict, 0, MAX_POOLS),
              "instances": Field(dict, 0, MAX_POOLS), "hourly_dollars": Field(float, 0, 1e12),
              "unit": Field(str, 1, 32, nullable=True), "done": Field(int, 0, 2**53),
              "target": Field(int, 1, 2**53, nullable=True), "deadline_at": Field(float, 0, MAX_TIMESTAMP, nullable=True),
              "projected_finish_at": Field(float, 0, MAX_TIMESTAMP, nullable=True),
              "projected_dollars": Field(float, 0, 1e15, nullable=True), "budget": Field(float, 0, 1e15, nullable=True)}

    def check(self, where: str) -> None:
        if self.counted_at < self.started_at:
            raise SchemaError(f"{where}.counted_at", f"{self.counted_at} is before started_at {self.started_at}")
        if set(self.instances) != set(self.dollars):
            raise SchemaError(f"{where}.instances", "expected the pools of dollars")
        for pool, dollars in self.dollars.items():
            _NAME.check(pool, f"{where}.dollars key")
            Field(float, 0, 1e15).check(dollars, f"{where}.dollars.{pool}")
            Field(int, 0, 2**31 - 1).check(self.instances[pool], f"{where}.instances.{pool}")
        if self.unit is not None and self.unit not in COST_UNITS:
            raise SchemaError(f"{where}.unit", f"{self.unit!r} is not one of {', '.join(COST_UNITS)}")
        if (self.unit is None) != (self.target is None) or (self.target is None) != (self.deadline_at is None):
            raise SchemaError(where, "unit, target and deadline_at go together")


@dataclass(frozen=True)
class ProvisioningRecord(Record):
    """The instances of each on-demand pool the coordinator's deadline policy wants held
    from `decided_at` on, and why (control/provisioning.py). A backend that runs in another
    process (the emulator, inside `parcae replay`) applies it; a successor coordinator
    starts from it."""

    decided_at: float
    wanted: dict
    reason: str

    SCHEMA = {"decided_at": _TIME, "wanted": Field(dict, 0, MAX_POOLS), "reason": Field(str, 0, 1000)}

    def check(self, where: str) -> None:
        for pool, count in self.wanted.items():
            _NAME.check(pool, f"{where}.wanted key")
            Field(int, 0, 2**31 - 1).check(count, f"{where}.wanted.{pool}")


def _body(where: str, cls: type, body: dict) -> Any:
    """A record's body as the reconfig/ object it encodes; that class validates it."""
    try:
        return cls.from_dict(body)
    except (ValueError, TypeError, KeyError) as exc:
        raise SchemaError(where, f"{cls.__name__}.from_dict refused it: {exc}") from None


@dataclass(frozen=True)
class PlanEnvelope(Record):
    """The plan of one generation: what its layout's workers do, and on which layout.

    With `action` "train" (also every plan written before the key existed), the workers
    train in `layout`, reached by `migration`; that is None when there is nothing to move
    from: the job's first layout, or a restart from a checkpoint. With "save-and-exit",
    `layout` is the running one and `migration` None: its workers are leaving and no
    layout can do without them, so they write a checkpoint of the iteration they are at
    and leave it; the next plan resumes from that checkpoint. The bodies are
    `Layout.to_dict()` and `MigrationPlan.to_dict()` from reconfig/, kept as plain dicts
    here and checked on decode and encode by those classes' `from_dict` (call it again
    to get the objects). `copy_holders[r]` is the worker (on another instance) that keeps
    a copy of the snapshots of the worker in slot r (reconfig/copies.py), None for none.
    """

    generation: int
    created_at: float
    layout: dict
    migration: dict | None
    action: str = TRAIN
    copy_holders: list | None = None

    SCHEMA = {
        "generation": Field(int, 1, MAX_GENERATION),
        "created_at": _TIME,
        "layout": Field(dict, 1),
        "migration": Field(dict, 1, nullable=True),
        "action": Field(str, 1, 32, absent=TRAIN),
        "copy_holders": Field(list, nullable=True, absent=None),
    }

    def holders(self) -> dict[int, int]:
        """worker -> the worker that keeps a copy of its snapshots."""
        if self.copy_holders is None:
            return {}
        slots = self.layout["slots"]
        return {w: h for w, h in zip(slots, self.copy_holders) if h is not None}

    @classmethod
    def decode(cls, raw: bytes, where: str) -> PlanEnvelope:
        """As any record's, but the bodies of a payload are checked once per process: the
        coordinator reads the newest plan at each decision, and every agent and worker of
        the process reads it too, while checking a migration of a thousand workers takes
        tens of milliseconds. A payload checked before is only parsed again."""
        with _CHECKED_PLANS_LOCK:
            checked = raw in _CHECKED_PLANS
        if checked:
            return cls(**validate(parse_json(raw, where), cls.SCHEMA, where))
        plan = super().decode(raw, where)
        with _CHECKED_PLANS_LOCK:
            _CHECKED_PLANS[raw] = None
            while len(_CHECKED_PLANS) > CHECKED_PLANS_KEPT:
                del _CHECKED_PLANS[next(iter(_CHECKED_PLANS))]
        return plan

    def check(self, where: str) -> None:
        if self.action not in PLAN_ACTIONS:
            raise SchemaError(f"{where}.action", f"{self.action!r} is not one of {', '.join(PLAN_ACTIONS)}")
        if self.action == SAVE_AND_EXIT and self.migration is not None:
            raise SchemaError(f"{where}.migration", "a save-and-exit plan moves no state: expected null")
        layout = _body(f"{where}.layout", Layout, self.layout)
        if self.migration is not None and _body(f"{where}.migration", MigrationPlan, self.migration).new != layout:
            raise SchemaError(f"{where}.migration", "its new layout is not the envelope's layout")
        if self.copy_holders is not None:
            if len(self.copy_holders) != len(layout.slots):
                raise SchemaError(f"{where}.copy_holders", f"{len(self.copy_holders)} entries for "
                                  f"{len(layout.slots)} slots")
            for r, h in enumerate(self.copy_holders):
                if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h not in layout.workers
                                      or h == layout.slots[r]):
                    raise SchemaError(f"{where}.copy_holders[{r}]", f"{h!r} is not another worker of the layout")


_CHECKED_PLANS: dict[bytes, None] = {}  # payloads PlanEnvelope.decode checked, oldest first
_CHECKED_PLANS_LOCK = threading.Lock()


def decode_generation(raw: bytes, where: str) -> int:
    return Field(int, 1, MAX_GENERATION).check(parse_json(raw, where), where)


def encode_generation(generation: int) -> bytes:
    return dump_json(Field(int, 1, MAX_GENERATION).check(generation, "new generation"))


@dataclass(frozen=True)
class JobKeys:
    """The etcd key of every piece of one job's state."""

    job: str

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not JOB_NAME.fullmatch(self.job):
            raise ValueError(f"job name {self.job!r} must be 1-64 characters of letters, digits, '_', '.', '-', starting with a letter or digit")

    @property
    def prefix(self) -> str:
        return f"/parcae/{self.job}/"

    @property
    def members(self) -> str:
        return self.prefix + "members/"

    @property
    def notices(self) -> str:
        return self.prefix + "notices/"

    @property
    def steps(self) -> str:
        return self.prefix + "steps/"

    @property
    def plans(self) -> str:
        return self.prefix + "plans/"

    @property
    def changes(self) -> str:
        return self.prefix + "changes/"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def profile(self) -> str:
        return self.prefix + "profile"

    @property
    def coordinator(self) -> str:
        return self.prefix + "coordinator"

    @property
    def generation(self) -> str:
        return self.prefix + "generation"

    @property
    def done(self) -> str:
        return self.prefix + "done"

    @property
    def progress(self) -> str:
        return self.prefix + "progress"

    @property
    def store(self) -> str:
        """The torch.distributed store of the job's WORLDs (etcd.store.EtcdStore)."""
        return self.prefix + "store/"

    def world_store(self, generation: int) -> str:
        """The store keys of one generation's WORLDs (reconfig.world.World.reform's `g<N>/`)."""
        return f"{self.store}parcae/g{Field(int, 0, MAX_GENERATION).check(generation, 'generation')}/"

    @property
    def worker_ids(self) -> str:
        """Its version counts the worker ids handed out (`JobStore.allocate_worker_id`)."""
        return self.prefix + "worker-ids"

    @property
    def network(self) -> str:
        return self.prefix + "network"

    @property
    def cost(self) -> str:
        return self.prefix + "cost"

    @property
    def provisioning(self) -> str:
        return self.prefix + "provisioning"

    def member(self, worker_id: int) -> str:
        return f"{self.members}{_WORKER.check(worker_id, 'worker id'):010d}"

    def notice(self, worker_id: int) -> str:
        return f"{self.notices}{_WORKER.check(worker_id, 'worker id'):010d}"

    def step(self, worker_id: int) -> str:
        return f"{self.steps}{_WORKER.check(worker_id, 'worker id'):010d}"

    def plan(self, generation: int) -> str:
        return f"{self.plans}{Field(int, 1, MAX_GENERATION).check(generation, 'generation'):016d}"

    def change(self, generation: int) -> str:
        return f"{self.changes}{Field(int, 1, MAX_GENERATION).check(generation, 'generation'):016d}"


def _key_number(key: str, prefix: str) -> int:
    """The number of a key `<prefix><number>`."""
    suffix = key[len(prefix):]
    if not (suffix.isascii() and suffix.isdigit()):
        raise SchemaError(key, "unknown key under a numbered prefix")
    return int(suffix)


def _numbered(kvs: Sequence[KeyValue], prefix: str, decode: Callable[[bytes, str], R], id_field: str) -> dict[int, R]:
    """Decode keys `<prefix><number>` whose payload repeats the number in `id_field`."""
    out: dict[int, R] = {}
    for kv in kvs:
        number = _key_number(kv.key, prefix)
        record = decode(kv.value, kv.key)
        if getattr(record, id_field) != number:
            raise SchemaError(kv.key, f"{id_field} {getattr(record, id_field)} does not match the key")
        out[number] = record
    return out


class JobStore:
    """Typed, validated reads and fenced writes of one job's state in etcd."""

    def __init__(self, client: EtcdClient, job: str) -> None:
        self.client = client
        self.keys = JobKeys(job)
        self._members_read: dict[bytes, MemberRecord] = {}  # by payload, as the last members() decoded them

    # -- members ---------------------------------------------------------------------

    def register_member(self, member: MemberRecord, lease: int) -> int | None:
        """Create the member key on `lease` unless the worker id is taken.

        Returns the current generation read in the same transaction (so a plan published
        right after registration is never missed), or None if the id is in use.
        """
        key = self.keys.member(member.worker_id)
        result = self.client.txn(
            [Compare(key, "version", "==", 0)],
            [Put(key, member.encode(), lease), Get(self.keys.generation)],
        )
        if not result.succeeded:
            return None
        return self._generation_of(result.reads[0])

    def allocate_worker_id(self) -> int:
        """A worker id no process of this job has been given before: one transaction bumps
        the counter key's version and reads it back, so concurrent callers never share one."""
        result = self.client.txn([], [Put(self.keys.worker_ids, b"{}"), Get(self.keys.worker_ids)])
        worker_id = result.reads[0][0].version - 1
        if worker_id > MAX_WORKER_ID:
            raise SchemaError(self.keys.worker_ids, f"worker ids are used up ({MAX_WORKER_ID}); start a new job name")
        return worker_id

    def update_member(self, member: MemberRecord, lease: int) -> bool:
        """Rewrite the member record, only while its key is still on `lease`."""
        return self._put_as_member(member.worker_id, lease, self.keys.member(member.worker_id), member.encode())

    def member_ids(self) -> frozenset[int]:
        """The worker ids of the members, read without their records: a member key
        goes with its lease, when the worker exits, is fenced or stops answering."""
        prefix = self.keys.members
        return frozenset(_key_number(key, prefix) for key in self.client.keys_with_prefix(prefix))

    def members(self) -> dict[int, MemberRecord]:
        """Every member. A payload the previous call decoded is not decoded again: the
        coordinator reads all members at each decision, most unchanged since the last one,
        and with a thousand of them decoding took 40% of the read."""
        previous, read = self._members_read, {}

        def decode(raw: bytes, where: str) -> MemberRecord:
            read[raw] = previous.get(raw) or MemberRecord.decode(raw, where)
            return read[raw]

        members = _numbered(self.client.get_prefix(self.keys.members), self.keys.members, decode, "worker_id")
        self._members_read = read
        return members

    def fence_member(self, worker_id: int) -> bool:
        """Revoke a worker's lease: its keys vanish and its agent reports `fenced`."""
        kv = self.client.get(self.keys.member(worker_id))
        return kv is not None and kv.lease != 0 and self.client.revoke_lease(kv.lease)

    def _put_as_member(self, worker_id: int, lease: int, key: str, value: bytes) -> bool:
        guard = Compare(self.keys.member(worker_id), "lease", "==", lease)
        return self.client.txn([guard], [Put(key, value, lease)]).succeeded

    # -- notices and step reports ----------------------------------------------------

    def post_notice(self, notice: NoticeRecord, lease: int) -> bool:
        """Publish a preemption notice; False if the worker is no longer a member on `lease`."""
        return self._put_as_member(notice.worker_id, lease, self.keys.notice(notice.worker_id), notice.encode())

    def notices(self) -> dict[int, NoticeRecord]:
        return _numbered(self.client.get_prefix(self.keys.notices), self.keys.notices, NoticeRecord.decode, "worker_id")

    def report_step(self, report: StepReport, lease: int) -> bool:
        """Publish a step-time report; False if the worker is no longer a member on `lease`."""
        return self._put_as_member(report.worker_id, lease, self.keys.step(report.worker_id), report.encode())

    def step_reports(self) -> dict[int, StepReport]:
        return _numbered(self.client.get_prefix(self.keys.steps), self.keys.steps, StepReport.decode, "worker_id")

    # -- generation and plans --------------------------------------------------------

    def _generation_of(self, kvs: list[KeyValue]) -> int:
        return decode_generation(kvs[0].value, kvs[0].key) if kvs else 0

    def current_generation(self) -> int:
        kv = self.client.get(self.keys.generation)
        return 0 if kv is None else decode_generation(kv.value, kv.key)

    def plan(self, generation: int) -> PlanEnvelope | None:
        kv = self.client.get(self.keys.plan(generation))
        return None if kv is None else self.decode_plan(kv.key, kv.value)

    def decode_plan(self, key: str, raw: bytes) -> PlanEnvelope:
        """The plan stored at `key` (read, or delivered by a watch on `keys.plans`)."""
        plan = PlanEnvelope.decode(raw, key)
        if key != self.keys.plan(plan.generation):
            raise SchemaError(key, f"envelope says generation {plan.generation}")
        return plan

    def latest_plan(self) -> PlanEnvelope | None:
        generation = self.current_generation()
        return self.plan(generation) if generation else None

    def plans(self) -> dict[int, PlanEnvelope]:
        """The plans still kept (the newest PLANS_KEPT), by generation."""
        return _numbered(self.client.get_prefix(self.keys.plans), self.keys.plans, PlanEnvelope.decode, "generation")

    def publish_plan(self, plan: PlanEnvelope, guard: Sequence[Compare] = ()) -> bool:
        """Publish `plan` and make its generation current, atomically.

        Succeeds only if the current generation is `plan.generation - 1` and every
        condition of `guard` holds (e.g. `Leadership.guard()`); of two racing publishers
        exactly one wins. Returns whether this call won.
        """
        g = plan.generation
        previous = Compare(self.keys.generation, "version", "==", 0) if g == 1 else Compare(self.keys.generation, "value", "==", encode_generation(g - 1))
        writes: list[Put | Delete] = [Put(self.keys.plan(g), plan.encode()), Put(self.keys.generation, encode_generation(g))]
        if g > PLANS_KEPT:
            writes.append(Delete(self.keys.plan(g - PLANS_KEPT)))
            writes.append(Delete(self.keys.world_store(g - PLANS_KEPT), prefix=True))
        return self.client.txn([previous, *guard], writes).succeeded

    # -- measured changes ------------------------------------------------------------

    def report_change(self, report: ChangeReport, worker_id: int, lease: int) -> bool:
        """Publish the phases of an applied change, if `worker_id` is still a member on
        `lease`. The record is on no lease (the coordinator may read it after its writer
        left) and only the newest CHANGES_KEPT are kept: older ones go in the same write."""
        key = self.keys.change(report.generation)
        older = sorted(kv.key for kv in self.client.get_prefix(self.keys.changes) if kv.key != key)
        stale = older[:max(0, len(older) - CHANGES_KEPT + 1)]  # zero-padded keys sort by generation
        guard = Compare(self.keys.member(worker_id), "lease", "==", lease)
        return self.client.txn([guard], [Put(key, report.encode()), *map(Delete, stale)]).succeeded

    def change_reports(self) -> dict[int, ChangeReport]:
        """The reported changes still kept (the newest CHANGES_KEPT), by generation."""
        return _numbered(self.client.get_prefix(self.keys.changes), self.keys.changes, ChangeReport.decode,
                         "generation")

    # -- end of training -------------------------------------------------------------

    def record_progress(self, record: ProgressRecord, worker_id: int, lease: int, timeout: float | None = None) -> bool:
        """Write how far training got, if `worker_id` is still a member on `lease`; the
        record itself is on no lease (it must outlive every worker)."""
        return self.client.txn(*self._progress_txn(record, worker_id, lease), timeout=timeout).succeeded

    def start_recording_progress(self, record: ProgressRecord, worker_id: int, lease: int,
                                 timeout: float | None = None) -> StartedTxn:
        """`record_progress` sent now; its `succeeded()` says whether it was written."""
        return self.client.start_txn(*self._progress_txn(record, worker_id, lease), timeout=timeout)

    def _progress_txn(self, record: ProgressRecord, worker_id: int, lease: int) -> tuple[list[Compare], list[Put]]:
        """(guard, write) of a progress record: written only while `worker_id` is a member on `lease`."""
        return [Compare(self.keys.member(worker_id), "lease", "==", lease)], [Put(self.keys.progress, record.encode())]

    def raise_progress(self, record: ProgressRecord, worker_id: int, lease: int) -> bool:
        """Write `record` if it is further than the job's record of the same or an older
        generation, and `worker_id` is still a member on `lease`: a survivor of a broken
        layout tells what it trained, never undoing a newer plan's record of where training
        went back to. Returns whether it was written."""
        kv = self.client.get(self.keys.progress)
        current = None if kv is None else ProgressRecord.decode(kv.value, kv.key)
        if current is not None and (current.generation > record.generation
                                    or current.consumed_samples >= record.consumed_samples):
            return False
        unchanged = (Compare(self.keys.progress, "version", "==", 0) if kv is None
                     else Compare(self.keys.progress, "mod", "==", kv.mod_revision))
        guard, write = self._progress_txn(record, worker_id, lease)
        return self.client.txn([*guard, unchanged], write).succeeded

    def progress(self) -> ProgressRecord | None:
        kv = self.client.get(self.keys.progress)
        return None if kv is None else ProgressRecord.decode(kv.value, kv.key)

    def mark_done(self, record: DoneRecord) -> bool:
        """Record that training ended; the first record stays. Returns whether this one was written."""
        return self.client.txn([Compare(self.keys.done, "version", "==", 0)], [Put(self.keys.done, record.encode())]).succeeded

    def done(self) -> DoneRecord | None:
        kv = self.client.get(self.keys.done)
        return None if kv is None else DoneRecord.decode(kv.value, kv.key)

    # -- leader and coordinator ------------------------------------------------------

    def leader(self) -> LeaderRecord | None:
        kv = self.client.get(self.keys.leader)
        return None if kv is None else LeaderRecord.decode(kv.value, kv.key)

    def coordinator_state(self) -> CoordinatorState | None:
        """The coordinator's record of the job; None if no coordinator wrote one."""
        kv = self.client.get(self.keys.coordinator)
        return None if kv is None else CoordinatorState.decode(kv.value, kv.key)

    def save_coordinator_state(self, state: CoordinatorState, guard: Sequence[Compare]) -> bool:
        """Write the coordinator's record if every condition of `guard` holds (its leader lease)."""
        return self.client.txn(list(guard), [Put(self.keys.coordinator, state.encode())]).succeeded

    def profile(self) -> ProfileRecord | None:
        """The model the leading coordinator's profile describes; None if it has no layer profile."""
        kv = self.client.get(self.keys.profile)
        return None if kv is None else ProfileRecord.decode(kv.value, kv.key)

    def publish_profile(self, record: ProfileRecord | None, guard: Sequence[Compare]) -> bool:
        """Say which model the coordinator plans for (None: it cannot tell, a throughput table)."""
        op = Delete(self.keys.profile) if record is None else Put(self.keys.profile, record.encode())
        return self.client.txn(list(guard), [op]).succeeded

    # -- network between instances ---------------------------------------------------

    def network(self) -> NetworkRecord | None:
        """The network between two instances as the job measured it; None until it has."""
        kv = self.client.get(self.keys.network)
        return None if kv is None else NetworkRecord.decode(kv.value, kv.key)

    def publish_network(self, record: NetworkRecord) -> bool:
        """Record the job's network measurement; the first one stays. Returns whether this one was written."""
        return self.client.txn([Compare(self.keys.network, "version", "==", 0)],
                               [Put(self.keys.network, record.encode())]).succeeded

    # -- dollars ---------------------------------------------------------------------

    def cost(self) -> CostRecord | None:
        """What the job has cost so far; None until a coordinator with pools counted it."""
        kv = self.client.get(self.keys.cost)
        return None if kv is None else CostRecord.decode(kv.value, kv.key)

    def publish_cost(self, record: CostRecord, guard: Sequence[Compare]) -> bool:
        """Write the cost record if every condition of `guard` holds (the leader lease)."""
        return self.client.txn(list(guard), [Put(self.keys.cost, record.encode())]).succeeded

    # -- instances wanted ------------------------------------------------------------

    def provisioning(self) -> ProvisioningRecord | None:
        """The on-demand instances the coordinator wants; None until it decided any."""
        kv = self.client.get(self.keys.provisioning)
        return None if kv is None else ProvisioningRecord.decode(kv.value, kv.key)

    def publish_provisioning(self, record: ProvisioningRecord, guard: Sequence[Compare]) -> bool:
        """Write the provisioning record if every condition of `guard` holds (the leader lease)."""
        return self.client.txn(list(guard), [Put(self.keys.provisioning, record.encode())]).succeeded
