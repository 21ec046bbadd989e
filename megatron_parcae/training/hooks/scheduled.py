"""`--parcae-layout-schedule`: layout changes at given iterations, under one torchrun."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch.distributed as dist

from megatron_parcae import events
from megatron_parcae.training import checkpointing
from megatron_parcae.training.device import initialize_distributed
from megatron_parcae.training.hooks.base import TorchrunHook
from reconfig.execute import (PayloadBroken, Runtime, RuntimeFactory, change_figures, hand_over, layout_args,
                              migrate)
from reconfig.layout import ModelShape, Parallelism
from reconfig.schedule import ScheduledMigration, parse_layout_schedule, plan_schedule
from reconfig.world import World


CHANGE_ATTEMPTS = 3


class ScheduledReconfiguration(TorchrunHook):
    """The changes of the schedule, planned up front and applied in order. Workers that
    only a later layout uses (`join=`) wait on standby until it places them."""

    def __init__(self, args: argparse.Namespace, vocab_size: int,
                 runtime_factory: Callable[[argparse.Namespace, int], Runtime],
                 before_change: Callable[[], None]) -> None:
        initialize_distributed()
        self.args = args
        self.world = World.from_torchrun()
        self.initial = Parallelism(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                   args.data_parallel_size, args.stage_layers)
        migrations = plan_schedule(parse_layout_schedule(args.parcae_layout_schedule), self.initial,
                                   dist.get_world_size(), ModelShape.from_args(args, vocab_size),
                                   args.use_distributed_optimizer)
        self.migrations = [m for m in migrations if m.iteration < args.train_iters]
        self.generation = 0  # the last one this worker took part in
        self.samples_per_iteration = args.global_batch_size
        self.build: RuntimeFactory = lambda p: runtime_factory(layout_args(args, p), vocab_size)
        self.before_change = before_change  # complete what needs this WORLD (a save in flight)

    def start(self) -> tuple[Runtime | None, int]:
        """The first layout this worker is in (None: never used)."""
        active = tuple(range(self.initial.world_size))
        if self.world.members != active:
            self.world.reform(active, "g0")
        if self.world.worker in active:
            runtime = self.build(self.initial)
            return runtime, checkpointing.resume(self.args.load, runtime, self.args.finetune)
        return self._join_after(0)

    def advance(self, runtime: Runtime, consumed_samples: int) -> tuple[Runtime | None, int]:
        """Apply the change due at this iteration boundary, if any.

        A worker left on standby waits here for the change that places it again.
        """
        iteration = consumed_samples // self.samples_per_iteration
        due = next((m for m in self.migrations if m.iteration == iteration and m.generation > self.generation), None)
        if due is None:
            return runtime, consumed_samples
        self.before_change()
        started = time.perf_counter()
        new, consumed_samples = self._run(due, runtime)
        if new is not None and dist.get_rank() == 0:
            figures = change_figures(due.plan, started)
            events.report(events.LayoutChange.of_migration(due.generation, iteration, figures))
        if new is not None or self.world.worker in due.plan.request.leaving:
            return new, consumed_samples
        return self._join_after(due.generation)

    def _run(self, migration: ScheduledMigration, runtime: Runtime | None) -> tuple[Runtime | None, int]:
        """Apply `migration`; one whose transfers arrive damaged is taken again from the
        state each worker kept (every worker of the WORLD learns it together)."""
        self.generation = migration.generation
        held = None if runtime is None else hand_over(runtime)
        for attempt in range(1, CHANGE_ATTEMPTS + 1):
            try:
                return migrate(migration.plan, migration.generation, self.world, held, self.build,
                               migration.iteration * self.samples_per_iteration)
            except PayloadBroken as exc:
                if attempt == CHANGE_ATTEMPTS:
                    raise
                if dist.get_rank() == 0:
                    events.report(events.ChangeRetried(migration.generation, migration.iteration, attempt,
                                                       str(exc).splitlines()[0][:300]))
        raise AssertionError("unreachable")

    def _join_after(self, generation: int) -> tuple[Runtime | None, int]:
        for m in self.migrations:
            if m.generation > generation and self.world.worker in m.plan.new.workers:
                return self._run(m, None)
        return None, 0
