"""A job with a deadline, the spot capacity it meets, and what a policy made of it.

Every policy (the deadline policy, the baselines, the bound) is replayed on the same
`SpotWindow` and reported as an `Outcome`, so their dollars compare like with like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DeadlineJob:
    """Train `samples` within `deadline_hours` on at most `max_instances` instances.

    `restart_hours` is lost at every start from nothing (and, for a gang, every switch
    between markets); `budget` (dollars) is what the deadline policy may spend."""

    samples: float
    deadline_hours: float
    max_instances: int
    restart_hours: float
    budget: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.samples) and self.samples > 0):
            raise ValueError(f"the job's samples must be a positive number, got {self.samples}")
        if not (math.isfinite(self.deadline_hours) and self.deadline_hours > 0):
            raise ValueError(f"the deadline must be a positive number of hours, got {self.deadline_hours}")
        if self.max_instances < 1:
            raise ValueError(f"max instances must be at least 1, got {self.max_instances}")
        if not (math.isfinite(self.restart_hours) and self.restart_hours >= 0):
            raise ValueError(f"restart hours must be >= 0, got {self.restart_hours}")
        if self.budget is not None and not (math.isfinite(self.budget) and self.budget >= 0):
            raise ValueError(f"the budget must be a non-negative number of dollars, got {self.budget}")


@dataclass(frozen=True)
class SpotWindow:
    """Spot instances the cloud lets the job hold in each interval from its start.

    `counts[i]` holds over interval i (i x `interval_seconds` after the start); the window
    runs past the deadline so that a late job's finish can be seen. `history` is the
    counts before the start: what a forecaster has seen. `start_hours` places the window
    on the price traces' clock."""

    interval_seconds: float
    counts: np.ndarray
    history: np.ndarray
    start_hours: float = 0.0

    @classmethod
    def of(cls, counts: np.ndarray, interval_seconds: float, start_hours: float, hours: float) -> SpotWindow:
        """`hours` of a trace's per-interval `counts` from `start_hours`, replayed from the
        trace's start again where it ends (the history is the counts before the start)."""
        start = int(round(start_hours * 3600 / interval_seconds))
        if not 0 <= start < len(counts):
            raise ValueError(f"start hour {start_hours} is outside the {len(counts) * interval_seconds / 3600:.2f} h "
                             f"trace")
        length = max(1, math.ceil(hours * 3600 / interval_seconds - 1e-9))
        index = (start + np.arange(length)) % len(counts)
        return cls(interval_seconds, np.asarray(counts)[index].astype(np.int64),
                   np.asarray(counts)[:start].astype(np.int64), start * interval_seconds / 3600)

    @property
    def hours(self) -> float:
        return len(self.counts) * self.interval_seconds / 3600


@dataclass(frozen=True)
class Outcome:
    """What one policy did: dollars until it finished (or until the window ended)."""

    dollars: float
    finish_hours: float | None  # None: not finished within the window
    met_deadline: bool
    on_demand_instance_hours: float
    spot_instance_hours: float

    def to_dict(self) -> dict:
        return {"dollars": round(self.dollars, 2),
                "finish_hours": None if self.finish_hours is None else round(self.finish_hours, 3),
                "met_deadline": self.met_deadline,
                "on_demand_instance_hours": round(self.on_demand_instance_hours, 2),
                "spot_instance_hours": round(self.spot_instance_hours, 2)}
