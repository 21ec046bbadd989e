"""--wandb-project: scalars to Weights & Biases (WANDB_MODE=offline keeps them local).
wandb is not a dependency: the arguments refuse the flag where it is not installed."""

from __future__ import annotations

import argparse

import wandb


class WandbBackend:
    def __init__(self, args: argparse.Namespace) -> None:
        self._run = wandb.init(project=args.wandb_project, name=args.wandb_exp_name, dir=args.wandb_save_dir,
                               config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
