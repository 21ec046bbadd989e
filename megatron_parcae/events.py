"""What a training process reports, as typed events: one JSON object per line in the file
`--parcae-events` names, and the line of Megatron's log that people read.

Programs (the spot emulator, the benchmarks, the tests) read the events file with
`read_events` or `EventFollower`, never the log: this module alone knows the log's
format. `parcae coordinator --events` writes its published plans, what it learns
of throughput, of migration costs and of the network, the job's dollars and the
instances it provisions, the same way. Free of torch, so that readers load fast.
"""

from __future__ import annotations

import json
import math
import os
import time
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from reconfig.execute import ChangeFigures


class EventError(ValueError):
    """A line of an events file that is not a valid event; the message says where and why."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event has: when it happened (Unix seconds) and its name in the file."""

    NAME: ClassVar[str]
    time: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps({"event": self.NAME, **asdict(self)})


@dataclass(frozen=True)
class Iteration(Event):
    """A logged training step (every --log-interval, and the last)."""

    NAME = "iteration"
    iteration: int
    train_iters: int
    consumed_samples: int
    global_batch_size: int
    losses: dict[str, float]  # mean over the global batch, by name ("lm loss", "sop loss")
    grad_norm: float
    learning_rate: float
    ms_per_iteration: float  # wall time per step since the previous logged step
    # Samples of the updates applied: an fp16 step skipped for an inf or NaN gradient
    # consumes its samples (as in Megatron-LM) but trains nothing.
    trained_samples: int
    skipped_iterations: int  # fp16 steps skipped since the previous logged step
    loss_scale: float | None  # fp16's dynamic or constant loss scale; None otherwise
    tflops_per_gpu: float | None = None  # model TFLOP/s per GPU, with --log-throughput
    # Logged by the first rank of the recovering layout that trained the step: the step's
    # own rank 0 was lost before its progress record said it had logged it, so it may have.
    # Its time is when it is logged again, after the original, if there was one.
    relogged: bool = False

    def repeats(self, newest_logged: int | None) -> bool:
        """Whether this logs again a step its rank 0 had logged: `newest_logged` is the newest
        iteration logged before it (a recovered step is the newest its layout kept)."""
        return self.relogged and newest_logged == self.iteration

    def log_line(self) -> str:
        fp16 = self.loss_scale is not None
        parts = [
            f" iteration {self.iteration:8d}/{self.train_iters:8d}",
            f"consumed samples: {self.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {self.ms_per_iteration:.1f}",
            *((f"throughput per GPU (TFLOP/s/GPU): {self.tflops_per_gpu:.1f}",) if self.tflops_per_gpu is not None else ()),
            f"learning rate: {self.learning_rate:.6E}",
            f"global batch size: {self.global_batch_size:5d}",
            *(f"{name}: {value:.6E}" for name, value in self.losses.items()),
            *((f"loss scale: {self.loss_scale:.1f}",) if fp16 else ()),
            f"grad norm: {self.grad_norm:.6f}",
            *((f"number of skipped iterations: {self.skipped_iterations:3d}",) if fp16 else ()),
        ]
        return " | ".join(parts) + (" (logged again after its rank 0 was lost) |" if self.relogged else " |")


def logged_steps(events: list[Event]) -> list[Iteration]:
    """The Iteration events in order, less the copies of a step logged again by the layout
    that recovered it (`relogged`) where its rank 0 had logged it already: what remains
    more than once was trained more than once."""
    steps: list[Iteration] = []
    for event in events:
        if isinstance(event, Iteration) and not event.repeats(steps[-1].iteration if steps else None):
            steps.append(event)
    return steps


@dataclass(frozen=True)
class Evaluation(Event):
    """The validation loss at `iteration` (every --eval-interval): the mean over
    `eval_iters` global batches of the validation split, with dropout off."""

    NAME = "evaluation"
    iteration: int
    eval_iters: int
    losses: dict[str, float]  # by name, as Iteration's

    def log_line(self) -> str:
        parts = [f" validation loss at iteration {self.iteration}",
                 *(f"{name} value: {value:.6E} | {name} PPL: {math.exp(min(20.0, value)):.6E}"
                   for name, value in self.losses.items())]
        line = " | ".join(parts) + " |"
        rule = "-" * len(line)
        return f"{rule}\n{line}\n{rule}"


@dataclass(frozen=True)
class Save(Event):
    """A checkpoint became the newest under `directory` (the --save root)."""

    NAME = "save"
    iteration: int
    directory: str

    def log_line(self) -> str:
        return f" saved checkpoint at iteration {self.iteration} to {self.directory}"


@dataclass(frozen=True)
class Load(Event):
    """A run started from the newest checkpoint under `directory` (--load)."""

    NAME = "load"
    iteration: int
    directory: str

    def log_line(self) -> str:
        return f" loaded checkpoint {self.directory} at iteration {self.iteration}"


