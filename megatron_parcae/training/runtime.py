"""One layout's megatron-core objects (parallel state, model, optimizer, scheduler) and
the training step run on them.

The reconfiguration engine drops a `LayoutRuntime` and builds another at an iteration
boundary; what outlives a layout is `Progress` and the model's state itself.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    init_num_microbatches_calculator,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_parcae.training.data.datasets import rank_micro_batches, step_iterator, validation_batch_indices
from megatron_parcae.training.device import SETUP_TIMEOUT, collective_timeout
from megatron_parcae.training.models import build_model_chunk, transformer_config, wrap_for_training
from megatron_parcae.training.progress import Progress
from megatron_parcae.training.teardown import take_apart
from reconfig import planes
from reconfig.tensors import unwrap
from reconfig.world import patient, release_parallel_state


@dataclass
class StepResult:
    losses: dict[str, float]  # mean over the global batch, on every rank; empty unless reported
    grad_norm: float
    learning_rate: float
    seconds: float
    skipped: bool  # fp16 found an inf or NaN gradient: no update, the LR schedule holds
    loss_scale: float | None  # fp16's, after this step


def _loss_weight(num_local: int, num_total: int, dp_size: int) -> float:
    """Scale so that each update is the mean over all micro-batches of the global batch.

    megatron-core divides a micro-batch's loss by this rank's micro-batch count and DDP
    averages over D ranks; when D does not divide the count the ranks hold unequal
    shares, and this factor (1 when they are equal) corrects for it.
    """
    return num_local * dp_size / num_total


def _causal_mask(tokens: torch.Tensor) -> torch.Tensor:
    """The causal mask (True: masked), made here rather than by megatron-core, which makes
    it on "cuda" inside the layer: activation recomputation runs that again in backward."""
    s = tokens.shape[1]
    return torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1).view(1, 1, s, s)


def gpt_forward_step(weight: float, data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], _causal_mask(batch["tokens"]), labels=batch["labels"])

    def loss_func(output_tensor: torch.Tensor):
        mask = batch["loss_mask"].view(-1).float()
        loss = torch.sum(output_tensor.float().view(-1) * mask) / mask.sum()
        return loss * weight, {"lm loss": loss.detach()}

    return output, loss_func


def bert_forward_step(weight: float, data_iterator, model):
    batch = next(data_iterator)
    binary_head = getattr(unwrap(model), "add_binary_head", False)
    output = model(batch["text"], batch["padding_mask"],
                   tokentype_ids=batch["types"] if binary_head else None, lm_labels=batch["labels"])

    def loss_func(output_tensor):
        lm_out, sop_logits = output_tensor
        mask = batch["loss_mask"].view(-1).float()
        lm_loss = torch.sum(lm_out.float().view(-1) * mask) / mask.sum()
        reported = {"lm loss": lm_loss.detach()}
        loss = lm_loss
        if sop_logits is not None:
            sop_loss = torch.nn.functional.cross_entropy(sop_logits.view(-1, 2).float(),
                                                         batch["is_random"].view(-1).long())
            reported["sop loss"] = sop_loss.detach()
            loss = loss + sop_loss
        return loss * weight, reported

    return output, loss_func


def _seed_step(seed: int, iteration: int) -> None:
    """Dropout draws as a function of (seed, iteration, this rank's place in the layout), not
    of the generators' history: a run resumed from a checkpoint, or moved to other
    processes in place, draws what an uninterrupted run of the same layout draws."""
    torch.manual_seed(seed + iteration)
    model_parallel_cuda_manual_seed(seed + iteration)


class LayoutRuntime:
    """The megatron-core objects of one layout: parallel state, model, optimizer, scheduler."""

    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        self.args = args
        try:
            self._build(vocab_size)
        except BaseException:
            # A peer lost while the groups form: what was built would make the next
            # layout's initialize_model_parallel refuse ("already initialized").
            release_parallel_state()
            raise

    def _build(self, vocab_size: int) -> None:
        args = self.args
        ps.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            distributed_timeout_minutes=collective_timeout(args).total_seconds() / 60,
        )
        model_parallel_cuda_manual_seed(args.seed)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.config: TransformerConfig = transformer_config(args)
        chunk = build_model_chunk(args, self.config, vocab_size)
        self.model = [wrap_for_training(chunk, self.config, args)]
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, loss_scale=args.loss_scale,
                initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
                loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                params_dtype=self.config.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
                overlap_param_gather=args.overlap_param_gather,
            ),
            self.model,
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
            lr_decay_steps=args.lr_decay_iters * args.global_batch_size,
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
            wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style="constant",
        )
        # Wire the schedules to this layout's model and optimizer.
        self.config.no_sync_func = self.model[0].no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.forward_backward = get_forward_backward_func()
        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size,
                                         args.micro_batch_size, self.dp_size)
        _set_up_communicators(collective_timeout(args))

    def train_step(self, dataset, progress: Progress, report: bool) -> StepResult:
        """One global batch. With `report`, losses are reduced to every rank (a collective)."""
        args = self.args
        start = time.perf_counter()
        _seed_step(args.seed, progress.iteration)
        micro_batches = rank_micro_batches(progress.consumed_samples, args.global_batch_size,
                                           args.micro_batch_size, self.dp_rank, self.dp_size)
        total = args.global_batch_size // args.micro_batch_size
        step = bert_forward_step if args.model == "bert" else gpt_forward_step
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._schedule(step, _loss_weight(len(micro_batches), total, self.dp_size), dataset,
                                 micro_batches, forward_only=False)
        learning_rate = self.optimizer.param_groups[0]["lr"]
        # Every collective of the step before the update (the plain optimizer's step then
        # makes none after it): a rank that fails in one has not changed its state.
        losses = _global_mean_losses(outputs, total) if report else {}
        updated, grad_norm, _ = self.optimizer.step()
        if updated:  # as Megatron-LM: a skipped step's samples are consumed, not trained
            self.scheduler.step(increment=args.global_batch_size)
        loss_scale = float(self.optimizer.get_loss_scale().item()) if args.fp16 else None
        return StepResult(losses=losses, grad_norm=float(grad_norm or 0.0), learning_rate=learning_rate,
                          seconds=time.perf_counter() - start, skipped=not updated, loss_scale=loss_scale)

    def evaluate(self, dataset, iteration: int) -> dict[str, float]:
        """The validation losses at `iteration`, known to every rank: the mean over the
        evaluation's --eval-iters global batches, cut into micro-batches as a training step
        cuts its batch, forward only, without gradients and with dropout off. It draws no
        random numbers a step uses (each step seeds its own) and changes no state."""
        args = self.args
        step = bert_forward_step if args.model == "bert" else gpt_forward_step
        total = args.global_batch_size // args.micro_batch_size
        sums: dict[str, float] = {}
        for chunk in self.model:
            chunk.train(False)  # dropout off
        try:
            with torch.no_grad():
                for batch in validation_batch_indices(args, iteration):
                    micro_batches = rank_micro_batches(batch * args.global_batch_size, args.global_batch_size,
                                                       args.micro_batch_size, self.dp_rank, self.dp_size)
                    outputs = self._schedule(step, 1.0, dataset, micro_batches, forward_only=True)
                    for name, value in _global_mean_losses(outputs, total).items():
                        sums[name] = sums.get(name, 0.0) + value
        finally:
            for chunk in self.model:
                chunk.train()
        return {name: value / args.eval_iters for name, value in sums.items()}

    def _schedule(self, step, weight: float, dataset, micro_batches, forward_only: bool):
        """This rank's micro-batches through the layout's pipeline schedule."""
        return self.forward_backward(
            forward_step_func=partial(step, weight),
            data_iterator=step_iterator(dataset, micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only,
        )

    def destroy(self) -> None:
        """Drop this layout's objects and process groups (megatron-core forgets some).
        The objects are taken apart first: reference counting frees them as soon as
        this object goes, and this object holds none of them after."""
        if self.model is not None:
            take_apart(self.config, self.model)
        self.model = self.optimizer = self.scheduler = self.config = None
        release_parallel_state()


def _set_up_communicators(usual: timedelta) -> None:
    """One small data-plane collective on each of this layout's groups, allowed
    SETUP_TIMEOUT: NCCL forms a group's communicator at its first collective, which can
    take longer than a live job's short timeout, and must not be taken for a lost peer.
    Every rank goes through its groups in the same order."""
    groups = (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
              ps.get_data_parallel_group(with_context_parallel=True), ps.get_model_parallel_group(),
              ps.get_embedding_group(check_initialized=False))  # None on a middle pipeline stage
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            with patient(group, SETUP_TIMEOUT, usual):
                dist.all_reduce(planes.data_buffer(1, torch.float32), group=group)


def _global_mean_losses(outputs: list[dict[str, torch.Tensor]], total_micro_batches: int) -> dict[str, float]:
    """Mean of each loss over all micro-batches of the step, known to every rank.

    Last-stage ranks hold losses, each tensor-parallel rank the same ones; one all-reduce
    over WORLD sums those of tensor-parallel rank 0.
    """
    names = ("lm loss", "sop loss")
    if ps.get_tensor_model_parallel_rank() != 0:
        outputs = []
    sums = [sum(float(out[name]) for out in outputs if name in out) for name in names]
    present = [float(any(name in out for out in outputs)) for name in names]
    packed = planes.control_tensor(sums + present, torch.float64)
    dist.all_reduce(packed)
    return {name: float(packed[i]) / total_micro_batches for i, name in enumerate(names) if packed[len(names) + i] > 0}
