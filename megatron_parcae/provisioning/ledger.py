"""Dollars a live job has spent, by pool, and where it is heading.

The coordinator counts as instances run: each time it looks, the instances it saw
held since it last looked are paid up to now, each at its pool's price over that time
(price traces are integrated piece by piece, hour 0 being when counting started). The
projected finish extends the job's recent progress rate to its target; the projected
cost adds what the instances held now will cost until then, at the prices to come.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from megatron_parcae.provisioning.pools import Pool, PriceTrace

RATE_POINTS = 16  # progress points the rate is measured over (the newest)


def pool_dollars(pool: Pool, count: int, from_hour: float, to_hour: float) -> float:
    """What `count` instances of `pool` cost from `from_hour` to `to_hour`."""
    if count <= 0 or to_hour <= from_hour:
        return 0.0
    price = pool.price
    if not isinstance(price, PriceTrace):
        return count * float(price) * (to_hour - from_hour)
    total, hour = 0.0, from_hour
    k = max(0, bisect.bisect_right(price.hours, from_hour) - 1)
    while hour < to_hour:
        end = price.hours[k + 1] if k + 1 < len(price.hours) else to_hour
        end = min(end, to_hour)
        total += price.prices[k] * (end - hour)
        hour, k = end, k + 1
    return count * total


@dataclass
class CostLedger:
    """Dollars by pool since `started_at` (Unix seconds), paid up to `counted_at` for the
    `instances` (by pool) held since then."""

    pools: dict[str, Pool]
    started_at: float
    counted_at: float = 0.0
    dollars: dict[str, float] = field(default_factory=dict)
    instances: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counted_at = max(self.counted_at, self.started_at)
        self.dollars = {name: float(self.dollars.get(name, 0.0)) for name in self.pools}
        self.instances = {name: int(self.instances.get(name, 0)) for name in self.pools}

    def hour(self, at: float) -> float:
        return (at - self.started_at) / 3600

    def advance(self, now: float, instances: dict[str, int]) -> None:
        """Pay the instances held since the last count up to `now`; hold `instances` from now."""
        if now > self.counted_at:
            for name, pool in self.pools.items():
                self.dollars[name] += pool_dollars(pool, self.instances[name], self.hour(self.counted_at),
                                                   self.hour(now))
            self.counted_at = now
        self.instances = {name: int(instances.get(name, 0)) for name in self.pools}

    @property
    def total(self) -> float:
        return sum(self.dollars.values())

    def hourly(self) -> float:
        """Dollars per hour the instances held cost now."""
        hour = self.hour(self.counted_at)
        return sum(pool.price_at(hour) * self.instances[name] for name, pool in self.pools.items())

    def projected(self, until: float) -> float:
        """Dollars by `until` if the instances held now run until then."""
        start, end = self.hour(self.counted_at), self.hour(until)
        return self.total + sum(pool_dollars(pool, self.instances[name], start, end)
                                for name, pool in self.pools.items())


@dataclass
class ProgressRate:
    """The job's recent progress (samples or iterations) per second, from (time, done)
    points; a point at a time already seen replaces nothing."""

    points: deque = field(default_factory=lambda: deque(maxlen=RATE_POINTS))

    def observe(self, at: float, done: float) -> None:
        if not self.points or at > self.points[-1][0]:
            self.points.append((at, done))

    def per_second(self) -> float | None:
        if len(self.points) < 2:
            return None
        (t0, d0), (t1, d1) = self.points[0], self.points[-1]
        rate = (d1 - d0) / (t1 - t0)
        return rate if rate > 0 else None

    def finish_at(self, target: float) -> float | None:
        """When the job reaches `target` at its recent rate; None while it has no rate."""
        if not self.points:
            return None
        at, done = self.points[-1]
        if done >= target:
            return at
        rate = self.per_second()
        return None if rate is None else at + (target - done) / rate