@dataclass(frozen=True)
class LayoutChange(Event):
    """The job runs in a new layout from `iteration` on.

    `kind` is the migration's (intra-stage, inter-stage, pipeline, tensor), with the bytes
    it planned to move and, after it, the live process groups and resident memory of the
    reporting process; or "restart": built from `source` (a checkpoint directory, or "the
    seed"), training went back `lost_steps` steps. A migration that recovered from the
    workers' snapshots (reconfig/copies.py) names them in `source` and went back
    `lost_steps` steps too. `seconds`: from the decision until the
    new layout could train; `phases`: the reporting process's seconds in each phase of a
    migration (reconfig/phases.py), adding up to at most `seconds` (empty for a restart).
    """

    NAME = "layout_change"
    generation: int
    iteration: int
    kind: str
    tp: int
    pp: int
    dp: int
    seconds: float
    bytes_planned: int | None = None
    process_groups: int | None = None
    resident_mib: float | None = None
    source: str | None = None
    lost_steps: int = 0
    # The reporting process's memory (reconfig.execute._ChangeRecord): its device's peak
    # during the change (on CPU the executor's count of state on the data plane), before it
    # in the old layout and as the new one was built, and its host copies of state.
    device_peak_mib: float | None = None
    steady_device_peak_mib: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    new_device_mib: float | None = None
    host_peak_mib: float | None = None
    state_mib: float | None = None  # one host copy of the reporting worker's state

    @classmethod
    def of_migration(cls, generation: int, iteration: int, figures: ChangeFigures, source: str | None = None,
                     lost_steps: int = 0) -> LayoutChange:
        p = figures.parallelism
        return cls(generation, iteration, figures.kind, p.tp, p.pp, p.dp, figures.seconds, figures.bytes_planned,
                   figures.process_groups, figures.resident_mib, source, lost_steps,
                   device_peak_mib=figures.device_peak_mib,
                   steady_device_peak_mib=figures.steady_device_peak_mib, phases=dict(figures.phases),
                   new_device_mib=figures.new_device_mib, host_peak_mib=figures.host_peak_mib,
                   state_mib=figures.state_mib)

    def log_line(self) -> str:
        head = f" layout change at iteration {self.iteration} (generation {self.generation}): "
        to = f"to tp {self.tp} pp {self.pp} dp {self.dp}"
        ms = f"{self.seconds * 1000.0:.1f} ms"
        if self.kind == "restart":
            return f"{head}restart {to} from {self.source}, {self.lost_steps} steps lost, {ms}"
        device = "" if self.device_peak_mib is None else (
            f", device peak {self.device_peak_mib:.0f} MiB ({self.steady_device_peak_mib or 0.0:.0f} MiB before, "
            f"{self.new_device_mib or 0.0:.0f} after), host copies {self.host_peak_mib or 0.0:.0f} MiB")
        phases = "" if not self.phases else (
            " (" + ", ".join(f"{name} {seconds * 1000.0:.0f}" for name, seconds in self.phases.items()) + " ms)")
        recovered = "" if self.source is None else f" from {self.source}, {self.lost_steps} steps lost"
        return (f"{head}{self.kind} migration {to}{recovered}, {self.bytes_planned} bytes planned, {ms}{phases}, "
                f"{self.process_groups} process groups, {self.resident_mib:.0f} MiB resident{device}")


@dataclass(frozen=True)
class ChangeRetried(Event):
    """A layout change's transfers arrived damaged or short (`reason`): nothing received
    was used, and the change is taken again from the state every worker kept."""

    NAME = "change_retried"
    generation: int
    iteration: int
    attempt: int
    reason: str

    def log_line(self) -> str:
        return (f" layout change at iteration {self.iteration} (generation {self.generation}) taken again after "
                f"attempt {self.attempt}: {self.reason}")


@dataclass(frozen=True)
class CopiesKept(Event):
    """A snapshot of the layout of `generation` (reconfig/copies.py), at `iteration`: one
    is taken every `interval` steps; the reporting worker's snapshot holds `mib` (its own
    state and, with `has_ward`, its ward's copy; a ward that is a DP peer needs none) and
    took `seconds`. `committed` is false when its copies arrived damaged every time
    (`damaged` exchanges were taken again); `host_mib` is the host memory kept for
    snapshots, in `allocations` blocks allocated since the worker started."""

    NAME = "copies_kept"
    generation: int
    iteration: int
    interval: int
    mib: float
    seconds: float
    has_ward: bool
    committed: bool = True
    damaged: int = 0
    host_mib: float | None = None
    allocations: int | None = None

    def log_line(self) -> str:
        ward = " with a buddy copy" if self.has_ward else " (no other worker's copy to keep)"
        damaged = f", {self.damaged} damaged exchange(s) of copies taken again" if self.damaged else ""
        if not self.committed:
            return (f" snapshot of generation {self.generation} at iteration {self.iteration} not kept: its copies "
                    f"arrived damaged{damaged}")
        return (f" snapshot of generation {self.generation} at iteration {self.iteration}: {self.mib:.1f} MiB in "
                f"host memory{ward}, "
                f"{self.seconds * 1000.0:.0f} ms, every {self.interval} steps{damaged}")


