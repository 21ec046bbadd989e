"""The one writer of training scalars: it turns events into Megatron-LM's scalar tags
(plus the layout's, under `parcae/`) and hands each to every back-end.

The layout's rank 0, which reports the events, writes; Megatron-LM writes from its last
rank because only the last pipeline stage holds the loss there, which is also the rank
that prints its iteration line. Here the losses reach every rank and rank 0 prints.

A layout change can make another process rank 0. TensorBoard takes a file per process,
but the job's one wandb run must be held by one process at a time: it is closed at the
end of every layout and resumed by the next rank 0 at its first write.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from megatron_parcae.events import Evaluation, Iteration, LayoutChange, TrainingEvent
from megatron_parcae.scalars import ScalarBackend
from megatron_parcae.training.device import collective_timeout
from reconfig import planes
from reconfig.world import patient

# How long the other ranks wait at a layout change for rank 0 to finish its wandb run,
# which uploads what is left of it when online.
RUN_CLOSE_TIMEOUT = timedelta(minutes=5)


class MetricsWriter:
    """Scalars of the events it is given, to each back-end; back-ends open on first use,
    so that processes that never report leave no files."""

    def __init__(self, args: argparse.Namespace, flops_per_step: float) -> None:
        self.args = args
        self.flops_per_step = flops_per_step
        self._backends: list[ScalarBackend] | None = None  # this process's own, open until `close`
        self._run: ScalarBackend | None = None  # the job's wandb run, while this process holds it

    def iteration(self, event: Iteration, tp: int, pp: int, dp: int) -> None:
        """A training step, trained in layout T`tp` P`pp` D`dp`."""
        seconds = event.ms_per_iteration / 1000.0
        scalars = {
            **event.losses,
            "learning-rate": event.learning_rate,
            "grad-norm": event.grad_norm,
            "batch-size": float(event.global_batch_size),
            "iteration-time": seconds,
            "samples-per-second": event.global_batch_size / seconds,
            "throughput": tflops_per_gpu(self.flops_per_step, seconds, tp * pp * dp),
            "parcae/tensor-model-parallel-size": float(tp),
            "parcae/pipeline-model-parallel-size": float(pp),
            "parcae/data-parallel-size": float(dp),
        }
        if event.loss_scale is not None:
            scalars["loss-scale"] = event.loss_scale
        self._write(scalars, event.iteration)

    def reported(self, event: TrainingEvent) -> None:
        """An event `events.report` logged; iterations come with their layout through `iteration`."""
        if isinstance(event, Evaluation):
            self._write({f"{name} validation": value for name, value in event.losses.items()}, event.iteration)
        elif isinstance(event, LayoutChange):
            self._write({"parcae/layout-change-seconds": event.seconds}, event.iteration)

    def layout_ends(self) -> None:
        """A layout change begins (every rank of the ending layout calls this; collective
        with --wandb-project): rank 0 closes the wandb run, whether or not it is rank 0
        after the change (known only then), and the others wait for it, so the rank 0 of
        the next layout, any of them or a process they hand state to, resumes the run
        only once it is closed."""
        if self.args.wandb_project is None:
            return
        self.release_run()
        with patient(None, RUN_CLOSE_TIMEOUT, collective_timeout(self.args)):
            planes.control_barrier()

    def release_run(self) -> None:
        """Close the wandb run if this process holds it, without collectives: the layout
        broke (a collective failed), before this process waits for the one replacing it."""
        if self._run is not None:
            self._run.close()
            self._run = None

    def close(self) -> None:
        self.release_run()
        for backend in self._backends or ():
            backend.close()
        self._backends = None

    def _write(self, scalars: dict[str, float], step: int) -> None:
        if self._backends is None:
            self._backends = open_backends(self.args)
        if self._run is None and self.args.wandb_project is not None:
            from megatron_parcae.scalars.wandb_backend import WandbBackend

            self._run = WandbBackend(self.args)
        for backend in self._backends:
            backend.add_scalars(scalars, step)
        if self._run is not None:
            self._run.add_scalars(scalars, step)


def tflops_per_gpu(flops_per_step: float, seconds_per_step: float, gpus: int) -> float:
    """Megatron-LM's `throughput per GPU (TFLOP/s/GPU)`."""
    return flops_per_step / (seconds_per_step * 1e12 * gpus)


def open_backends(args: argparse.Namespace) -> list[ScalarBackend]:
    """The flags' back-ends of this process alone, wandb's run apart (imported only when
    asked for: each takes seconds to load)."""
    backends: list[ScalarBackend] = []
    if args.tensorboard_dir is not None:
        from megatron_parcae.scalars.tensorboard_backend import TensorBoardBackend

        backends.append(TensorBoardBackend(args.tensorboard_dir))
    return backends


def wanted(args: argparse.Namespace) -> bool:
    return args.tensorboard_dir is not None or args.wandb_project is not None
