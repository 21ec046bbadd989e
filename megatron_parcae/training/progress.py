"""How far a run has got: the only training state besides the model's own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    iteration: int = 0
    consumed_samples: int = 0

    @classmethod
    def at(cls, consumed_samples: int, global_batch_size: int) -> Progress:
        """The progress of a job that has consumed `consumed_samples` samples."""
        return cls(consumed_samples // global_batch_size, consumed_samples)
