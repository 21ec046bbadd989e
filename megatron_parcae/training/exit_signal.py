"""--exit-signal-handler: SIGTERM ends a run without --parcae at the next iteration
boundary, after a checkpoint, with exit code 0 (Megatron-LM's meaning of the flag).

The signal may reach only some ranks (or reach them during different steps): at every
boundary the ranks agree, with one all-reduce, whether any has received it, so that all
stop after the same step and save it together.
"""

from __future__ import annotations

import signal

import torch.distributed as dist

from reconfig import planes


class ExitSignal:
    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received = True

    def received_anywhere(self) -> bool:
        """Whether any rank has received SIGTERM (a collective over WORLD)."""
        flag = planes.control_tensor([int(self.received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
