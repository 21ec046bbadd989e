"""--wandb-project: scalars to Weights & Biases (WANDB_MODE=offline keeps them local).
wandb is not a dependency: the arguments refuse the flag where it is not installed.

A job writes one run, whichever processes are its layout's rank 0 over its life: the
run's id comes from what every worker of the job knows (`job_run_id`), and each process
that becomes rank 0 resumes that run. The training writer (training/metrics/) makes sure
that only one process holds it at a time."""

from __future__ import annotations

import argparse
import hashlib
import os
import uuid
from pathlib import Path

import wandb

# The x-axis of every chart: the training iteration, logged as a value. wandb's own step
# goes on from the server's last one in a resumed run and drops rows logged at a lower
# step, so iterations given as steps would be lost where a process resumes at an iteration
# already written (a layout change's seconds come at the one the last rank 0 ended at).
STEP_METRIC = "iteration"

# The job of a launch that names none (no live job, no --save, torchrun without a
# rendezvous id): this process alone, the only one that can be its rank 0 then, unless
# a layout schedule moves rank 0, which then starts another run.
_THIS_PROCESS = uuid.uuid4().hex


def job_run_id(args: argparse.Namespace) -> str:
    """The run id of the job: the same in each of its processes, and in a later launch
    that resumes it. The job is the live job (--parcae-job), else the --save folder, else
    the torchrun launch (its rendezvous id; --standalone makes a fresh one)."""
    if getattr(args, "parcae_etcd", None):
        job = f"parcae-job:{args.parcae_job}"
    elif args.save:
        job = f"save:{Path(args.save).resolve()}"
    elif os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        job = f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}"
    else:
        job = f"process:{_THIS_PROCESS}"
    key = "\0".join((args.wandb_project, args.wandb_exp_name, job))
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class WandbBackend:
    """The job's run, opened (created or resumed) here until `close`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._run = wandb.init(project=args.wandb_project, name=args.wandb_exp_name, dir=args.wandb_save_dir,
                               id=job_run_id(args), resume="allow",
                               config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})
        self._run.define_metric(STEP_METRIC, hidden=True)
        self._run.define_metric("*", step_metric=STEP_METRIC)

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._run.log({**scalars, STEP_METRIC: step})

    def close(self) -> None:
        """Finish the run here (its data uploaded, online), so that another process may resume it."""
        self._run.finish()
