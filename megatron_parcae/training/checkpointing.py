"""Checkpoints in megatron-core's own sharded layout, loadable under any layout.

Each rank saves its parameters under the keys, tensor-parallel shardings, stacked-layer
offsets and replica ids that megatron-core's `GPTModel/BertModel.sharded_state_dict()`
gives them, as Megatron-LM writes them, and Adam's state under the keys megatron-core's
optimizer gives it: `optimizer.state.exp_avg.<key>`, `optimizer.state.exp_avg_sq.<key>`
and, for a half-precision model, its fp32 main weights as `optimizer.state.fp32_param.<key>`.
So dist_checkpointing reshards a checkpoint for any (T, P, D), a plain megatron-core model
loads it through its own `sharded_state_dict()`, and a checkpoint such a model wrote loads
here (with --finetune: weights only). megatron-core's optimizer `sharded_state_dict` is
not called (reconfig/optimizer_state.py says why): the state is read from the optimizer
as migrations read it. Progress (iteration, consumed samples, Adam's step, the
learning-rate schedule) goes to a JSON file beside it. The layers' `_extra_state` objects
(pickled by megatron-core) are written for a plain model's sake and never read here.
Layout: `<save>/iter_0000010/` plus `<save>/latest_checkpointed_iteration.txt`, as in
Megatron-LM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from megatron_parcae import events
from megatron_parcae.training.device import SAVE_TIMEOUT
from reconfig import compat, planes
from reconfig.optimizer_state import (
    STATE_KEYS,
    LossScale,
    export_param_states,
    import_param_states,
    initialize_optimizer_states,
    load_loss_scale_state,
    loss_scale_state,
    step_count,
)
from megatron_parcae.training.progress import Progress
from reconfig.tensors import ParamShard, param_shards, unwrap
from reconfig.world import patient

TRACKER = "latest_checkpointed_iteration.txt"
PROGRESS = "parcae_progress.json"
METADATA = "metadata.json"  # what dist_checkpointing writes in every checkpoint folder
# Where megatron-core's optimizer keeps each of STATE_KEYS (`param`: the fp32 main weight,
# under the model's own key when the model is in fp32).
OPTIMIZER_KEYS = {"param": "optimizer.state.fp32_param", "exp_avg": "optimizer.state.exp_avg",
                  "exp_avg_sq": "optimizer.state.exp_avg_sq"}
MOMENTS = STATE_KEYS[1:]
# Flags that change the model's parameters: a checkpoint only loads into the same values.
# Each with the value a checkpoint that does not record it was written with.
SHAPE_FLAGS = {"model": None, "num_layers": None, "hidden_size": None, "ffn_hidden_size": None,
               "num_attention_heads": None, "max_position_embeddings": None, "bert_no_binary_head": False,
               "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
               "untie_embeddings_and_output_weights": False, "swiglu": False, "num_query_groups": None,
               "kv_channels": None, "disable_bias_linear": False}

Entry = ShardedTensor | ShardedTensorFactory  # megatron-core's mapping of one parameter


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or of another model."""


@dataclasses.dataclass(frozen=True)
class _Mapped:
    """One local parameter and megatron-core's sharded entry for it."""

    shard: ParamShard
    entry: Entry
    name: str  # unique on this rank: the chunk and the parameter's local name

    def key(self, prefix: str | None) -> str:
        return self.entry.key if prefix is None else f"{prefix}.{self.entry.key}"

    def holding(self, prefix: str | None, tensor: torch.Tensor) -> Entry:
        """The entry with `tensor` (shaped like the local shard) as its data, under the
        model's key (`prefix` None) or the optimizer's `<prefix>.<key>`."""
        if prefix is None:
            return _with_data(self.entry, tensor)
        return make_sharded_optimizer_tensor(self.entry, tensor, prefix)


def _with_data(entry: Entry, tensor: torch.Tensor) -> Entry:
    if isinstance(entry, ShardedTensorFactory):
        return dataclasses.replace(entry, data=tensor)
    return dataclasses.replace(entry, data=tensor, dtype=tensor.dtype)


def _mapped(model_chunks) -> tuple[list[_Mapped], list[ShardedObject]]:
    """megatron-core's sharded entries of every local parameter, and its other objects
    (the layers' `_extra_state`, saved so that a plain model finds every key it asks for)."""
    found, objects = [], []
    for i, chunk in enumerate(model_chunks):
        module = unwrap(chunk)
        params = dict(module.named_parameters())
        shards = {s.param: s for s in param_shards(module)}
        entries = module.sharded_state_dict()
        for name, entry in entries.items():
            if name in params:
                found.append(_Mapped(shards[params[name]], entry, f"{i}/{name}"))
            elif isinstance(entry, ShardedObject):
                objects.append(entry)
        unmapped = params.keys() - entries.keys()
        if unmapped:
            raise CheckpointError(f"megatron-core maps no checkpoint key to {sorted(unmapped)[:3]}")
    return found, objects


