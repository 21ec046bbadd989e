"""The deadline policy: how many spot and on-demand instances to hold this interval.

An elastic job trains on any number of instances, at a throughput that grows more slowly
than the count (more pipeline stages, more bubbles). Its cheapest way to a deadline
prices time: at a value of `price` dollars per sample, an interval with `s` spot instances
runs on the count n that maximises price x rate(n) - dollars(n), where dollars(n) pays
spot for the first s instances and on-demand above. A low price trains on few spot
instances (the cheapest samples: more instances buy fewer samples per dollar); a higher
one uses more spot, then tops the job up with on-demand instances where spot is short,
most where spot is shortest. The same rule run with the whole trace known, with no
start-ups to pay, is the optimum of the linear program `baselines.omniscient` solves.

Each interval the policy finds the lowest price whose expected rate, over the spot
outlook (how often each spot count is expected), finishes the remaining work a reserve
(a share of the slack) ahead of the deadline, and holds that price's choice for the spot count there is now.
Between that price and a slightly higher one (the hysteresis) it keeps what it holds,
so a small lead or lag does not turn instances over (each change pauses training, and a
new on-demand instance is paid while it starts); ahead of plan it releases on-demand
instances first, then spot ones it does not need.

A safety net takes over near the deadline: once the time left is no more than the
remaining work on on-demand instances alone (as many as the job may use) plus a
start-up, a restart, a change and an interval (what losing all spot instances at once
costs, seen an interval late), the policy holds that many on-demand instances to the
end, spot ones standing in only while they start, as Can't Be Late's policies commit to
on-demand when slack runs out: spot capacity that comes and goes can no longer be
relied on then. With a budget, the price is the
highest the budget is expected to afford until the finish, deadline or not.

`decide` is a pure function of a `ProvisioningState`, so the simulator, `parcae plan`
and a live coordinator (one call per interval) decide alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ProvisioningState:
    """What the job knows at an interval's start. Times in hours, rates in samples/s."""

    time_left_hours: float  # until the deadline
    remaining_samples: float
    spot_available: int  # spot instances the cloud lets the job hold now
    spot_held: int  # of which the job holds
    on_demand_held: int  # on-demand instances held (started or starting)
    on_demand_ready: int  # of which have started
    rates: tuple[float, ...]  # samples/s of the job on n instances, n = 0..max instances
    spot_outlook: tuple[float, ...]  # how often each spot count 0..max is expected (weights)
    spot_price: float  # $ per spot instance-hour now
    on_demand_price: float  # $ per on-demand instance-hour now
    startup_hours: float = 0.0  # an on-demand instance's start-up
    change_hours: float = 0.0  # training lost per change of the job's instances
    restart_hours: float = 0.0  # training lost by a start from nothing
    interval_hours: float = 0.0  # between decisions: how late a loss may be seen
    max_on_demand: int | None = None  # the on-demand pool's limit
    spent_dollars: float = 0.0
    budget: float | None = None

    @property
    def max_instances(self) -> int:
        return len(self.rates) - 1


@dataclass(frozen=True)
class Decision:
    """Instances to hold from now: spot (of those available) and on-demand."""

    spot: int
    on_demand: int


@dataclass(frozen=True)
class DeadlinePolicy:
    """See the module docstring. `reserve`: the share of the slack (time left beyond the
    remaining work at full size) the plan keeps in hand; `hysteresis`: how far above the
    needed rate the upper price aims."""

    reserve: float = 0.2
    hysteresis: float = 0.05

    def decide(self, state: ProvisioningState) -> Decision:
        n_max = state.max_instances
        spot = min(state.spot_available, n_max)
        cap = n_max if state.max_on_demand is None else state.max_on_demand
        room = min(n_max - spot, cap)
        if state.remaining_samples <= 0:
            return Decision(0, 0)
        table = _Table.of(state)
        margin = state.startup_hours + state.restart_hours + state.change_hours + state.interval_hours
        full = table.rates[min(n_max, cap)]  # what on-demand instances alone guarantee
        full_hours = state.remaining_samples / full / 3600 if full > 0 else math.inf
        if state.time_left_hours <= full_hours + margin and self._affords(state, table, math.inf, spot):
            # on-demand instances alone finish in time; spot ones stand in until they have started
            return Decision(min(spot, max(0, n_max - state.on_demand_ready)), min(n_max, cap))
        plan_hours = state.time_left_hours - margin - self.reserve * (state.time_left_hours - margin - full_hours)
        need = state.remaining_samples / (max(plan_hours, 1e-9) * 3600)
        low = table.lowest_price(need)
        high = table.lowest_price(need * (1 + self.hysteresis))
        if state.budget is not None:
            low, high = (min(p, self._budget_price(state, table)) for p in (low, high))
        lo, hi = table.count(low, spot), table.count(high, spot)
        held = min(state.spot_held, spot) + state.on_demand_held
        n = min(max(held, lo), hi)
        return Decision(min(n, spot), min(max(0, n - spot), room))

    @staticmethod
    def _affords(state: ProvisioningState, table: _Table, price: float, spot: int) -> bool:
        """Whether holding `price`'s choice until the deadline fits the budget."""
        if state.budget is None:
            return True
        return state.spent_dollars + max(state.time_left_hours, 0.0) * table.hourly(price, spot) <= state.budget

    def _budget_price(self, state: ProvisioningState, table: _Table) -> float:
        """The highest price whose expected dollars until the finish fit what is left."""
        left = state.budget - state.spent_dollars

        def cost(price: float) -> float:
            rate = table.expected_rate(price)
            hours = state.remaining_samples / rate / 3600 if rate > 0 else math.inf
            return table.expected_hourly(price) * min(hours, max(state.time_left_hours, 0.0))

        return table.highest_price(lambda p: cost(p) <= left)


