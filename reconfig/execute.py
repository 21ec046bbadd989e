"""Carry out a MigrationPlan in the running processes, at an iteration boundary.

Every process of the old and new layouts calls `migrate` with the same plan: each
exports its state, drops its layout (model, optimizer, megatron-core groups), joins the
WORLD of the generation, sends exactly the slices the plan names to exactly the workers
it names (point-to-point), and then, if it has a slot, builds the new layout and writes
the state it kept plus what it received into the new model and optimizer. Workers that
leave (with notice) or go on standby send and then let go of WORLD.

Slice geometry is the planner's (reconfig/plan.py): a tensor's TP-partitioned dimension
is axis 0 in fractions of the full tensor, TP rank t of T holding [t/T, (t+1)/T) (for a
partition stride s, in each of the s blocks alike); axis 1 is the rest, flattened, in
fractions rounded down to elements, so the pieces of any two layouts tile exactly.
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Protocol

import psutil
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from reconfig import optimizer_state
from reconfig.optimizer_state import (
    STATE_KEYS,
    LossScale,
    chunks_of,
    export_param_states,
    import_param_states,
    initialize_optimizer_states,
    load_loss_scale_state,
    loss_scale_state,
    step_count,
)
from reconfig.layout import Parallelism
from reconfig.plan import OPTIMIZER, PARAMS, PARAMS_AND_OPTIMIZER, MigrationPlan, Range, Transfer
from reconfig.tensors import ParamShard, param_shards, unwrap
from reconfig import phases, planes, transfer
from reconfig.world import World, live_process_groups

_KEYS_OF_STATE = {PARAMS_AND_OPTIMIZER: STATE_KEYS, PARAMS: ("param",), OPTIMIZER: ("exp_avg", "exp_avg_sq")}
_WHOLE: Range = (Fraction(0), Fraction(1))


class Runtime(Protocol):
    """What the executor needs of a layout's megatron-core objects (training.LayoutRuntime)."""

    model: list
    optimizer: Any
    scheduler: Any

    def destroy(self) -> None: ...


RuntimeFactory = Callable[[Parallelism], Runtime]


class MigrationError(RuntimeError):
    """The plan and the model (or a peer's message) disagree: state would be lost or wrong."""


class PayloadBroken(MigrationError):
    """A transfer arrived damaged or short somewhere in WORLD (reconfig/transfer.py): every
    worker raises it together, with its state as it was, so the change can be taken again."""


class StatesDiffer(MigrationError):
    """The workers holding state hold it at different steps: a peer failed while some had
    applied a step and others had not. No plan can combine those states, so a change
    retried from them fails alike."""


def unit_of(global_name: str) -> str:
    """The planner's state unit (reconfig/layout.py) of a parameter's global name."""
    if global_name.startswith("embedding.word_embeddings."):
        return "embedding.word"
    if global_name.startswith("embedding."):
        return "embedding.position"
    if global_name.startswith(("decoder.layers.", "encoder.layers.")):  # GPT, BERT
        return f"layer.{global_name.split('.')[2]}"
    return "head"


@dataclass(frozen=True)
class Counters:
    """A layout's state besides its tensors: alike on every worker that holds state, and
    learnt from them by joiners. The LR schedule counts trained samples, which differ from
    consumed ones once an fp16 step is skipped."""

    step: int
    scheduler_steps: int
    loss_scale: LossScale | None


@dataclass
class HeldState:
    """What a worker brings out of the old layout: its TP shard of every parameter's state."""

    shards: dict[str, ParamShard]
    tensors: dict[str, dict[str, torch.Tensor]]
    tp_rank: int
    tp_size: int
    counters: Counters

    def __post_init__(self) -> None:
        # A shard's geometry is all that is used of it; the live Parameter, through its
        # data and `.main_grad`, would keep the old layout's DDP buffers alive.
        self.shards = {name: replace(shard, param=torch.empty(shard.param.shape, device="meta"))
                       for name, shard in self.shards.items()}