def _shape(args) -> dict:
    """The values of SHAPE_FLAGS a run has (query groups are None without GQA: arguments.py)."""
    return {flag: getattr(args, flag, default) for flag, default in SHAPE_FLAGS.items()}


def _progress_path(directory: Path) -> Path:
    return directory / PROGRESS


def _drop_stale_write_results() -> None:
    """Empty megatron-core's per-process queue of write results (no save may be in flight).

    Its writer queues what it wrote and the save reads it back after a barrier. A save
    that failed at that barrier (a peer died) leaves its results queued, and the next
    save of the process would read those instead: its metadata would describe the
    files of the failed save, and the checkpoint would not load.
    """
    results = compat.write_results_queue()
    while results is not None:
        try:
            results.get_nowait()
        except queue.Empty:
            return


FINISH_POLL_SECONDS = 0.1  # how often `Checkpointer.finish` asks whether every writer is done
PLANNING_TIMEOUTS = 6  # an asynchronous save's collectives wait this many usual timeouts


# CPython before 3.11.8 (gh-112275): a child forked while another thread is creating its
# thread state deadlocks before its first instruction. An asynchronous save forks its writer
# from a process whose gRPC and torch threads do that, so the save may never complete.
FORK_MAY_DEADLOCK = sys.version_info < (3, 11, 8)


class Checkpointer:
    """The saves of one training process, synchronous or, with `asynchronous`, written by
    a forked process while training goes on (megatron-core's async dist checkpoints).

    An asynchronous save becomes the newest checkpoint (its metadata, progress record and
    the tracker are written) once every rank's writer is done: `poll()`, which every rank
    calls after every iteration, finds out with one small all-reduce while a save is in
    flight. A layout change must `finish()` it first (its collectives need the layout's
    WORLD); a broken WORLD `abandon()`s it, and the previous checkpoint stays the newest.
    """

    def __init__(self, root: str | None, asynchronous: bool, collective_timeout: timedelta = SAVE_TIMEOUT) -> None:
        self.root = root
        self.asynchronous = asynchronous
        if asynchronous and FORK_MAY_DEADLOCK and os.environ.get("LOCAL_RANK", "0") == "0":
            warnings.warn(f"--async-save forks a writer for each save, and Python {sys.version.split()[0]} can "
                          "leave it deadlocked (CPython gh-112275, fixed in 3.11.8 and 3.12): use a newer Python, "
                          "or synchronous saves", stacklevel=2)
        self.collective_timeout = collective_timeout  # WORLD's usual one; saves may take SAVE_TIMEOUT
        if root is not None:
            compat.install_write_results_queue()
        self.newest: int | None = None  # the iteration of the last save this process completed
        # A queue per save: megatron-core checks that all ranks count their saves alike,
        # and the ranks of a layout have not all saved the same number of times before.
        self._in_flight: AsyncCallsQueue | None = None

    def save(self, runtime, progress) -> None:
        """Save the runtime's state at `progress` (collective over all ranks). A synchronous
        save's collectives wait for the slowest writer, up to SAVE_TIMEOUT; an asynchronous
        one's only plan what each rank writes, among ranks that come from the same step, so
        a peer absent for PLANNING_TIMEOUTS usual timeouts is lost, and WORLD breaks then."""
        assert self.root is not None
        self.finish()
        timeout = min(SAVE_TIMEOUT, self.collective_timeout * PLANNING_TIMEOUTS) if self.asynchronous else SAVE_TIMEOUT
        with patient(None, timeout, self.collective_timeout):
            self._save(runtime, progress)

    def _save(self, runtime, progress) -> None:
        _drop_stale_write_results()
        states = {s.shard.param: s.tensors for s in export_param_states(runtime.model, runtime.optimizer)}
        mapped, objects = _mapped(runtime.model)
        sharded: dict = {f"object/{i}": entry for i, entry in enumerate(objects)}
        for m in mapped:
            tensors = states[m.shard.param]
            sharded[f"model/{m.name}"] = m.holding(None, tensors["param"].to(m.shard.param.dtype))
            half = m.shard.param.dtype != torch.float32  # else the model's weights are the main ones
            for state in STATE_KEYS if half else MOMENTS:
                sharded[f"{state}/{m.name}"] = m.holding(OPTIMIZER_KEYS[state], tensors[state])
        directory = Path(self.root) / f"iter_{progress.iteration:07d}"
        if dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
        planes.control_barrier()
        request = dist_checkpointing.save(sharded, str(directory), async_sharded_save=True)
        meta = {
            "iteration": progress.iteration,
            "consumed_samples": progress.consumed_samples,
            "optimizer_step": step_count(runtime.optimizer),
            "scheduler_num_steps": runtime.scheduler.num_steps,
            "loss_scale": None if (scale := loss_scale_state(runtime.optimizer)) is None else scale.to_dict(),
            "model": _shape(runtime.args),
        }
        request.add_finalize_fn(lambda: self._record(directory, meta))
        if self.asynchronous:
            self._in_flight = AsyncCallsQueue()
            self._in_flight.schedule_async_request(request)
        else:
            request.execute_sync()

    def poll(self) -> None:
        """Complete the save in flight if every rank's writer is done (collective while one is)."""
        if self._in_flight is not None and self._in_flight.maybe_finalize_async_calls(blocking=False):
            self._in_flight = None

    def finish(self) -> None:
        """Wait for the save in flight and complete it (collective while one is): `poll()`
        every FINISH_POLL_SECONDS, each a small all-reduce under WORLD's usual timeout,
        so that a peer lost while the writers work breaks WORLD within that timeout
        rather than SAVE_TIMEOUT. Every rank polls until the same all-reduce says done."""
        while self._in_flight is not None:
            self.poll()  # on failure the save stays in flight: abandon() must wait for its writer
            if self._in_flight is not None:
                time.sleep(FINISH_POLL_SECONDS)

    def behind(self, iteration: int) -> bool:
        """Whether a rank has no completed save at `iteration` (collective): a save of that
        iteration may have been abandoned, or a rank joined since."""
        missing = planes.control_tensor([int(self.newest != iteration)])
        dist.all_reduce(missing, op=dist.ReduceOp.MAX)
        return bool(missing)

    def abandon(self) -> None:
        """Drop the save in flight without collectives (its WORLD broke): its writer
        finishes its files, which no metadata will name."""
        if self._in_flight is None:
            return
        for call in self._in_flight.async_calls:
            call.async_caller.close()
        self._in_flight = None
        _drop_stale_write_results()

    def _record(self, directory: Path, meta: dict) -> None:
        """Once the checkpoint's files and metadata are written, rank 0 writes the progress
        record, then the tracker that makes it the newest."""
        self.newest = meta["iteration"]
        if dist.get_rank() == 0:
            _write_atomically(_progress_path(directory), json.dumps(meta, indent=1))
            _write_atomically(directory.parent / TRACKER, str(meta["iteration"]))
            events.report(events.Save(meta["iteration"], str(directory.parent)))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def is_checkpoint(root: str | Path) -> bool:
    """Whether `--load root` names a checkpoint (see `locate`)."""
    return (Path(root) / TRACKER).is_file() or (Path(root) / METADATA).is_file()


