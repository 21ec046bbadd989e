"""Training state of a megatron-core model: main weights, Adam moments, step, loss scale.

Checkpoints and live migrations both need, for every parameter by its global name, this
rank's tensor-parallel shard of the fp32 main weight and of both Adam moments, plus
Adam's step count and fp16's loss-scaler state. megatron-core keeps these in different
places for the plain and the distributed optimizer (a flat range per data-parallel rank),
and Adam's step per parameter (torch) or per parameter group (Transformer Engine's and
apex's FusedAdam); this module hides that.
Megatron's own optimizer `sharded_state_dict` is not used: in 0.16.1 it mishandles
Adam's `step` without TE/Apex and shifts the tied embedding's state at P > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer

from reconfig import compat, planes
from reconfig.tensors import ParamShard, param_shards, unwrap

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
# The distributed optimizer's state is gathered over DP this many elements at a time, so
# the device holds one chunk of full state beside the layout, not all of it.
GATHER_CHUNK_ELEMENTS = 1 << 24


@dataclass
class ParamState:
    """One parameter's state on this rank, each tensor shaped like the local TP shard."""

    shard: ParamShard
    tensors: dict[str, torch.Tensor]


def _optimizers(optimizer) -> list:
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers under a megatron-core optimizer (chained or not)."""
    return [opt.optimizer for opt in _optimizers(optimizer)]


def _main_params(opt) -> dict[torch.nn.Parameter, torch.Tensor]:
    """model param -> fp32 main param, for a plain (not distributed) megatron optimizer."""
    if hasattr(opt, "float16_groups"):
        pairs = {m: p for mg, pg in zip(opt.float16_groups, opt.fp32_from_float16_groups) for m, p in zip(mg, pg)}
        pairs.update({p: p for group in opt.fp32_from_fp32_groups for p in group})
        return pairs
    return {p: p for group in opt.optimizer.param_groups for p in group["params"]}


def _managed(opt: DistributedOptimizer) -> set[torch.nn.Parameter]:
    """Every parameter whose state `opt` keeps (its model_param_gbuf_map lists only this DP rank's)."""
    return {p for buffer in opt.buffers for p in buffer.param_index_map}


def _shards(model_chunks) -> list[ParamShard]:
    return [shard for chunk in model_chunks for shard in param_shards(unwrap(chunk))]


def initialize_optimizer_states(optimizer) -> None:
    """Create Adam's lazily made state so that it can be written before the first step."""
    for opt in _optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            compat.init_distributed_optimizer_states(opt)
            continue
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        opt.optimizer.step()
        opt.optimizer.zero_grad()


def step_count(optimizer) -> int:
    """Adam's step count: the updates applied (a skipped fp16 step applies none)."""
    for opt in _optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            if "step" in group:  # FusedAdam keeps one per group
                return int(group["step"])
        for state in opt.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
    return 0


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scaler: the scale and the counters that decide its next change.

    Without them a resumed or migrated fp16 run would restart from the initial scale and
    skip steps an uninterrupted run trains."""

    scale: float
    growth_tracker: int
    hysteresis_tracker: int

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    @classmethod
    def from_dict(cls, raw: object) -> LossScale:
        """From JSON, validated: a positive finite scale, a growth count >= 0 and the
        hysteresis left (megatron-core counts it below 0 while overflows go on)."""
        if not isinstance(raw, dict) or set(raw) != {"scale", "growth_tracker", "hysteresis_tracker"}:
            raise ValueError("a loss scale is {scale, growth_tracker, hysteresis_tracker}")
        scale, growth, hysteresis = raw["scale"], raw["growth_tracker"], raw["hysteresis_tracker"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(f"loss scale {scale!r} is not a positive finite number")
        for value in (growth, hysteresis):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"loss-scale counter {value!r} is not an integer")
        if growth < 0:
            raise ValueError(f"loss-scale growth count {growth} is negative")
        return cls(float(scale), growth, hysteresis)


def _dynamic_scalers(optimizer) -> list:
    """The optimizer's dynamic loss scalers (fp16 without --loss-scale); none otherwise."""
    scalers = [getattr(opt, "grad_scaler", None) for opt in _optimizers(optimizer)]
    return [s for s in scalers if s is not None and "growth_tracker" in s.state_dict()]


def loss_scale_state(optimizer) -> LossScale | None:
    """The dynamic loss scaler's state, or None where there is none."""
    scalers = _dynamic_scalers(optimizer)
    if not scalers:
        return None
    state = scalers[0].state_dict()
    return LossScale(float(state["scale"].item()), int(state["growth_tracker"]), int(state["hysteresis_tracker"]))


def load_loss_scale_state(optimizer, state: LossScale | None) -> None:
    """Give the dynamic loss scaler `state`; None (a run without one) keeps the initial scale."""
    if state is None:
        return
    for scaler in _dynamic_scalers(optimizer):
        scale = scaler.state_dict()["scale"]
        scaler.load_state_dict({"scale": torch.full_like(scale, state.scale), "growth_tracker": state.growth_tracker,
                                "hysteresis_tracker": state.hysteresis_tracker})


def export_param_states(model_chunks, optimizer, into: planes.HostArena | None = None) -> list[ParamState]:
    """This rank's state of every local parameter, in host memory (a collective over DP
    with the distributed optimizer): a layout change or a save then needs no device
    memory beyond the layout's own. With `into`, the state is written there, each
    parameter's keys one after another in STATE_KEYS order (a snapshot sends it as is)."""
    shards = _shards(model_chunks)
    by_param = {s.param: s for s in shards}
    out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    optimizers = _optimizers(optimizer)
    if into is not None:
        managed = [s.param.numel() for opt in optimizers if isinstance(opt, DistributedOptimizer)
                   for s in shards if s.param in _managed(opt)]
        plain = [main.numel() for opt in optimizers if not isinstance(opt, DistributedOptimizer)
                 for main in _main_params(opt).values()]
        into.reset(len(STATE_KEYS) * (sum(managed) + sum(plain)))
    for opt in optimizers:
        if isinstance(opt, DistributedOptimizer):
            managed = _managed(opt)
            out.update(_gather_distributed(opt, [s for s in shards if s.param in managed], into))
            continue
        for model_param, main in _main_params(opt).items():
            state = opt.optimizer.state.get(main, {})
            out[model_param] = {"param": planes.host_copy(main, into)}
            for k in STATE_KEYS[1:]:
                if k in state:
                    out[model_param][k] = planes.host_copy(state[k], into)
                elif into is not None:
                    out[model_param][k] = into.take(main.shape).zero_()
                else:
                    out[model_param][k] = torch.zeros(main.shape, dtype=torch.float32)
    planes.host_copies_done()
    return [ParamState(by_param[p], tensors) for p, tensors in out.items() if p in by_param]


def chunks_of(sizes: list[int], limit: int) -> list[range]:
    """Consecutive index ranges whose sizes sum to at most `limit` (or one item above it)."""
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            out.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _gather_distributed(opt: DistributedOptimizer, shards: list[ParamShard],
                        into: planes.HostArena | None = None) -> dict:
    """Every DP rank holds a flat range of each parameter's state: sum the disjoint ranges,
    a chunk of parameters at a time, into host memory."""
    sizes = [s.param.numel() for s in shards]
    out = {}
    for chunk in chunks_of(sizes, GATHER_CHUNK_ELEMENTS):
        total = sum(sizes[i] for i in chunk)
        flat = planes.data_buffer(len(STATE_KEYS) * total, torch.float32)
        rows = flat.view(len(STATE_KEYS), total)
        offset = 0
        for i in chunk:
            shard = shards[i]
            if shard.param in opt.model_param_group_index_map:
                rng = compat.param_range(opt, shard.param)
                local = compat.main_param_and_optimizer_states(opt, shard.param)
                for k, key in enumerate(STATE_KEYS):
                    if key in local:  # Adam makes its moments at its first update: fp16 may skip many
                        rows[k, offset + rng.start: offset + rng.end] = local[key].detach().float().view(-1)
            offset += sizes[i]
        dist.all_reduce(flat, group=ps.get_data_parallel_group())
        offset = 0
        for i in chunk:
            out[shards[i].param] = {key: planes.host_copy(rows[k, offset: offset + sizes[i]].view(shards[i].param.shape), into)
                                    for k, key in enumerate(STATE_KEYS)}
            offset += sizes[i]
        planes.host_copies_done()  # before the chunk's device buffer is reused
    return out


def import_param_states(model_chunks, optimizer, states: dict[str, dict[str, torch.Tensor]], step: int,
                        partial: bool = False) -> None:
    """Write main weights, moments and step count for every local parameter, by global name
    (with `partial`, for those `states` has: a caller that fills the layout a part at a time).

    `states[global_name][key]` is shaped like this rank's TP shard. Optimizer states must
    exist (`initialize_optimizer_states`).
    """
    shards = _shards(model_chunks)
    missing = sorted({s.global_name for s in shards} - states.keys())
    if missing and not partial:
        raise KeyError(f"no state for parameters {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    by_param = {s.param: states[s.global_name] for s in shards if s.global_name in states}
    with torch.no_grad():
        for opt in _optimizers(optimizer):
            if isinstance(opt, DistributedOptimizer):
                managed = _managed(opt)
                for model_param, tensors in by_param.items():
                    if model_param not in managed:
                        continue
                    model_param.copy_(tensors["param"])
                    if model_param in opt.model_param_group_index_map:
                        rng = compat.param_range(opt, model_param)
                        local = compat.main_param_and_optimizer_states(opt, model_param)
                        for key in STATE_KEYS:
                            local[key].copy_(tensors[key].reshape(-1)[rng.start: rng.end].view_as(local[key]))
                continue
            for model_param, main in _main_params(opt).items():
                tensors = by_param.get(model_param)
                if tensors is None:
                    continue
                main.copy_(tensors["param"])
                model_param.copy_(tensors["param"])
                state = opt.optimizer.state[main]
                state["exp_avg"].copy_(tensors["exp_avg"])
                state["exp_avg_sq"].copy_(tensors["exp_avg_sq"])
    set_step_count(optimizer, step)


def set_step_count(optimizer, step: int) -> None:
    """Set Adam's step count wherever the optimizer keeps it (per group and per parameter)."""
    for opt in _optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            if "step" in group:
                _set_step(group, step)
        for state in opt.optimizer.state.values():
            _set_step(state, step)


def _set_step(holder: dict, step: int) -> None:
    """Give this parameter (or group) its own step (megatron can leave one tensor shared by all)."""
    old = holder.get("step")
    holder["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device) if torch.is_tensor(old) else step