class _Table:
    """The count each spot count gets at a price, and the expected rate and dollars."""

    def __init__(self, rates: tuple[float, ...], outlook: tuple[float, ...], spot_price: float,
                 on_demand_price: float, cap: int):
        self.rates = np.asarray(rates, dtype=float)
        n_max = len(rates) - 1
        weights = np.zeros(n_max + 1)
        seen = np.asarray(outlook, dtype=float)[:n_max + 1]
        weights[:len(seen)] = seen
        self.weights = weights / weights.sum()
        counts = np.arange(n_max + 1)
        spot, n = counts[:, None], counts[None, :]  # [spot count, instances]
        self.dollars = spot_price * np.minimum(n, spot) + on_demand_price * np.maximum(0, n - spot)
        self.allowed = n - spot <= cap
        positive = [p for p in (spot_price, on_demand_price) if p > 0]
        usable = self.rates[1:][self.rates[1:] > 0]
        # Prices (dollars per sample) below the cheapest sample buy nothing; above the dearest, everything.
        self.floor = (min(positive) if positive else 1.0) / 3600 / max(usable.max(), 1e-12) / 10
        self.ceiling = (max(positive) if positive else 1.0) / 3600 / max(np.diff(self.rates).clip(1e-9).min(), 1e-9) * 10

    @classmethod
    def of(cls, state: ProvisioningState) -> _Table:
        outlook = tuple(state.spot_outlook) if sum(state.spot_outlook) > 0 else \
            tuple(1.0 if k == min(state.spot_available, state.max_instances) else 0.0
                  for k in range(state.max_instances + 1))
        cap = state.max_instances if state.max_on_demand is None else state.max_on_demand
        return cls(tuple(state.rates), outlook, state.spot_price, state.on_demand_price, cap)

    def counts(self, price: float) -> np.ndarray:
        """Instances for each spot count at `price` (ties: fewer)."""
        if math.isinf(price):
            return np.array([int(np.nonzero(row)[0].max()) for row in self.allowed])
        value = np.where(self.allowed, price * 3600 * self.rates[None, :] - self.dollars, -np.inf)
        return value.argmax(axis=1)

    def count(self, price: float, spot: int) -> int:
        return int(self.counts(price)[spot])

    def expected_rate(self, price: float) -> float:
        return float((self.rates[self.counts(price)] * self.weights).sum())

    def expected_hourly(self, price: float) -> float:
        chosen = self.counts(price)
        return float((self.dollars[np.arange(len(chosen)), chosen] * self.weights).sum())

    def hourly(self, price: float, spot: int) -> float:
        return float(self.dollars[spot, self.count(price, spot)])

    def lowest_price(self, need: float) -> float:
        """The lowest price whose expected rate reaches `need` (infinite if none does)."""
        if self.expected_rate(self.ceiling) < need:
            return math.inf
        low, high = self.floor, self.ceiling
        for _ in range(40):
            middle = math.sqrt(low * high)
            if self.expected_rate(middle) >= need:
                high = middle
            else:
                low = middle
        return high

    def highest_price(self, fits) -> float:
        """The highest price for which `fits(price)` holds (0 when none does)."""
        if fits(self.ceiling):
            return math.inf
        if not fits(self.floor):
            return 0.0
        low, high = self.floor, self.ceiling
        for _ in range(40):
            middle = math.sqrt(low * high)
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

