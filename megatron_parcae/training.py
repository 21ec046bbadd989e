"""The training loop of scripts/pretrain_gpt.py and scripts/pretrain_bert.py, on megatron-core.

Megatron-LM's own loop keeps model, optimizer and iterators as locals and asserts CUDA
(../shared/notes), so this one is written for megatron-core directly. Everything built
for a layout lives in one `LayoutRuntime`, which the reconfiguration engine can drop and
rebuild at an iteration boundary; what outlives a layout is `Progress` (iteration and
consumed samples) and the model's state itself.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
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

from megatron_parcae.agent import FENCED_EXIT
from megatron_parcae.cpu import enable_cpu_support
from megatron_parcae.data.datasets import build_tokenizer, build_train_dataset, rank_micro_batches, step_iterator
from megatron_parcae.etcd.client import EtcdClient
from megatron_parcae.live import LiveJobError, LiveReconfiguration, WorkerFenced, collective_timeout
from megatron_parcae.models import build_model_chunk, padded_vocab_size, transformer_config, wrap_for_training
from reconfig.execute import ScheduledReconfiguration
from reconfig.tensors import unwrap
from reconfig.world import is_peer_failure, release_parallel_state


@dataclass
class Progress:
    """What a run has done; the only training state besides the model's own."""

    iteration: int = 0
    consumed_samples: int = 0


@dataclass
class StepResult:
    losses: dict[str, float]  # mean over the global batch, on every rank; empty unless reported
    grad_norm: float
    learning_rate: float
    seconds: float


def _loss_weight(num_local: int, num_total: int, dp_size: int) -> float:
    """Scale so that each update is the mean over all micro-batches of the global batch.

    megatron-core divides a micro-batch's loss by this rank's micro-batch count and DDP
    averages over D ranks; when D does not divide the count the ranks hold unequal
    shares, and this factor (1 when they are equal) corrects for it.
    """
    return num_local * dp_size / num_total