@dataclass
class _Received:
    name: str
    key: str
    split_range: Range | None
    shard_range: Range
    values: torch.Tensor


def _region(tensor: torch.Tensor, shard: ParamShard, tp_rank: int, tp_size: int,
            split_range: Range | None, shard_range: Range) -> torch.Tensor:
    """The part of this rank's shard that lies in split_range x shard_range, as a writable view.

    `split_range` is in fractions of the full tensor and must lie inside this rank's cell;
    None means the whole cell. A tensor that is not TP-split has one cell.
    """
    if shard.partition_dim is None:
        view, lo, hi = tensor.view(1, 1, -1), Fraction(0), Fraction(1)
    else:
        moved = tensor.movedim(shard.partition_dim, 0)
        view = moved.view(shard.partition_stride, moved.shape[0] // shard.partition_stride, -1)
        lo, hi = _WHOLE if split_range is None else (split_range[0] * tp_size - tp_rank,
                                                     split_range[1] * tp_size - tp_rank)
        if not 0 <= lo < hi <= 1:
            raise MigrationError(f"{shard.global_name}: slice {split_range} is outside TP rank {tp_rank}/{tp_size}")
    rows, cols = view.shape[1], view.shape[2]
    first, last = lo * rows, hi * rows
    if first.denominator != 1 or last.denominator != 1:
        raise MigrationError(f"{shard.global_name}: slice {split_range} does not fall on whole rows")
    return view[:, int(first):int(last), int(shard_range[0] * cols):int(shard_range[1] * cols)]


def _outgoing(held: HeldState, transfer: Transfer) -> list[tuple[str, str, torch.Tensor]]:
    """(name, key, values) of every tensor slice a transfer carries, in a fixed order."""
    items = []
    for name in sorted(n for n in held.tensors if unit_of(n) == transfer.unit):
        shard = held.shards[name]
        split = shard.partition_dim is not None
        if (split and transfer.split_range is None) or (not split and not transfer.replicated):
            continue
        for key in _KEYS_OF_STATE[transfer.state]:
            part = _region(held.tensors[name][key], shard, held.tp_rank, held.tp_size,
                           transfer.split_range if split else None, transfer.shard_range)
            items.append((name, key, part.reshape(-1)))
    if not items:
        raise MigrationError(f"worker holds no parameter of {transfer.unit} that the plan asks it to send")
    return items


def _parse_header(raw: bytes, src: int, expected: int) -> list[tuple[str, str, int]]:
    """A peer's list of (name, key, element count), checked before any tensor is touched."""
    try:
        entries = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MigrationError(f"message from worker {src}: unreadable header ({exc})") from None
    if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and e[1] in STATE_KEYS
            and isinstance(e[2], int) and not isinstance(e[2], bool) and e[2] >= 0 for e in entries):
        raise MigrationError(f"message from worker {src}: header is not a list of [name, key, count]")
    if sum(e[2] for e in entries) != expected:
        raise MigrationError(f"message from worker {src}: header counts {sum(e[2] for e in entries)} "
                             f"elements, the payload has {expected}")
    return [tuple(e) for e in entries]