@dataclass(frozen=True)
class PlanPublished(Event):
    """The coordinator published the plan of `generation`: `kind` is start, restart, the
    migration's, or save-and-exit (the layout's workers write a checkpoint and leave: the
    job stops until workers come back); `lost` and `broken` are the layout's workers it
    was made without (lost) or whose WORLD broke under them."""

    NAME = "plan_published"
    # The state came from live workers (replicas, or what they kept when a change failed),
    # snapshots, a checkpoint.
    RECOVERIES = ("replicas", "copies", "checkpoint")
    generation: int
    kind: str
    tp: int
    pp: int
    dp: int
    workers: tuple[int, ...]  # of the new layout, by slot
    expected_seconds: float
    reason: str
    lost: tuple[int, ...]
    broken: tuple[int, ...]
    instances: tuple[str, ...] = ()  # of the new layout's workers, by slot
    recovery: str = ""  # after a loss or a broken WORLD: RECOVERIES


@dataclass(frozen=True)
class ThroughputLearned(Event):
    """At an interval boundary, what the coordinator now predicts for the running layout
    after reading its workers' step reports: `intervals` boundaries have brought reports
    of it so far, `reports` are kept; `prior_seconds` is the profile's prediction."""

    NAME = "throughput_learned"
    generation: int
    tp: int
    pp: int
    dp: int
    intervals: int
    reports: int
    predicted_seconds: float
    prior_seconds: float


@dataclass(frozen=True)
class MigrationCostLearned(Event):
    """The coordinator read the phases the in-place change to `generation` took (its
    layout's rank 0 reports them) and fitted its migration cost model on the `reports`
    changes it keeps: the seconds they add up to (`measured_seconds`), what the model
    predicted of them before this report and predicts after, and `prior_seconds`, the
    cost constants' prediction."""

    NAME = "migration_cost_learned"
    generation: int
    kind: str
    reports: int
    measured_seconds: float
    predicted_seconds: float
    fitted_seconds: float
    prior_seconds: float


@dataclass(frozen=True)
class NetworkMeasured(Event):
    """The coordinator read the network between `instances` as the workers of the layout
    of `generation` measured it, and plans with it: `link_bytes_per_second` is what its
    throughput model now prices pipeline and data-parallel traffic at (the profile said
    `prior_link_bytes_per_second`; both None for a throughput table, measured on its own
    network), `transfer_bytes_per_second` the rate its cost model now sends a GiB between
    instances at (the cost constants said `prior_transfer_bytes_per_second`)."""

    NAME = "network_measured"
    generation: int
    instances: tuple[str, ...]
    latency_seconds: float
    bytes_per_second: float
    link_bytes_per_second: float | None
    prior_link_bytes_per_second: float | None
    transfer_bytes_per_second: float
    prior_transfer_bytes_per_second: float


@dataclass(frozen=True)
class Cost(Event):
    """What the job has cost, by pool, and where it is heading (the coordinator's cost
    record, etcd/keys.py's CostRecord): `instances` held now by pool at `hourly_dollars`
    an hour; with a deadline, `done` of `target` `unit`s due at `deadline_at` (Unix
    seconds), the finish projected at the job's recent rate and the dollars by then."""

    NAME = "cost"
    dollars: dict[str, float]
    instances: dict[str, int]
    hourly_dollars: float
    unit: str | None
    done: int
    target: int | None
    deadline_at: float | None
    projected_finish_at: float | None
    projected_dollars: float | None
    budget: float | None = None


@dataclass(frozen=True)
class Provisioned(Event):
    """The coordinator's deadline policy changed how many instances of `pool` the job
    holds (control/provisioning.py): from `held` to `wanted`; `reason` starts with
    "behind" when it asks for more, "ahead" when it gives some back. `instances`: those
    the backend asked for or gave back (none named where another process applies the
    target, as `parcae replay` does). `remaining` is the work left in the deadline's unit."""

    NAME = "provisioned"
    pool: str
    held: int
    wanted: int
    reason: str
    instances: tuple[str, ...] = ()
    remaining: float = 0.0
    time_left_hours: float = 0.0