def gpt_forward_step(weight: float, data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

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
        self.model = [wrap_for_training(chunk, self.config, args.use_distributed_optimizer)]
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
                params_dtype=self.config.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
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

    def train_step(self, dataset, progress: Progress, report: bool) -> StepResult:
        """One global batch. With `report`, losses are reduced to every rank (a collective)."""
        args = self.args
        start = time.perf_counter()
        micro_batches = rank_micro_batches(progress.consumed_samples, args.global_batch_size,
                                           args.micro_batch_size, self.dp_rank, self.dp_size)
        total = args.global_batch_size // args.micro_batch_size
        step = bert_forward_step if args.model == "bert" else gpt_forward_step
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self.forward_backward(
            forward_step_func=partial(step, _loss_weight(len(micro_batches), total, self.dp_size)),
            data_iterator=step_iterator(dataset, micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        learning_rate = self.optimizer.param_groups[0]["lr"]
        # Every collective of the step before the update (the plain optimizer's step then
        # makes none after it): a rank that fails in one has not changed its state.
        losses = _global_mean_losses(outputs, total) if report else {}
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=args.global_batch_size)
        return StepResult(losses=losses, grad_norm=float(grad_norm or 0.0),
                          learning_rate=learning_rate, seconds=time.perf_counter() - start)

    def destroy(self) -> None:
        """Drop this layout's objects and process groups (megatron-core forgets some)."""
        self.model = self.optimizer = self.scheduler = None
        release_parallel_state()


def _global_mean_losses(outputs: list[dict[str, torch.Tensor]], total_micro_batches: int) -> dict[str, float]:
    """Mean of each loss over all micro-batches of the step, known to every rank.

    Last-stage ranks hold losses, each tensor-parallel rank the same ones; one all-reduce
    over WORLD sums those of tensor-parallel rank 0.
    """
    names = ("lm loss", "sop loss")
    sums = torch.zeros(len(names), dtype=torch.float64)
    if ps.get_tensor_model_parallel_rank() != 0:
        outputs = []
    for out in outputs:
        for i, name in enumerate(names):
            if name in out:
                sums[i] += float(out[name])
    present = torch.tensor([float(any(n in o for o in outputs)) for n in names], dtype=torch.float64)
    packed = torch.cat([sums, present])
    dist.all_reduce(packed)
    return {name: float(packed[i]) / total_micro_batches for i, name in enumerate(names) if packed[len(names) + i] > 0}


def format_log_line(args: argparse.Namespace, progress: Progress, result: StepResult, ms_per_iter: float) -> str:
    parts = [
        f" iteration {progress.iteration:8d}/{args.train_iters:8d}",
        f"consumed samples: {progress.consumed_samples:12d}",
        f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
        f"learning rate: {result.learning_rate:.6E}",
        f"global batch size: {args.global_batch_size:5d}",
        *(f"{name}: {value:.6E}" for name, value in result.losses.items()),
        f"grad norm: {result.grad_norm:.6f}",
    ]
    return " | ".join(parts) + " |"


def prepare_device() -> None:
    """The GPU of LOCAL_RANK, or megatron-core's CPU support when there is none."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        enable_cpu_support()


def initialize_distributed() -> None:
    """torch.distributed from torchrun's environment (a single process runs without torchrun)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    prepare_device()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=10))


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code


def run_training(args: argparse.Namespace, prog: str, client: EtcdClient | None = None) -> int:
    """Train as `args` say; the arguments were validated before any process group exists.

    Without --parcae the layout is fixed. With --parcae-layout-schedule, or with `client`
    (connected to --parcae-etcd), a reconfiguration hook owns WORLD: it gives the loop the
    runtime to train with at every iteration boundary, and the samples the job has consumed.
    """
    if client is not None:
        prepare_device()
    else:
        initialize_distributed()
    from megatron_parcae import checkpointing

    tokenizer = build_tokenizer(args)
    vocab = padded_vocab_size(tokenizer.vocab_size, args)
    dataset = build_train_dataset(args, tokenizer)
    hook = None
    if client is not None:
        hook = LiveReconfiguration(args, vocab, LayoutRuntime, client)
    elif args.parcae_layout_schedule:
        hook = ScheduledReconfiguration(args, vocab, LayoutRuntime)
    checkpoints = checkpointing.Checkpointer(args.save, args.async_save)
    # All built so far lives as long as the process. Out of the cyclic collector's sight,
    # it is not scanned again by the full collection each layout change makes to free the
    # old layout (reconfig.execute.release_runtime): 3-7 ms instead of 0.3-0.9 s on CPU.
    gc.freeze()
    if hook is not None:
        hook.before_change = checkpoints.finish  # a change releases the WORLD a save in flight needs
    finished = None
    try:
        if hook is not None:
            runtime, consumed = hook.start()
            if runtime is None:
                return 0  # a worker no change placed
        else:
            runtime, consumed = LayoutRuntime(args, vocab), 0
        progress = Progress(consumed // args.global_batch_size, consumed)
        if args.load and client is None:
            try:
                progress = checkpointing.load(args.load, runtime)
            except checkpointing.CheckpointError as exc:
                return _fail(prog, str(exc), 2) if dist.get_rank() == 0 else 2
            if dist.get_rank() == 0:
                print(f" loaded checkpoint {args.load} at iteration {progress.iteration}", flush=True)
        window_start, window_iters = time.perf_counter(), 0
        exit_at = None  # the iteration --exit-interval stops at, once reached
        while True:
            try:
                if progress.iteration >= args.train_iters or progress.iteration == exit_at:
                    # The final save, inside the loop: a peer that dies during it is
                    # recovered from like one that dies in a step, and the save is redone
                    # (also one of this iteration's interval that was abandoned).
                    checkpoints.finish()
                    if args.save and checkpoints.behind(progress.iteration):
                        checkpoints.save(runtime, progress)
                        checkpoints.finish()
                    break
                report = (progress.iteration + 1) % args.log_interval == 0 or progress.iteration + 1 == args.train_iters
                result = runtime.train_step(dataset, progress, report)
                progress.iteration += 1  # the step is applied: what fails from here on keeps it
                progress.consumed_samples += args.global_batch_size
                if isinstance(hook, LiveReconfiguration):
                    hook.trained(progress.consumed_samples)
                window_iters += 1
                if report:
                    elapsed_ms = (time.perf_counter() - window_start) * 1000.0 / window_iters
                    if dist.get_rank() == 0:
                        print(format_log_line(args, progress, result, elapsed_ms), flush=True)
                    window_start, window_iters = time.perf_counter(), 0
                if args.save_interval and progress.iteration % args.save_interval == 0:
                    checkpoints.save(runtime, progress)
                checkpoints.poll()
                if args.exit_interval and progress.iteration % args.exit_interval == 0:
                    exit_at = progress.iteration
                if hook is None or progress.iteration in (args.train_iters, exit_at):
                    continue
                runtime, consumed = hook.advance(runtime, progress.consumed_samples)  # the boundary between steps
            except RuntimeError as exc:
                if not isinstance(hook, LiveReconfiguration) or not is_peer_failure(exc):
                    raise
                checkpoints.abandon()
                runtime, consumed = hook.recover(runtime, progress.consumed_samples, exc)
            if runtime is None:
                return 0  # left the job
            progress = Progress(consumed // args.global_batch_size, consumed)
        runtime.destroy()
        finished = progress.consumed_samples
        return 0
    except LiveJobError as exc:
        return _fail(prog, str(exc), FENCED_EXIT if isinstance(exc, WorkerFenced) else 1)
    finally:
        if hook is not None:
            hook.finish(finished)
        if dist.is_initialized():
            dist.destroy_process_group()