def _exchange(plan: MigrationPlan, world: World, held: HeldState | None,
              copies: dict[int, HeldState]) -> tuple[list[_Received], int]:
    """Send and receive this worker's transfers (reconfig/transfer.py), one message each:
    a header listing (name, key, count) and the values. `copies`: the lost workers'
    states this worker holds copies of, by worker. Returns what it received, and the
    host bytes of the messages that brought it."""
    me, rank_of = world.worker, {w: r for r, w in enumerate(world.members)}
    sends, receives, local = [], [], []
    for index, t in enumerate(plan.transfers):
        if t.src == me:
            source = held if t.copy_of is None else copies.get(t.copy_of)
            if source is None:
                whose = "" if t.copy_of is None else f" of worker {t.copy_of}'s copy"
                raise MigrationError(f"plan has worker {me} send {t.unit}{whose}, but it holds no such state")
            items = _outgoing(source, t)
            if t.dst == me:  # from the copy this worker keeps of a lost peer, to itself
                local += [_Received(n, k, t.split_range, t.shard_range, v) for n, k, v in items]
                continue
            header = json.dumps([[n, k, v.numel()] for n, k, v in items]).encode()
            sends.append(transfer.Outgoing(rank_of[t.dst], index, header, torch.cat([v.float() for _, _, v in items])))
        if t.dst == me and t.src != me:
            receives.append(transfer.Incoming(rank_of[t.src], index))
    try:
        arrived = transfer.exchange(sends, receives, world.collective_timeout,
                                    what=f"the migration to {plan.new.parallelism}")
    except transfer.TransferBroken as exc:
        raise PayloadBroken(str(exc)) from None
    arrived_bytes = sum(m.payload.numel() * 4 for m in arrived.messages.values())
    _change.count(device=arrived.in_flight_bytes,
                  host=held_bytes(held, *copies.values()) + sum(m.payload.numel() * 4 for m in sends) + arrived_bytes)
    del sends
    received = local
    for index, t in enumerate(plan.transfers):
        if t.dst != me or t.src == me:
            continue
        message = arrived.messages[rank_of[t.src], index]
        offset = 0
        for name, key, count in _parse_header(message.header, t.src, message.payload.numel()):
            received.append(_Received(name, key, t.split_range, t.shard_range,
                                      message.payload[offset: offset + count]))
            offset += count
    return received, arrived_bytes


def _fill(runtime: Runtime, held: HeldState | None, received: list[_Received], sharded_keys: tuple[str, ...],
          step: int) -> tuple[int, int]:
    """Write every new local parameter's state into the new layout: what this worker kept
    plus what it received, a group of parameters at a time (at most GATHER_CHUNK_ELEMENTS
    elements each, so host memory holds one group's assembled state). Returns the most
    bytes a group held in host memory, and on the data plane.

    Keys in `sharded_keys` (distributed-optimizer moments) arrive only for this rank's
    DP shard; the disjoint shards are summed over the new DP group to make them whole, on
    the data plane (every DP rank of a stage has the same parameters, in the same order).
    """
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    own_shard = (Fraction(dp_rank, dp_size), Fraction(dp_rank + 1, dp_size))
    shards = {s.global_name: s for chunk in runtime.model for s in param_shards(unwrap(chunk))}
    pieces: dict[str, list[_Received]] = {name: [] for name in shards}
    for piece in received:
        if piece.name not in shards:
            raise MigrationError(f"received {piece.name}, which this rank's new stage does not hold")
        pieces[piece.name].append(piece)
    names = list(shards)
    most = on_device = 0
    for group in chunks_of([shards[n].param.numel() for n in names], optimizer_state.GATHER_CHUNK_ELEMENTS):
        states = {names[i]: _assembled(shards[names[i]], held, pieces[names[i]], tp_rank, tp_size, own_shard,
                                       sharded_keys) for i in group}
        if sharded_keys and dp_size > 1:
            parts = [states[names[i]][k].view(-1) for i in group for k in sharded_keys]
            flat = planes.on_data_plane(torch.cat(parts))
            on_device = max(on_device, flat.numel() * flat.element_size())
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            summed = planes.host_copy(flat)
            planes.host_copies_done()
            offset = 0
            for part in parts:
                part.copy_(summed[offset: offset + part.numel()])
                offset += part.numel()
            del flat, summed
        most = max(most, sum(t.numel() * t.element_size() for tensors in states.values() for t in tensors.values()))
        import_param_states(runtime.model, runtime.optimizer, states, step, partial=True)
    return most, on_device


