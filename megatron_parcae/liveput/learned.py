"""Throughput learned from the job itself: the step times its workers measure.

A profile, measured or analytic, is a prior: another device, another network, other
processes on the same host all move the real figures. The coordinator feeds every step
report of the running layout to a `ThroughputLearner`; a layout that has run is then
priced by the median of its own reports, and one that has not by the prior times the
correction the layouts that ran agree on (the geometric mean of their measured/prior
ratios), so a prior that is uniformly off is fixed by the first layout that runs.

An unseen layout's price is a guess, as wrong as the layouts that ran disagree: it is
discounted by that disagreement (the spread of their log ratios; UNSEEN_SPREAD while
fewer than two ran), so the job moves to an untried layout only for a gain larger than
the prior's known error, rather than trying every layout the prior flatters.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from megatron_parcae.liveput.throughput import ThroughputModel
from reconfig.layout import Parallelism

REPORTS_KEPT = 64  # per layout: the newest reports, so a layout's price follows its host
CHANGE_TO_REPLAN = 0.05  # relative change of a price that makes the optimizer re-plan
UNSEEN_SPREAD = 0.25  # log-ratio error assumed of the prior while fewer than two layouts ran


class LearnedModel(ThroughputModel):
    """The prior's layouts, priced by measured step seconds where there are some and by the
    prior times `correction` elsewhere; immutable, as the optimizer caches its answers."""

    def __init__(self, prior: ThroughputModel, measured: dict[Parallelism, float], correction: float,
                 spread: float = 0.0):
        self.prior = prior
        self.model, self.global_batch_size, self.model_shape = prior.model, prior.global_batch_size, prior.model_shape
        self.link_bytes_per_second = prior.link_bytes_per_second
        self._measured = dict(measured)
        self.correction = correction
        self.spread = spread  # discount of an unseen layout, as a log ratio

    @property
    def measured(self) -> frozenset[Parallelism]:
        """The layouts priced by their own step times."""
        return frozenset(self._measured)

    def layouts(self) -> tuple[Parallelism, ...]:
        return self.prior.layouts()

    def samples_per_second(self, layout: Parallelism) -> float:
        rate = self.prior.samples_per_second(layout)
        if rate <= 0:
            return 0.0
        if layout in self._measured:
            return self.global_batch_size / self._measured[layout]
        return rate / self.correction * math.exp(-self.spread)

    def iteration_seconds(self, layout: Parallelism) -> float:
        rate = self.samples_per_second(layout)
        return math.inf if rate <= 0 else self.global_batch_size / rate


@dataclass(frozen=True)
class LayoutEstimate:
    """What the learner knows of one layout that ran."""

    layout: Parallelism
    prior_seconds: float  # iteration seconds the prior predicts
    measured_seconds: float  # median of the kept reports
    reports: int  # reports kept


class ThroughputLearner:
    """Collects step reports per layout and says when the optimizer should re-plan."""

    def __init__(self, prior: ThroughputModel):
        self.prior = prior
        self._reports: dict[Parallelism, deque[float]] = {}
        self._planned_with: LearnedModel = LearnedModel(prior, {}, 1.0)

    def observe(self, layout: Parallelism, seconds: float) -> None:
        """One worker's mean step time in `layout`; layouts the prior cannot run are ignored."""
        if self.prior.samples_per_second(layout) > 0 and math.isfinite(seconds) and seconds > 0:
            self._reports.setdefault(layout, deque(maxlen=REPORTS_KEPT)).append(seconds)

    def estimates(self) -> list[LayoutEstimate]:
        return [LayoutEstimate(layout, self.prior.global_batch_size / self.prior.samples_per_second(layout),
                               statistics.median(reports), len(reports))
                for layout, reports in self._reports.items()]

    def model(self) -> LearnedModel:
        """The prior corrected by everything observed so far."""
        estimates = self.estimates()
        if not estimates:
            return LearnedModel(self.prior, {}, 1.0)
        ratios = [math.log(e.measured_seconds / e.prior_seconds) for e in estimates]
        spread = statistics.stdev(ratios) if len(ratios) > 1 else UNSEEN_SPREAD
        return LearnedModel(self.prior, {e.layout: e.measured_seconds for e in estimates},
                            math.exp(statistics.fmean(ratios)), spread)

    def reprice(self, prior: ThroughputModel) -> LearnedModel:
        """Take `prior` (the same layouts, priced anew: the network was measured) and
        return what is learned of it: the reports kept correct it instead. The optimizer
        plans with the model returned."""
        self.prior = prior
        self._planned_with = self.model()
        return self._planned_with

    def replan(self) -> LearnedModel | None:
        """A new model when some price moved by more than CHANGE_TO_REPLAN since the model
        last returned here (which the optimizer plans with); None while none has."""
        new = self.model()
        old = self._planned_with
        moved = any(abs(new.iteration_seconds(p) / old.iteration_seconds(p) - 1) > CHANGE_TO_REPLAN
                    for p in new.measured | old.measured)
        unseen = new.correction * math.exp(new.spread) / (old.correction * math.exp(old.spread))
        if not moved and abs(unseen - 1) <= CHANGE_TO_REPLAN:
            return None
        self._planned_with = new
        return new
