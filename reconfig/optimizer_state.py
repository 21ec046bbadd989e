"""Per-parameter training state of a megatron-core model: main weights and Adam moments.

Checkpoints and live migrations both need, for every parameter by its global name, this
rank's tensor-parallel shard of the fp32 main weight and of both Adam moments, plus
Adam's step count. megatron-core keeps these in different places for the plain and the
distributed optimizer (a flat range per data-parallel rank); this module hides that.
Megatron's own optimizer `sharded_state_dict` is not used: in 0.16.1 it mishandles
Adam's `step` without TE/Apex and shifts the tied embedding's state at P > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer

from reconfig import compat
from reconfig.tensors import ParamShard, param_shards, unwrap

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class ParamState:
    """One parameter's state on this rank, each tensor shaped like the local TP shard."""

    shard: ParamShard
    tensors: dict[str, torch.Tensor]


def _optimizers(optimizer) -> list:
    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


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
    for opt in _optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
    return 0


def export_param_states(model_chunks, optimizer) -> list[ParamState]:
    """This rank's state of every local parameter (a collective over DP with the distributed optimizer)."""
    shards = _shards(model_chunks)
    by_param = {s.param: s for s in shards}
    out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for opt in _optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            managed = _managed(opt)
            out.update(_gather_distributed(opt, [s for s in shards if s.param in managed]))
            continue
        for model_param, main in _main_params(opt).items():
            state = opt.optimizer.state.get(main, {})
            out[model_param] = {
                "param": main.detach().float().clone(),
                **{k: state[k].detach().float().clone() if k in state else torch.zeros_like(main, dtype=torch.float32)
                   for k in STATE_KEYS[1:]},
            }
    return [ParamState(by_param[p], tensors) for p, tensors in out.items() if p in by_param]


def _gather_distributed(opt: DistributedOptimizer, shards: list[ParamShard]) -> dict:
    """Every DP rank holds a flat range of each parameter's state: sum the disjoint ranges."""
    sizes = [s.param.numel() for s in shards]
    flat = torch.zeros(len(STATE_KEYS), sum(sizes), dtype=torch.float32, device=shards[0].param.device)
    offset = 0
    for shard, size in zip(shards, sizes):
        if shard.param in opt.model_param_group_index_map:
            rng = compat.param_range(opt, shard.param)
            local = compat.main_param_and_optimizer_states(opt, shard.param)
            for i, key in enumerate(STATE_KEYS):
                flat[i, offset + rng.start: offset + rng.end] = local[key].detach().float().view(-1)
        offset += size
    dist.all_reduce(flat, group=ps.get_data_parallel_group())
    out, offset = {}, 0
    for shard, size in zip(shards, sizes):
        out[shard.param] = {key: flat[i, offset: offset + size].view(shard.param.shape).clone()
                            for i, key in enumerate(STATE_KEYS)}
        offset += size
    return out


def import_param_states(model_chunks, optimizer, states: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    """Write main weights, moments and step count for every local parameter, by global name.

    `states[global_name][key]` is shaped like this rank's TP shard. Optimizer states must
    exist (`initialize_optimizer_states`).
    """
    shards = _shards(model_chunks)
    missing = sorted({s.global_name for s in shards} - states.keys())
    if missing:
        raise KeyError(f"no state for parameters {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    by_param = {s.param: states[s.global_name] for s in shards}
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
                tensors = by_param[model_param]
                main.copy_(tensors["param"])
                model_param.copy_(tensors["param"])
                state = opt.optimizer.state[main]
                state["exp_avg"].copy_(tensors["exp_avg"])
                state["exp_avg_sq"].copy_(tensors["exp_avg_sq"])
    for opt in _optimizers(optimizer):
        for state in opt.optimizer.state.values():
            _set_step(state, step)


def _set_step(state: dict, step: int) -> None:
    """Give this parameter its own step tensor (megatron can leave one shared by all)."""
    state["step"] = torch.tensor(float(step)) if torch.is_tensor(state.get("step")) else step