def _assembled(shard: ParamShard, held: HeldState | None, pieces: list[_Received], tp_rank: int, tp_size: int,
               own_shard: Range, sharded_keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """One new parameter's state in host memory, checked to be whole."""
    name = shard.global_name
    states = {key: torch.zeros(shard.param.shape, dtype=torch.float32) for key in STATE_KEYS}
    filled = {key: torch.zeros(shard.param.shape, dtype=torch.bool) for key in STATE_KEYS}
    if held is not None and name in held.tensors:
        old = held.shards[name]
        kept: Range | None = None
        if shard.partition_dim is not None:
            kept = (max(Fraction(held.tp_rank, held.tp_size), Fraction(tp_rank, tp_size)),
                    min(Fraction(held.tp_rank + 1, held.tp_size), Fraction(tp_rank + 1, tp_size)))
        if kept is None or kept[0] < kept[1]:
            for key in STATE_KEYS:
                _region(states[key], shard, tp_rank, tp_size, kept, _WHOLE).copy_(
                    _region(held.tensors[name][key], old, held.tp_rank, held.tp_size, kept, _WHOLE))
                _region(filled[key], shard, tp_rank, tp_size, kept, _WHOLE).fill_(True)
    for piece in pieces:
        split = piece.split_range if shard.partition_dim is not None else None
        target = _region(states[piece.key], shard, tp_rank, tp_size, split, piece.shard_range)
        if target.numel() != piece.values.numel():
            raise MigrationError(f"received {piece.values.numel()} values of {name} {piece.key}, "
                                 f"its slice holds {target.numel()}")
        target.copy_(piece.values.view(target.shape))
        _region(filled[piece.key], shard, tp_rank, tp_size, split, piece.shard_range).fill_(True)
    for key, mask in filled.items():
        needed = _region(mask, shard, tp_rank, tp_size, None, own_shard if key in sharded_keys else _WHOLE)
        if not bool(needed.all()):
            raise MigrationError(f"{name} ({key}): {int((~needed).sum())} values neither kept nor received")
        if key in sharded_keys:
            states[key].masked_fill_(~_own(mask, shard, tp_rank, tp_size, own_shard), 0.0)
    return states


def _own(like: torch.Tensor, shard: ParamShard, tp_rank: int, tp_size: int, own_shard: Range) -> torch.Tensor:
    """Mask of this DP rank's axis-1 shard (each element of a DP column is owned once)."""
    mask = torch.zeros_like(like)
    _region(mask, shard, tp_rank, tp_size, None, own_shard).fill_(True)
    return mask


def release_runtime(runtime: Runtime) -> None:
    """Drop a layout's megatron-core objects and groups, and free its memory now:
    `destroy` leaves them no reference cycle, so reference counting frees them, and the
    device's cached blocks go back before the next layout's communicators are made."""
    runtime.destroy()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def built_layout(build: RuntimeFactory, parallelism: Parallelism, world: World, generation: int) -> Iterator[Runtime]:
    """Build a layout, then wait until every member has built it (the first collectives
    of training then wait for no slow build); if filling it with state fails, release
    it: its groups would block the next layout's."""
    runtime = build(parallelism)
    try:
        world.sync(f"g{generation}/built")
        yield runtime
    except BaseException:
        release_runtime(runtime)
        raise


def export_held_state(runtime: Runtime, into: planes.HostArena | None = None) -> HeldState:
    """This worker's state before its layout is dropped (collective over the old DP group),
    in `into` where given."""
    states = export_param_states(runtime.model, runtime.optimizer, into)
    counters = Counters(step_count(runtime.optimizer), runtime.scheduler.num_steps, loss_scale_state(runtime.optimizer))
    return HeldState({s.shard.global_name: s.shard for s in states},
                     {s.shard.global_name: s.tensors for s in states},
                     ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), counters)


_AGREED = ("Adam step", "consumed samples", "scheduler steps", "loss scaler", "loss scale", "loss-scale growth",
           "loss-scale hysteresis")


