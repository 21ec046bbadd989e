"""--tensorboard-dir: scalars in TensorBoard event files (one file per writing process)."""

from __future__ import annotations

from torch.utils.tensorboard import SummaryWriter


class TensorBoardBackend:
    def __init__(self, directory: str) -> None:
        self._writer = SummaryWriter(log_dir=directory)

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()  # a preempted process keeps what it wrote

    def close(self) -> None:
        self._writer.close()
