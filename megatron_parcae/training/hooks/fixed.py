"""The hook of a run without --parcae: one layout from start to end, as torchrun gave it."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_parcae.training import checkpointing
from megatron_parcae.training.device import initialize_distributed
from megatron_parcae.training.hooks.base import TorchrunHook
from reconfig.execute import Runtime


class FixedLayout(TorchrunHook):
    def __init__(self, args: argparse.Namespace, vocab_size: int,
                 runtime_factory: Callable[[argparse.Namespace, int], Runtime]) -> None:
        initialize_distributed()
        self.args = args
        self.build = lambda: runtime_factory(args, vocab_size)

    def start(self) -> tuple[Runtime | None, int]:
        runtime = self.build()
        return runtime, checkpointing.resume(self.args.load, runtime, self.args.finetune)

    def advance(self, runtime: Runtime, consumed_samples: int) -> tuple[Runtime | None, int]:
        return runtime, consumed_samples