def _float_bits(value: float) -> int:
    """An integer that orders like `value` among floats >= 0 (IEEE 754), for a MAX all-reduce."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _agree_on_progress(held: HeldState | None, consumed_samples: int) -> tuple[Counters, int]:
    """The counters and the samples consumed, which joining workers learn from those who
    hold state. Holders must agree: after a peer died mid-step, one survivor may have
    applied the step and another not, and their states cannot be combined."""
    if held is None:
        mine = [-(2**62)] * (2 * len(_AGREED))
    else:
        c, scale = held.counters, held.counters.loss_scale
        values = [c.step, consumed_samples, c.scheduler_steps, int(scale is not None),
                  *((_float_bits(scale.scale), scale.growth_tracker, scale.hysteresis_tracker) if scale else (0, 0, 0))]
        mine = values + [-v for v in values]
    agreed = planes.control_tensor(mine)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    high, low = agreed[:len(_AGREED)].tolist(), [-v for v in agreed[len(_AGREED):].tolist()]
    differ = [f"{name} {lo} to {hi}" for name, lo, hi in zip(_AGREED, low, high) if lo != hi]
    if differ:
        raise StatesDiffer(f"the workers holding state differ ({', '.join(differ)}): a peer failed while "
                           "some had applied a step and others had not")
    step, consumed, scheduler_steps, scaled, bits, growth, hysteresis = high
    scale = LossScale(struct.unpack("<d", struct.pack("<q", bits))[0], growth, hysteresis) if scaled else None
    return Counters(step, scheduler_steps, scale), consumed


def state_bytes(runtime: Runtime) -> int:
    """The bytes a layout's state occupies where it trains: parameters, gradient buffers,
    the optimizer's main parameters and moments (each storage once)."""
    storages: dict[int, int] = {}

    def add(tensor) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    for chunk in runtime.model:
        for param in chunk.parameters():
            add(param)
            add(getattr(param, "main_grad", None))
    for opt in optimizer_state.torch_optimizers(runtime.optimizer):
        for group in opt.param_groups:
            for param in group["params"]:
                add(param)
                for value in opt.state.get(param, {}).values():
                    add(value)
    return sum(storages.values())


def held_bytes(*states: HeldState | None) -> int:
    """Host bytes of held states (each tensor once)."""
    return sum(t.numel() * t.element_size() for held in states if held is not None
               for tensors in held.tensors.values() for t in tensors.values())


class _ChangeRecord:
    """What this process measures of its current layout change: the seconds of each
    phase (reconfig/phases.py), each lap from the end of the one before, and the memory
    it holds: the device's (`torch.cuda.max_memory_allocated` on a GPU; on CPU, where
    the data plane is host memory, the executor's own count of the layout state and the
    chunks in flight it holds) and the host copies of state it keeps, against the old
    and the new layout's steady state.

    A change begins when `hand_over` takes the state out of the old layout, or, for a
    worker that holds nothing or kept its state from a broken layout, when `migrate` starts.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.rolled_back_samples = 0  # a recovery from copies went back this far
        self._handed_over = False
        self._mark = time.perf_counter()
        self.steady_bytes: int | None = None  # the old layout's, before the change
        self.new_steady_bytes: int | None = None
        self.device_peak = 0
        self.host_peak = 0
        self.state_bytes = 0  # one host copy of this worker's state, the old layout's or the new one's

    def begin(self, handing_over: bool = False, runtime: Runtime | None = None) -> None:
        self.seconds = {}
        self._handed_over = handing_over
        self.device_peak = self.host_peak = self.state_bytes = 0
        self.new_steady_bytes = None
        if torch.cuda.is_available():
            self.steady_bytes = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.steady_bytes = None if runtime is None else state_bytes(runtime)
            self.count(device=self.steady_bytes or 0)
        self._mark = time.perf_counter()

    def enter_migration(self) -> None:
        """`migrate` goes on from `hand_over`'s record, or begins a fresh one."""
        if not self._handed_over:
            self.begin()
        self._handed_over = False

    def count(self, device: int = 0, host: int = 0) -> None:
        """This process holds `device` bytes of state on the data plane and `host` bytes of
        host copies at this point of the change (the executor's count)."""
        self.device_peak = max(self.device_peak, device)
        self.host_peak = max(self.host_peak, host)

    def built(self, runtime: Runtime) -> None:
        self.new_steady_bytes = state_bytes(runtime)
        local = sum(s.param.numel() for chunk in runtime.model for s in param_shards(unwrap(chunk)))
        self.state_bytes = max(self.state_bytes, 4 * len(STATE_KEYS) * local)

    def lap(self, phase: str) -> None:
        """The time since the previous lap was spent in `phase`."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        self._mark = now

    def device_peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else self.device_peak


_change = _ChangeRecord()


def hand_over(runtime: Runtime) -> HeldState:
    """Take this worker's state out of its layout, then drop the layout."""
    _change.begin(handing_over=True, runtime=runtime)
    held = export_held_state(runtime)
    _change.count(device=_change.steady_bytes or 0, host=held_bytes(held))
    _change.lap(phases.EXPORT)
    release_runtime(runtime)
    _change.lap(phases.WORLD)
    return held