def locate(root: str | Path) -> tuple[Path, dict | None]:
    """The checkpoint `--load root` names, and its validated progress record.

    `root` is a save folder (the newest checkpoint its tracker names, as Megatron-LM
    reads it) or one checkpoint folder, as a plain megatron-core program writes it. The
    record is None where the checkpoint has none (not written by this project): such a
    checkpoint loads only with --finetune.
    """
    root = Path(root)
    if (root / TRACKER).is_file():
        try:
            directory = root / f"iter_{int((root / TRACKER).read_text().strip()):07d}"
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"--load {root}: unreadable {TRACKER} ({exc})") from None
    elif (root / METADATA).is_file():
        directory = root
    else:
        raise CheckpointError(f"--load {root}: no checkpoint (no {TRACKER}, and not a checkpoint folder with "
                              f"{METADATA})")
    if not (directory / METADATA).is_file():
        raise CheckpointError(f"--load {root}: {directory} is not a complete checkpoint (no {METADATA})")
    if not _progress_path(directory).exists():
        return directory, None
    try:
        meta = json.loads(_progress_path(directory).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--load {root}: unreadable {PROGRESS} ({exc})") from None
    expected = {"iteration": int, "consumed_samples": int, "optimizer_step": int, "scheduler_num_steps": int,
                "model": dict}
    for key, kind in expected.items():
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"--load {root}: {PROGRESS} has no valid {key!r}")
    if meta.get("loss_scale") is not None:
        try:
            meta["loss_scale"] = LossScale.from_dict(meta["loss_scale"])
        except ValueError as exc:
            raise CheckpointError(f"--load {root}: {PROGRESS} has no valid 'loss_scale' ({exc})") from None
    return directory, meta


def read_progress(root: str | Path) -> tuple[Path, dict]:
    """The newest checkpoint's directory and its validated progress record."""
    directory, meta = locate(root)
    if meta is None:
        raise CheckpointError(_no_progress(root, directory))
    return directory, meta


