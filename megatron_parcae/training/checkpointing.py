"""Checkpoints with megatron.core.dist_checkpointing, loadable under any layout.

Each rank saves its tensor-parallel shard of every parameter's fp32 main weight and Adam
moments as a ShardedTensor keyed by the parameter's global name
(`exp_avg/decoder.layers.7.mlp.linear_fc1.weight`), so dist_checkpointing can reshard it
for any (T, P, D) on load. Progress (iteration, consumed samples, Adam's step, the
learning-rate schedule) goes to a JSON file beside it; no pickle is read back.
Layout: `<save>/iter_0000010/` plus `<save>/latest_checkpointed_iteration.txt`, as in
Megatron-LM.
"""

from __future__ import annotations

import json
import os
import queue
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor
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
from reconfig.tensors import WORD_EMBEDDING, ParamShard, param_shards, unwrap
from reconfig.world import patient

TRACKER = "latest_checkpointed_iteration.txt"
PROGRESS = "parcae_progress.json"
# Flags that change the model's parameters: a checkpoint only loads into the same values.
# Each with the value a checkpoint that does not record it was written with.
SHAPE_FLAGS = {"model": None, "num_layers": None, "hidden_size": None, "ffn_hidden_size": None,
               "num_attention_heads": None, "max_position_embeddings": None, "bert_no_binary_head": False,
               "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
               "untie_embeddings_and_output_weights": False, "swiglu": False, "num_query_groups": None}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or of another model."""


def _sharded(shard: ParamShard, key: str, tensor: torch.Tensor, tied_copy: bool) -> list[ShardedTensor]:
    """The checkpoint's tensors of one shard. A strided split (SwiGLU's fc1 holds its
    [gate; up] slices) is written as one tensor per stride part, `.../part<i>`, each cut
    over TP plainly, so that any T reads it."""
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    split = shard.partition_dim is not None
    # One main replica per element: DP replicas, TP copies of unsplit tensors and the
    # last stage's tied embedding copy are not written.
    replica = (int(tied_copy), 0 if split else tp_rank, ps.get_data_parallel_rank())
    offsets = [(shard.partition_dim, tp_rank, tp_size)] if split else []
    name = f"{key}/{shard.global_name}"
    if shard.partition_stride == 1:
        return [ShardedTensor.from_rank_offsets(name, tensor, *offsets, replica_id=replica)]
    parts = tensor.chunk(shard.partition_stride, dim=shard.partition_dim)
    return [ShardedTensor.from_rank_offsets(f"{name}/part{i}", part.contiguous(), *offsets, replica_id=replica)
            for i, part in enumerate(parts)]


def _joined(shard: ParamShard, key: str, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    """One shard's tensor from what `_sharded` wrote of it."""
    name = f"{key}/{shard.global_name}"
    if shard.partition_stride == 1:
        return loaded[name]
    return torch.cat([loaded[f"{name}/part{i}"] for i in range(shard.partition_stride)], dim=shard.partition_dim)


def _shape(args) -> dict:
    """The values of SHAPE_FLAGS a run has (query groups are None without GQA: arguments.py)."""
    return {flag: getattr(args, flag, default) for flag, default in SHAPE_FLAGS.items()}


def _is_tied_copy(shard: ParamShard) -> bool:
    return shard.global_name == WORD_EMBEDDING and not ps.is_pipeline_first_stage()


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
        self.collective_timeout = collective_timeout  # WORLD's usual one; saves may take SAVE_TIMEOUT
        if root is not None:
            compat.install_write_results_queue()
        self.newest: int | None = None  # the iteration of the last save this process completed
        # A queue per save: megatron-core checks that all ranks count their saves alike,
        # and the ranks of a layout have not all saved the same number of times before.
        self._in_flight: AsyncCallsQueue | None = None

    def save(self, runtime, progress) -> None:
        """Save the runtime's state at `progress` (collective over all ranks)."""
        assert self.root is not None
        self.finish()
        with patient(None, SAVE_TIMEOUT, self.collective_timeout):
            self._save(runtime, progress)

    def _save(self, runtime, progress) -> None:
        _drop_stale_write_results()
        states = export_param_states(runtime.model, runtime.optimizer)
        sharded = {}
        for st in states:
            tied = _is_tied_copy(st.shard)
            for key in STATE_KEYS:
                for item in _sharded(st.shard, key, st.tensors[key], tied):
                    sharded[item.key] = item
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
        """Wait for the save in flight and complete it (collective while one is)."""
        if self._in_flight is not None:
            with patient(None, SAVE_TIMEOUT, self.collective_timeout):
                self._in_flight.maybe_finalize_async_calls(blocking=True)
            self._in_flight = None  # kept on failure: abandon() must wait for its writer

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


def read_progress(root: str) -> tuple[Path, dict]:
    """The newest checkpoint's directory and its validated progress record."""
    tracker = Path(root) / TRACKER
    try:
        iteration = int(tracker.read_text().strip())
        directory = Path(root) / f"iter_{iteration:07d}"
        meta = json.loads(_progress_path(directory).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--load {root}: no readable checkpoint ({exc})") from None
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


def check_same_model(root: str, saved: dict, args) -> None:
    """Refuse a checkpoint whose recorded SHAPE_FLAGS differ from `args`'."""
    wanted, saved = _shape(args), {**SHAPE_FLAGS, **saved}
    diff = ", ".join(f"{k}: {saved[k]} != {v}" for k, v in wanted.items() if saved[k] != v)
    if diff:
        raise CheckpointError(f"--load {root}: checkpoint is of another model ({diff})")


def load(root: str, runtime):
    """Load the newest checkpoint under `root` into a freshly built runtime; returns Progress."""
    directory, meta = read_progress(root)
    check_same_model(root, meta["model"], runtime.args)
    initialize_optimizer_states(runtime.optimizer)
    shards = [s for chunk in runtime.model for s in param_shards(unwrap(chunk))]
    template = {}
    for shard in shards:
        for key in STATE_KEYS:
            empty = torch.empty(shard.param.shape, dtype=torch.float32)  # host: written into the optimizer next
            for item in _sharded(shard, key, empty, _is_tied_copy(shard)):
                template[item.key] = item
    loaded = dist_checkpointing.load(template, str(directory))
    states = {s.global_name: {key: _joined(s, key, loaded) for key in STATE_KEYS} for s in shards}
    import_param_states(runtime.model, runtime.optimizer, states, meta["optimizer_step"])
    load_loss_scale_state(runtime.optimizer, meta.get("loss_scale"))
    runtime.scheduler.num_steps = meta["scheduler_num_steps"]
    runtime.scheduler.step(increment=0)
    return Progress(iteration=meta["iteration"], consumed_samples=meta["consumed_samples"])


def resume(root: str | None, runtime) -> int:
    """The consumed samples of a run that starts on `runtime`: those of the newest
    checkpoint under `root` (--load), loaded into it, or 0 without one."""
    if not root:
        return 0
    progress = load(root, runtime)
    if dist.get_rank() == 0:
        events.report(events.Load(progress.iteration, root))
    return progress.consumed_samples