class Snapshots(Protocol):
    """Where a worker keeps its snapshots of layouts (reconfig/copies.py SnapshotStore)."""

    def newest(self, generation: int) -> int: ...

    def restore(self, key: int) -> tuple[HeldState, dict[int, HeldState], int]: ...


def _roll_back(plan: MigrationPlan, worker: int, snapshots: Snapshots | None,
               consumed_samples: int) -> tuple[HeldState | None, dict[int, HeldState], int, int]:
    """For a plan that recovers from copies (plan.Copies): (this worker's state, the copies
    it holds, consumed samples) of the newest snapshot every holder has, and the samples
    the job had consumed before (the most a holder knew: a joiner's count is of a past the
    job may have gone back from since, and would count steps lost twice). Collective over
    WORLD."""
    generation = plan.request.copies.generation
    holder = plan.request.sender(worker) == (worker, None)  # a live worker of the snapshots' layout
    none = 2**62
    mine = (snapshots.newest(generation) if snapshots is not None else -1) if holder else none
    agreed = planes.control_tensor([mine, -consumed_samples if holder else 0])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    key, known = int(agreed[0]), -int(agreed[1])
    if key < 0:
        raise MigrationError(f"a worker of generation {generation}'s layout holds no snapshot of it")
    if not holder:
        return None, {}, consumed_samples, known
    held, copies, consumed_samples = snapshots.restore(key)
    return held, copies, consumed_samples, known