def _no_progress(root: str | Path, directory: Path) -> str:
    return (f"--load {root}: {directory} has no {PROGRESS} (not written by megatron-parcae): load its weights "
            "with --finetune")


def check_same_model(root: str, saved: dict, args) -> None:
    """Refuse a checkpoint whose recorded SHAPE_FLAGS differ from `args`'."""
    wanted, saved = _shape(args), {**SHAPE_FLAGS, **saved}
    diff = ", ".join(f"{k}: {saved[k]} != {v}" for k, v in wanted.items() if saved[k] != v)
    if diff:
        raise CheckpointError(f"--load {root}: checkpoint is of another model ({diff})")


def _stored(root: str | Path, directory: Path, m: _Mapped, prefix: str | None, stored: dict) -> None:
    """Refuse a tensor the checkpoint lacks or holds in another shape (a checkpoint with
    no record of its model is checked only here)."""
    key = m.key(prefix)
    if key not in stored:
        hint = " (a checkpoint of weights only? load it with --finetune)" if prefix in OPTIMIZER_KEYS.values() else ""
        raise CheckpointError(f"--load {root}: {directory} has no tensor {key}{hint}")
    if isinstance(m.entry, ShardedTensor) and tuple(stored[key].global_shape) != tuple(m.entry.global_shape):
        raise CheckpointError(f"--load {root}: checkpoint is of another model ({key} is "
                              f"{tuple(stored[key].global_shape)} there, {tuple(m.entry.global_shape)} here)")


def load(root: str, runtime, finetune: bool = False) -> Progress:
    """Load the checkpoint `root` names (`locate`) into a freshly built runtime; returns
    Progress. With `finetune` only the weights: Adam starts afresh at iteration 0. With
    --no-load-optim, from --load, as Megatron-LM: the weights and how far training got,
    while Adam, the loss scale and the learning-rate schedule start afresh."""
    directory, meta = locate(root)
    fresh_optimizer = finetune or (getattr(runtime.args, "no_load_optim", False) and root == runtime.args.load)
    if meta is None and not finetune:
        raise CheckpointError(_no_progress(root, directory))
    if meta is not None:
        check_same_model(root, meta["model"], runtime.args)
    initialize_optimizer_states(runtime.optimizer)
    mapped, _ = _mapped(runtime.model)
    try:
        stored = dist_checkpointing.load_tensors_metadata(str(directory))
    except (CheckpointingException, OSError, ValueError) as exc:
        raise CheckpointError(f"--load {root}: unreadable checkpoint metadata ({exc})") from None
    template = {}
    for m in mapped:
        main = OPTIMIZER_KEYS["param"]  # fp32 main weights where the checkpoint has them
        prefixes = {"param": main if m.key(main) in stored else None}
        if not fresh_optimizer:
            prefixes.update({state: OPTIMIZER_KEYS[state] for state in MOMENTS})
        for state, prefix in prefixes.items():
            _stored(root, directory, m, prefix, stored)
            empty = torch.empty(m.shard.param.shape, dtype=torch.float32)  # host: written into the optimizer next
            template[f"{state}/{m.name}"] = m.holding(prefix, empty)
    try:
        loaded = dist_checkpointing.load(template, str(directory))
    except CheckpointingException as exc:
        raise CheckpointError(f"--load {root}: {exc}") from None
    states = {}
    for m in mapped:
        weight = loaded[f"param/{m.name}"]
        states[m.shard.global_name] = {
            "param": weight,
            **{state: torch.zeros_like(weight) if fresh_optimizer else loaded[f"{state}/{m.name}"]
               for state in MOMENTS}}
    if fresh_optimizer:
        import_param_states(runtime.model, runtime.optimizer, states, 0)
        if finetune:
            return Progress(iteration=0, consumed_samples=0)
        return Progress(iteration=meta["iteration"], consumed_samples=meta["consumed_samples"])
    import_param_states(runtime.model, runtime.optimizer, states, meta["optimizer_step"])
    load_loss_scale_state(runtime.optimizer, meta.get("loss_scale"))
    runtime.scheduler.num_steps = meta["scheduler_num_steps"]
    runtime.scheduler.step(increment=0)
    return Progress(iteration=meta["iteration"], consumed_samples=meta["consumed_samples"])


def resume(root: str | None, runtime, finetune: bool = False) -> int:
    """The consumed samples of a run that starts on `runtime`: those of the checkpoint
    `root` names (--load), loaded into it, or 0 without one (and with `finetune`)."""
    if not root:
        return 0
    progress = load(root, runtime, finetune)
    if dist.get_rank() == 0:
        events.report(events.Load(progress.iteration, root))
    return progress.consumed_samples
