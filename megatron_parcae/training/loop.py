"""The training loop of scripts/pretrain_gpt.py and scripts/pretrain_bert.py, on megatron-core.

Megatron-LM's own loop keeps model, optimizer and iterators as locals and asserts CUDA
(docs/megatron-core.md), so this one is written for megatron-core directly. The loop
owns steps, logging and checkpoints; a layout hook (training/hooks/) owns WORLD and the
layout, and hands the loop the runtime to train with at every iteration boundary.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

import torch.distributed as dist

from megatron_parcae import events
from megatron_parcae.control.agent import FENCED_EXIT
from megatron_parcae.control.etcd.client import EtcdClient, EtcdGone
from megatron_parcae.training import checkpointing
from megatron_parcae.training.data.datasets import build_datasets, build_tokenizer
from megatron_parcae.training.device import collective_timeout
from megatron_parcae.training.exit_signal import ExitSignal
from megatron_parcae.training.hooks import build_hook
from megatron_parcae.training.hooks.live import LiveJobError, WorkerFenced
from megatron_parcae.training.metrics.flops import model_flops_per_step
from megatron_parcae.training.metrics.writer import MetricsWriter, tflops_per_gpu, wanted
from megatron_parcae.training.models import padded_vocab_size
from megatron_parcae.training.progress import Progress
from megatron_parcae.training.runtime import LayoutRuntime
from reconfig.optimizer_state import step_count
from reconfig.world import release_all


def _fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code


def _fenced_exit() -> int:
    """FENCED_EXIT, but 0 beside other local ranks of one torchrun: torchrun takes a
    failed rank down with its whole node, and the job dropped only this one."""
    return 0 if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1 else FENCED_EXIT


def _collect_from_now_on() -> None:
    """All built so far lives as long as the process: frozen out of the cyclic collector's
    sight, it is not scanned again by its full collections (a dropped layout needs none:
    reference counting frees it, training/teardown.py). scripts/pretrain_*.py import and
    set up with the collector paused, as torch and megatron-core make about 290,000
    objects it would walk again and again (a sixth of a process's start,
    benchmarks/results/startup_cpu.txt); it collects from here on."""
    gc.freeze()
    gc.enable()


def run_training(args: argparse.Namespace, prog: str, client: EtcdClient | None = None) -> int:
    """Train as `args` say; the arguments were validated before any process group exists.

    Without --parcae the layout is fixed. With --parcae-layout-schedule, or with `client`
    (connected to --parcae-etcd), a reconfiguration hook changes it in place.
    """
    tokenizer = build_tokenizer(args)
    vocab = padded_vocab_size(tokenizer.vocab_size, args)
    flops_per_step = model_flops_per_step(args.model, args.num_layers, args.hidden_size, args.ffn_hidden_size,
                                          args.seq_length, vocab, args.global_batch_size,
                                          binary_head=args.model == "bert" and not args.bert_no_binary_head)
    metrics = MetricsWriter(args, flops_per_step) if wanted(args) else None
    events.open_training_events(args.parcae_events, metrics.reported if metrics is not None else None)
    exit_signal = ExitSignal() if args.exit_signal_handler else None
    checkpoints = checkpointing.Checkpointer(args.save, args.async_save, collective_timeout(args))

    def before_change() -> None:
        checkpoints.finish()  # a change releases the WORLD a save in flight needs
        if metrics is not None:
            metrics.layout_ends()  # the next layout's rank 0 may be another process

    hook = build_hook(args, vocab, LayoutRuntime, client, before_change=before_change)
    dataset, valid_dataset = build_datasets(args, tokenizer)
    _collect_from_now_on()
    finished = None
    try:
        try:
            runtime, consumed = hook.start()
        except checkpointing.CheckpointError as exc:
            return _fail(prog, str(exc), 2) if dist.get_rank() == 0 else 2
        if runtime is None:
            return 0  # a worker no change placed
        progress = Progress.at(consumed, args.global_batch_size)
        unlogged: events.Iteration | None = None  # the newest step, logged by a rank 0 that may be lost
        window_start, window_iters, window_skipped = time.perf_counter(), 0, 0
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
                logged = (progress.iteration + 1) % args.log_interval == 0 or progress.iteration + 1 == args.train_iters
                charted = metrics is not None and (progress.iteration + 1) % args.tensorboard_log_interval == 0
                result = runtime.train_step(dataset, progress, logged or charted)
                progress.iteration += 1  # the step is applied: what fails from here on keeps it
                progress.consumed_samples += args.global_batch_size
                window_iters += 1
                window_skipped += result.skipped
                unlogged = None
                if logged or charted:
                    elapsed_ms = (time.perf_counter() - window_start) * 1000.0 / window_iters
                    # Adam counts the updates applied; every other step was skipped.
                    skipped_total = progress.iteration - step_count(runtime.optimizer)
                    tp, pp, dp = (runtime.args.tensor_model_parallel_size, runtime.args.pipeline_model_parallel_size,
                                  runtime.dp_size)
                    tflops = tflops_per_gpu(flops_per_step, elapsed_ms / 1000.0, tp * pp * dp)
                    iteration = events.Iteration(
                        progress.iteration, args.train_iters, progress.consumed_samples, args.global_batch_size,
                        result.losses, result.grad_norm, result.learning_rate, elapsed_ms,
                        progress.consumed_samples - skipped_total * args.global_batch_size, window_skipped,
                        result.loss_scale, tflops if args.log_throughput else None)
                    if dist.get_rank() == 0:
                        if logged:
                            events.report(iteration)
                        if charted:
                            metrics.iteration(iteration, tp, pp, dp)
                    elif logged:
                        unlogged = iteration  # by this rank: logged again should rank 0 be lost unrecorded
                    if logged:
                        window_start, window_iters, window_skipped = time.perf_counter(), 0, 0
                hook.trained(progress.consumed_samples)  # after the log: its record says the step was logged
                if valid_dataset is not None and progress.iteration % args.eval_interval == 0:
                    eval_start = time.perf_counter()
                    valid_losses = runtime.evaluate(valid_dataset, progress.iteration)
                    if dist.get_rank() == 0:
                        events.report(events.Evaluation(progress.iteration, args.eval_iters, valid_losses))
                    window_start += time.perf_counter() - eval_start  # as Megatron-LM: not a step's time
                if args.save_interval and progress.iteration % args.save_interval == 0:
                    checkpoints.save(runtime, progress)
                checkpoints.poll()
                if args.exit_interval and progress.iteration % args.exit_interval == 0:
                    exit_at = progress.iteration
                if exit_signal is not None and exit_signal.received_anywhere():
                    exit_at = progress.iteration
                    if dist.get_rank() == 0:
                        print(f" exiting after receiving SIGTERM, at iteration {exit_at}", flush=True)
                if progress.iteration in (args.train_iters, exit_at):
                    continue
                runtime, consumed = hook.advance(runtime, progress.consumed_samples)  # the boundary between steps
            except RuntimeError as exc:
                if not hook.can_recover(exc):
                    raise
                checkpoints.abandon()
                if metrics is not None:
                    metrics.release_run()
                runtime, consumed = hook.recover(runtime, progress.consumed_samples, exc)
                if unlogged is not None and runtime is not None and hook.logs_again(unlogged.consumed_samples):
                    events.report(dataclasses.replace(unlogged, relogged=True, time=time.time()))
                unlogged = None
            if runtime is None:
                return 0  # left the job
            progress = Progress.at(consumed, args.global_batch_size)
        runtime.destroy()
        finished = progress.consumed_samples
        return 0
    except (LiveJobError, EtcdGone) as exc:
        return _fail(prog, str(exc), _fenced_exit() if isinstance(exc, WorkerFenced) else 1)
    finally:
        hook.finish(finished)
        if metrics is not None:
            metrics.close()
        if exit_signal is not None:
            exit_signal.restore()
        release_all()  # aborted, not destroyed, where WORLD broke: a broken NCCL communicator can hang