def migrate(plan: MigrationPlan, generation: int, world: World, held: HeldState | None,
            build: RuntimeFactory, consumed_samples: int,
            snapshots: Snapshots | None = None) -> tuple[Runtime | None, int]:
    """Move this worker to `plan.new`; returns its new runtime (None: it has no slot) and
    the job's consumed samples.

    Called by every worker of the old layout still running, with the state it took out
    of it (`hand_over`), and every worker the plan places, with the same plan and
    generation. `held` is None for a worker that holds nothing (joining); its
    `consumed_samples` is replaced by what the holders agree on. A plan that recovers
    from copies takes the state from `snapshots` instead, rolled back (`_roll_back`).
    """
    _change.enter_migration()
    new_slots = plan.new.slots
    senders = sorted({t.src for t in plan.transfers} - set(new_slots))
    members = tuple(new_slots) + tuple(senders)
    if world.worker not in members:
        world.leave()
        return None, consumed_samples
    if world.members != members:
        world.reform(members, f"g{generation}")
    copies: dict[int, HeldState] = {}
    known = None
    if plan.request.copies is not None:
        held, copies, consumed_samples, known = _roll_back(plan, world.worker, snapshots, consumed_samples)
    kept = held_bytes(held, *copies.values())
    _change.count(host=kept)
    _change.state_bytes = max(_change.state_bytes, held_bytes(held))
    counters, consumed_samples = _agree_on_progress(held, consumed_samples)
    _change.rolled_back_samples = 0 if known is None else max(0, known - consumed_samples)
    _change.lap(phases.WORLD)
    received, received_bytes = _exchange(plan, world, held, copies)
    _change.lap(phases.EXCHANGE)
    if world.worker not in new_slots:
        world.leave()
        return None, consumed_samples
    if world.members != new_slots:
        world.reform(new_slots, f"g{generation}/layout")
        _change.lap(phases.WORLD)
    with built_layout(build, plan.new.parallelism, world, generation) as new_runtime:
        _change.lap(phases.BUILD)
        initialize_optimizer_states(new_runtime.optimizer)
        _change.built(new_runtime)
        sharded = _KEYS_OF_STATE[OPTIMIZER] if plan.request.distributed_optimizer else ()
        group_bytes, summed_bytes = _fill(new_runtime, held, received, sharded, counters.step)
        _change.count(device=_change.new_steady_bytes + summed_bytes, host=kept + received_bytes + group_bytes)
        load_loss_scale_state(new_runtime.optimizer, counters.loss_scale)
    new_runtime.scheduler.num_steps = counters.scheduler_steps
    new_runtime.scheduler.step(increment=0)
    _change.lap(phases.IMPORT)
    return new_runtime, consumed_samples


def layout_args(args: argparse.Namespace, parallelism: Parallelism) -> argparse.Namespace:
    """The run's arguments with another layout's T, P, D and layer partition."""
    layers = parallelism.stage_layers
    uneven = len(set(layers)) > 1
    return argparse.Namespace(**{
        **vars(args),
        "tensor_model_parallel_size": parallelism.tp,
        "pipeline_model_parallel_size": parallelism.pp,
        "data_parallel_size": parallelism.dp,
        "stage_layers": layers,
        "decoder_first_pipeline_num_layers": layers[0] if uneven else None,
        "decoder_last_pipeline_num_layers": layers[-1] if uneven else None,
    })


def resident_mib() -> float:
    """This process's resident memory (for leak checks across layout changes)."""
    return psutil.Process().memory_info().rss / 2**20


@dataclass(frozen=True)
class ChangeFigures:
    """What an applied migration moved and cost, for rank 0 to report."""

    kind: str
    parallelism: Parallelism
    bytes_planned: int
    seconds: float  # from `started` until the new layout could train
    process_groups: int  # live after it (a leak shows here)
    resident_mib: float
    device_peak_mib: float  # during the change (see _ChangeRecord)
    steady_device_peak_mib: float | None  # before it, in the old layout (None: this process held none)
    phases: dict[str, float]  # seconds of each phase (reconfig/phases.py) of this process
    rolled_back_samples: int  # consumed samples retrained: a recovery from copies went back
    new_device_mib: float | None  # the new layout's steady state, as built
    host_peak_mib: float  # host copies of state held during the change
    state_mib: float  # one host copy of this worker's state (the larger of its old and new)


def change_figures(plan: MigrationPlan, started: float) -> ChangeFigures:
    """The figures of `plan`, applied since time.perf_counter() read `started`."""
    mib = 2.0**-20
    return ChangeFigures(plan.kind, plan.new.parallelism, plan.bytes_total(), time.perf_counter() - started,
                         live_process_groups(), resident_mib(), _change.device_peak_bytes() * mib,
                         None if _change.steady_bytes is None else _change.steady_bytes * mib,
                         dict(_change.seconds), _change.rolled_back_samples,
                         None if _change.new_steady_bytes is None else _change.new_steady_bytes * mib,
                         _change.host_peak * mib, _change.state_bytes * mib)
