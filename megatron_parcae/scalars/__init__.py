"""Back-ends for dashboard scalars (TensorBoard, Weights & Biases), one module each, each
imported only when used (they take seconds to load). The training processes' writer
(training/metrics/) and the coordinator hand them scalars by tag."""

from __future__ import annotations

from typing import Protocol


class ScalarBackend(Protocol):
    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Record `scalars` (tag: value) at step `step`, durably before returning."""

    def close(self) -> None:
        ...