KINDS: dict[str, type[Event]] = {kind.NAME: kind for kind in
                                 (Iteration, Evaluation, Save, Load, LayoutChange, ChangeRetried, CopiesKept, PlanPublished,
                                  ThroughputLearned, MigrationCostLearned, NetworkMeasured, Cost, Provisioned)}
_HINTS = {kind: typing.get_type_hints(kind) for kind in KINDS.values()}
TrainingEvent = Iteration | Evaluation | Save | Load | LayoutChange | ChangeRetried | CopiesKept


# -- writing -------------------------------------------------------------------------


class EventWriter:
    """Appends events to `path` (None: nowhere), each line in one write to a file opened
    for appending: the layout's rank 0, which writes, may be another process after a
    change, and processes that share the file then never mix their lines."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = path

    def write(self, event: Event) -> None:
        if self.path is None:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (event.to_json() + "\n").encode())
        finally:
            os.close(fd)


_training_events = EventWriter(None)
_listener: Callable[[TrainingEvent], None] | None = None


def open_training_events(path: str | None, listener: Callable[[TrainingEvent], None] | None = None) -> None:
    """Where `report` appends this process's events (--parcae-events; None: no file), and
    what else it hands them to (the writer of --tensorboard-dir's scalars)."""
    global _training_events, _listener
    _training_events = EventWriter(path)
    _listener = listener


def report(event: TrainingEvent) -> None:
    """Append `event` to this process's events file, then print its log line: a reader
    woken by the line finds the event. The layout's rank 0 calls this."""
    _training_events.write(event)
    if _listener is not None:
        _listener(event)
    print(event.log_line(), flush=True)


# -- reading -------------------------------------------------------------------------


def parse_event(line: str, where: str) -> Event:
    """One line of an events file; EventError names `where` and what is wrong."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EventError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise EventError(f"{where}: expected a JSON object, got {type(data).__name__}")
    name = data.pop("event", None)
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise EventError(f"{where}: 'event' is {name!r}, not one of {', '.join(KINDS)}")
    hints = _HINTS[kind]
    known = fields(kind)
    if unknown := sorted(data.keys() - {f.name for f in known}):
        raise EventError(f"{where}: {name} event with unknown field(s) {', '.join(unknown)}")
    required = {f.name for f in known if f.default is MISSING and f.default_factory is MISSING}
    if missing := sorted(required - data.keys()):
        raise EventError(f"{where}: {name} event without field(s) {', '.join(missing)}")
    values = {}
    for key, value in data.items():
        try:
            values[key] = _decode(value, hints[key])
        except TypeError:
            raise EventError(f"{where}: {name} event's {key} is {value!r}, not {_show(hints[key])}") from None
    return kind(**values)


def _decode(value: object, hint: object) -> object:
    """`value` as the field type `hint` holds it (a JSON list as a tuple); TypeError if it is not one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType:
        for option in args:
            try:
                return _decode(value, option)
            except TypeError:
                continue
        raise TypeError
    if (hint is type(None) and value is None) or (hint is str and isinstance(value, str)) \
            or (hint is bool and isinstance(value, bool)):
        return value
    if hint in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        if hint is float:
            return float(value)
        if isinstance(value, int):
            return value
    if origin is dict and isinstance(value, dict):
        return {_decode(k, args[0]): _decode(v, args[1]) for k, v in value.items()}
    if origin is tuple and isinstance(value, list):
        return tuple(_decode(v, args[0]) for v in value)
    raise TypeError


def _show(hint: object) -> str:
    return str(hint) if typing.get_args(hint) else getattr(hint, "__name__", str(hint))


def read_events(path: str | os.PathLike) -> list[Event]:
    """Every event in the file, in order. A last line without its newline is what a killed
    writer left: kept if it is a whole event, else ignored. Any other bad line raises
    EventError."""
    text = Path(path).read_bytes()
    lines = text.split(b"\n")
    last = lines.pop()  # b"" after a final newline
    out = [_parse_bytes(line, f"{path}:{number}") for number, line in enumerate(lines, 1)]
    if last:
        try:
            out.append(_parse_bytes(last, f"{path}:{len(lines) + 1}"))
        except EventError:
            pass
    return out


def _parse_bytes(line: bytes, where: str) -> Event:
    try:
        text = line.decode()
    except UnicodeDecodeError as exc:
        raise EventError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    return parse_event(text, where)


class EventFollower:
    """The events another process appends to a file, each whole line once, as it grows."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._offset = 0
        self._lines = 0

    def read(self) -> list[Event]:
        """The events whose lines were completed since the last call (none while the file is absent)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")[:-1]  # the last piece is not a whole line yet
        out = [_parse_bytes(line, f"{self.path}:{self._lines + i}") for i, line in enumerate(lines, 1)]
        self._offset += sum(len(line) + 1 for line in lines)
        self._lines += len(lines)
        return out
