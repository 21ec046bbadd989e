"""The elastic job in simulation: it trains on the spot and on-demand instances a policy
holds, interval by interval.

Throughput on n instances is the throughput model's best layout on their GPUs (what
`parcae simulate`'s `ideal` policy runs). Every change of the instance count pauses
training for `change_seconds[n]`, the checkpoint restart of the new layout as the
migration cost model prices it (an in-place change, what the executor does, costs no
more), and a start from no instances loses the job's restart hours. Spot instances are
paid while held, on-demand ones from their request, start-up included, until released.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_parcae.provisioning.job import DeadlineJob, Outcome, SpotWindow
from megatron_parcae.provisioning.pools import Market
from megatron_parcae.provisioning.policy import Decision, ProvisioningState

Decide = Callable[[ProvisioningState], Decision]


@dataclass(frozen=True)
class ElasticModel:
    """The job's samples/s and change pause on n instances, n = 0..max instances."""

    rates: tuple[float, ...]
    change_seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rates) < 2 or len(self.rates) != len(self.change_seconds) or self.rates[0] != 0:
            raise ValueError("an elastic model needs rates and change pauses for 0..max instances, 0 at 0")

    @property
    def max_instances(self) -> int:
        return len(self.rates) - 1

    @classmethod
    def from_throughput(cls, throughput, costs, max_instances: int, gpus_per_instance: int) -> ElasticModel:
        """From a liveput throughput model and migration cost model (liveput.factory's stack)."""
        rates, pauses = [0.0], [0.0]
        for n in range(1, max_instances + 1):
            best = throughput.best(n * gpus_per_instance)
            rates.append(0.0 if best is None else float(throughput.samples_per_second(best)))
            pauses.append(0.0 if best is None else float(costs.restart_cost(best, joining=True).seconds))
        return cls(tuple(rates), tuple(pauses))


@dataclass
class SpotOutlook:
    """How often each spot count 0..max has been seen, recent intervals weighing more
    (by half every `half_life_hours`): the spot forecast the deadline policy plans with.
    Spot capacity comes in regimes of hours to days, so the recent past says more about
    the coming hours than the trace's whole history."""

    max_instances: int
    interval_seconds: float
    half_life_hours: float = 6.0

    def __post_init__(self) -> None:
        self.weights = np.zeros(self.max_instances + 1)
        self.decay = 0.5 ** (self.interval_seconds / 3600 / self.half_life_hours)

    def observe_all(self, counts: np.ndarray) -> None:
        ages = np.arange(len(counts))[::-1]
        self.weights *= self.decay ** len(counts)
        np.add.at(self.weights, np.minimum(counts, self.max_instances), self.decay ** ages)

    def observe(self, count: int) -> None:
        self.weights *= self.decay
        self.weights[min(count, self.max_instances)] += 1.0


def run_elastic(job: DeadlineJob, window: SpotWindow, market: Market, model: ElasticModel,
                decide: Decide | None = None, outlook_half_life_hours: float = 6.0) -> Outcome:
    """Replay the elastic job; `decide` says which instances to hold each interval (None:
    every spot instance there is and no on-demand one, today's parcae)."""
    n_max = min(job.max_instances, model.max_instances)
    step_hours = window.interval_seconds / 3600
    seen = SpotOutlook(n_max, window.interval_seconds, outlook_half_life_hours)
    seen.observe_all(window.history)
    startup = market.on_demand.startup_hours
    mean_change = float(np.mean(model.change_seconds[1:n_max + 1])) / 3600
    done = dollars = spot_hours = od_hours = 0.0
    ready_at: list[float] = []  # when each held on-demand instance can train (hours from the start)
    held = 0  # spot instances held
    used = 0
    pause = 0.0  # seconds of training still lost to the last change
    for i, count in enumerate(window.counts):
        now = i * step_hours
        clock = window.start_hours + now
        spot = min(int(count), n_max, market.spot.max_count)
        seen.observe(spot)
        room = min(n_max, market.on_demand.max_count)  # the job trains on n_max at most, whoever pays
        if decide is None:
            held, want = spot, 0
        else:
            decision = decide(ProvisioningState(
                time_left_hours=job.deadline_hours - now, remaining_samples=job.samples - done,
                spot_available=spot, spot_held=min(held, spot), on_demand_held=len(ready_at),
                on_demand_ready=sum(1 for t in ready_at if t <= now + 1e-9),
                rates=model.rates[:n_max + 1], spot_outlook=tuple(seen.weights), spot_price=market.spot.price_at(clock),
                on_demand_price=market.on_demand.price_at(clock), startup_hours=startup, change_hours=mean_change,
                restart_hours=job.restart_hours, interval_hours=step_hours, max_on_demand=market.on_demand.max_count, spent_dollars=dollars,
                budget=job.budget))
            held = max(0, min(decision.spot, spot))
            want = max(0, min(decision.on_demand, room))
        if want > len(ready_at):
            ready_at += [now + startup] * (want - len(ready_at))
        else:
            ready_at = sorted(ready_at)[:want]  # release those that started last first
        ready = sum(1 for t in ready_at if t <= now + 1e-9)
        n = min(n_max, held + ready)
        if n == 0:
            pause = 0.0
        elif used == 0:
            pause = job.restart_hours * 3600
        elif n != used:
            pause += model.change_seconds[n]
        used = n
        hourly = held * market.spot.price_at(clock) + len(ready_at) * market.on_demand.price_at(clock)
        lost = min(pause, window.interval_seconds)
        pause -= lost
        gain = model.rates[n] * (window.interval_seconds - lost)
        if gain > 0 and done + gain >= job.samples:
            share = (lost + (job.samples - done) / model.rates[n]) / window.interval_seconds
            finish = now + share * step_hours
            return Outcome(dollars + share * step_hours * hourly, finish, finish <= job.deadline_hours + 1e-9,
                           od_hours + share * step_hours * len(ready_at), spot_hours + share * step_hours * held)
        done += gain
        dollars += step_hours * hourly
        spot_hours += step_hours * held
        od_hours += step_hours * len(ready_at)
    return Outcome(dollars, None, False, od_hours, spot_hours)
