"""The liveput optimizer: which layout to run now, looking a few intervals ahead.

One entry point serves every caller (live coordinator, spot emulator, simulator):
`LiveputOptimizer.decide(current, available, forecast, leaving, busy_seconds, placement)`
runs at an interval boundary, once the boundary's preemptions and arrivals are known,
and returns the layout to run in the coming interval with the plan that gets there.

Availability comes in instances of G GPUs (one worker each): forecasts and preemptions
count instances, a layout runs its ranks in blocks of G to an instance (so its T divides
G), and n instances hold layouts of up to n x G workers.

It solves a dynamic program over the next `horizon` intervals (this one included):
states are layouts, a transition is a layout change at an interval start, and the value
of running layout s in step h after s' is
    throughput(s) x max(0, interval - carried - expected seconds of changing s' -> s at step h),
the expectation over the step's preemption scenarios (see scenarios.py). As in the
simulator (and `busy_seconds` for the live caller), a change longer than what is left of
its interval stalls the next interval(s): `carried` is that overrun, part of the state,
and the overrun left after the last step stalls the last layout (overruns are
counted on a grid of hundredths of an interval: a long one would otherwise make every
path a state of its own). Step 0 knows
what happened (the actual lost and leaving workers, priced by the planner); later steps
know the forecast. Only the first step is applied; the program is solved again at the
next boundary. Each step weighs the `candidates` highest-throughput layouts that fit its
instances, and the step before's layouts that still fit (how many: factory.CANDIDATES,
measured against a search of every layout). Transitions are priced lazily: a plan-free
lower bound on a change's cost (scenarios.change_floor) skips those that cannot beat the
best one found so far, so the result is the exact optimum of the program over those
layouts with far fewer plans.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from megatron_parcae.liveput.cost import NO_COST, MigrationCost, MigrationCostModel
from megatron_parcae.liveput.scenarios import ScenarioCosts, StepOutlook, SuddenLosses, preemption_distribution
from megatron_parcae.liveput.throughput import ThroughputModel
from reconfig.layout import Layout, Parallelism
from reconfig.placement import ONE_GPU, Placement
from reconfig.plan import Copies, LostStateError, MigrationPlan, MigrationRequest, plan_migration

if TYPE_CHECKING:
    from predictor.forecast import AvailabilityForecast

OVERRUN_GRID = 0.01  # overruns are counted in hundredths of an interval: few distinct states


def overrun(late: float, interval: float) -> float:
    """Seconds of a step's changes that run into the next step, when they end `late`
    seconds after the step began; rounded up to the grid, so a plan is never overvalued."""
    if late <= interval:
        return 0.0
    grid = OVERRUN_GRID * interval
    return math.ceil((late - interval) / grid - 1e-9) * grid


@dataclass(frozen=True)
class Decision:
    """What to run in the coming interval and how to get there.

    `layout` is None when no feasible layout fits the available workers. `plan` is the
    in-place migration to carry out; None when nothing moves, or on `cost.restart`: the
    job starts, or state was lost, and `layout` resumes from the last checkpoint.
    """

    layout: Layout | None
    plan: MigrationPlan | None
    cost: MigrationCost
    path: tuple[Parallelism, ...]  # layouts planned for this and the coming intervals
    # The program's value: samples over the horizon less what a change still running at
    # its end stalls after it (negative when that outweighs them).
    expected_samples: float
    horizon_samples: float = 0.0  # samples the path trains within the horizon, never negative


def outlook(forecast: AvailabilityForecast | None, instances_now: int, steps: int) -> list[StepOutlook]:
    """The forecast's next `steps` intervals as instance counts and preemption distributions.

    A forecast whose 10% and 90% quantiles coincide is certain (an oracle); its
    preemption counts are taken as exact. The expected preemptions are the forecaster's,
    or a rate model's put in their place (`predictor.rates.ForecastRates`).
    """
    if forecast is None or steps == 0:
        return [StepOutlook(instances_now, ((1.0, 0),))] * steps
    out = []
    previous = instances_now
    for h in range(steps):
        i = min(h, len(forecast.expected) - 1)
        instances = max(0, int(round(float(forecast.quantiles[0.5][i]))))
        certain = float(forecast.quantiles[0.1][i]) == float(forecast.quantiles[0.9][i])
        preempted = float(forecast.preemptions[i]) if h < len(forecast.expected) else 0.0
        out.append(StepOutlook(instances, preemption_distribution(preempted, previous - instances, certain)))
        previous = instances
    return out


class LiveputOptimizer:
    """Chooses layouts by liveput over a horizon; see the module docstring.

    Keeps what it learns between decisions (plans, expected costs), so it should live as
    long as its caller; it holds no other state, so a restarted caller loses only time.
    `sudden`: how the coming intervals' preemptions are priced when some give no notice.
    """

    def __init__(self, throughput: ThroughputModel, costs: MigrationCostModel, horizon: int, candidates: int = 4,
                 distributed_optimizer: bool = False, gpus_per_instance: int = 1,
                 sudden: SuddenLosses = SuddenLosses()):
        if horizon < 1:
            raise ValueError(f"horizon must be at least 1 interval, got {horizon}")
        if candidates < 1:
            raise ValueError(f"candidates must be at least 1, got {candidates}")
        crossing = sorted({p.tp for p in throughput.layouts() if gpus_per_instance % p.tp})
        if crossing:
            raise ValueError(f"tensor-parallel size(s) {crossing} of the throughput model do not divide the "
                             f"{gpus_per_instance} GPUs of an instance (build it with build_liveput)")
        self.throughput = throughput
        self.costs = costs
        self.gpus_per_instance = gpus_per_instance
        self.scenarios = ScenarioCosts(throughput, costs, gpus_per_instance, sudden, distributed_optimizer)
        self.horizon = horizon
        self.candidates = candidates
        self.distributed_optimizer = distributed_optimizer  # the job's: it decides which moments a plan moves
        self.interval = costs.constants.interval_seconds
        # layouts by index: the program's keys are small integers, cheap to hash
        self._layouts = throughput.layouts()
        self._index = {p: i for i, p in enumerate(self._layouts)}
        self._rate = [throughput.samples_per_second(p) for p in self._layouts]
        self._top: dict[int, tuple[int, ...]] = {}
        self._floors: dict[tuple[int, int], float] = {}
        self._preempted: dict[tuple[int, int, int, int], float] = {}

    def top_layouts(self, instances: int) -> tuple[Parallelism, ...]:
        """The `candidates` highest-throughput layouts that fit `instances` whole instances."""
        return tuple(self._layouts[i] for i in self._top_indices(instances * self.gpus_per_instance))

    def _top_indices(self, workers: int) -> tuple[int, ...]:
        found = self._top.get(workers)
        if found is None:
            fits = [self._index[p] for p in self.throughput.fitting(workers)]
            fits.sort(key=lambda i: (-self._rate[i], self._layouts[i].world_size))
            found = self._top[workers] = tuple(fits[:self.candidates])
        return found

    def _floor(self, old: int, new: int) -> float:
        """scenarios.change_floor by index (old -1: from any layout)."""
        found = self._floors.get((old, new))
        if found is None:
            found = self._floors[old, new] = self.scenarios.change_floor(
                None if old < 0 else self._layouts[old], self._layouts[new])
        return found

    def _expected(self, old: int, new: int, before: int, step: StepOutlook) -> float:
        """scenarios.expected_seconds by index, remembered per preemption count."""
        seconds = 0.0
        for pk, preempted in step.preemptions:
            key = (old, new, before, preempted)
            found = self._preempted.get(key)
            if found is None:
                if len(self._preempted) > 1_000_000:
                    self._preempted.clear()
                found = self._preempted[key] = self.scenarios.preempted_seconds(
                    self._layouts[old], self._layouts[new], before, preempted)
            seconds += pk * found
        return seconds

    def decide(self, current: Layout | None, available: Collection[int],
               forecast: AvailabilityForecast | None = None, leaving: Collection[int] = (),
               busy_seconds: float = 0.0, placement: Placement = ONE_GPU, copies: Copies | None = None) -> Decision:
        """Choose the layout for the coming interval.

        `current`: the running layout (None before the job starts). `available`: workers
        that can hold a slot now (current survivors, standby workers, arrivals).
        `leaving`: workers under a preemption notice (they can still send state; standby
        ones are ignored); current workers in neither set were lost without notice.
        `forecast`: the coming intervals after this one, in instances (None: assume
        nothing changes). `busy_seconds`: what is left of a migration still in progress.
        `placement`: the workers' instances, of the optimizer's G GPUs. `copies`: the state
        comes from the snapshots of `current` the workers keep (plan.Copies), rolled back.
        """
        if placement.gpus_per_instance != self.gpus_per_instance:
            raise ValueError(f"the placement has {placement.gpus_per_instance} GPU(s) per instance, the optimizer "
                             f"plans for {self.gpus_per_instance}")
        available = frozenset(available)
        leaving = frozenset() if current is None else frozenset(leaving) & current.workers - available
        lost = frozenset() if current is None else current.workers - available - leaving
        running = None if current is None else self._index.get(current.parallelism)
        unchanged = current is not None and not (lost or leaving)
        exact: set[int] = set()

        def start_cost(i: int) -> tuple[float, bool]:
            """(seconds, exact): the cost of starting in layout i now, or a bound below it."""
            p = self._layouts[i]
            if current is None:
                return self.costs.restart_cost(p, joining=True, cold=True).seconds, True
            if unchanged and i == running:
                return 0.0, True
            if i not in exact:
                return (self._floor(running, i) if running is not None
                        else self.scenarios.change_floor(current.parallelism, p)), False
            return self.scenarios.change_cost(current, lost, leaving, p).seconds, True

        instances, capacity = len(placement.instances(available)), placement.capacity(available)
        first = set(self._top_indices(capacity))
        if running is not None and current.parallelism.world_size <= capacity:
            first.add(running)
        steps = outlook(forecast, instances, self.horizon - 1)
        path, value, stalled = self._solve(first, start_cost, exact, busy_seconds, instances, steps)
        decision = self._realise(current, available, leaving, lost, placement, [self._layouts[i] for i in path],
                                 value, copies)
        return replace(decision, horizon_samples=max(0.0, value + stalled))

    def _solve(self, first: set[int], start_cost: Callable[[int], tuple[float, bool]], exact: set[int],
               busy: float, instances: int, steps: list[StepOutlook]) -> tuple[list[int], float, float]:
        """Best layout sequence, its value, and the samples its overrun past the horizon
        stalls (charged in the value); [] when nothing fits.

        A state is (step, layout run in it, seconds of changes overrunning into the next
        step), valued best-first and remembered: `after(k, q, carry)` is the best value of
        the steps after step k. Overruns are rare, so nearly every state has carry 0, and
        the values at carry 0 bound the others: each second carried stalls a later step,
        so costs at least the slowest rate that can run there (0 if the job may idle). Step
        0's costs need real plans, so they are priced lazily: candidates are taken best
        bound first until the best exact value beats every remaining bound.
        """
        rate, interval, world = self._rate, self.interval, self._layouts
        layouts = [first]
        for step in steps:
            workers = step.instances * self.gpus_per_instance
            carried = {p for p in layouts[-1] if world[p].world_size <= workers}
            layouts.append(carried | set(self._top_indices(workers)))
        slowest = [0.0 if any(not later for later in layouts[j:]) else min(rate[p] for later in layouts[j:]
                                                                           for p in later)
                   for j in range(len(layouts))]
        memo: dict[tuple[int, int, float], tuple[float, int | None, float]] = {}
        ranked: dict[tuple[int, float], list[tuple[float, int]]] = {}

        def run(p: int, carry: float, seconds: float) -> tuple[float, float]:
            """(samples p trains in a step that starts `carry` seconds late and changes
            for `seconds`, seconds left over for the next step)."""
            late = carry + seconds
            return rate[p] * max(0.0, interval - late), overrun(late, interval)

        def above(k: int, p: int, carry: float, seconds: float) -> float:
            """A bound above the value of changing to p at step k (k -1: starting in p) for
            at least `seconds`, from the value without overrun."""
            samples, left = run(p, carry, seconds)
            return samples + after(k + 1, p, 0.0) - left * slowest[k + 1]

        def value(k: int, p: int, carry: float, seconds: float, best: float) -> tuple[float, float]:
            """(value, overrun) of changing to p at step k for `seconds`; -inf when the
            overrun's bound cannot beat `best` (its states are then never visited)."""
            samples, left = run(p, carry, seconds)
            if left and samples + after(k + 1, p, 0.0) - left * slowest[k + 1] <= best:
                return -np.inf, left
            return samples + after(k + 1, p, left), left

        def after(k: int, q: int, carry: float) -> float:
            key = (k, q, carry)
            found = memo.get(key)
            if found is not None:
                return found[0]
            if k == len(steps):  # past the horizon, q keeps running until the change is done
                memo[key] = (-rate[q] * carry, None, 0.0)
                return -rate[q] * carry
            step, before = steps[k], (instances if k == 0 else steps[k - 1].instances)
            order = ranked.get((k, carry))
            if order is None:  # successors by a bound above their value from any layout
                order = ranked[k, carry] = sorted(((above(k, p, carry, self._floor(-1, p)), p) for p in layouts[k + 1]),
                                                  key=lambda t: (-t[0], t[1]))
            best, best_next, best_carry = -np.inf, None, 0.0
            if q in layouts[k + 1]:  # staying is usually the best: price it first
                best, best_carry = value(k, q, carry, self._expected(q, q, before, step), -np.inf)
                best_next = q
            for bound, p in order:
                if bound <= best:
                    break  # no later successor can do better, whatever its plan
                if p == q or above(k, p, carry, self._floor(q, p)) <= best:
                    continue
                v, left = value(k, p, carry, self._expected(q, p, before, step), best)
                if v > best:
                    best, best_next, best_carry = v, p, left
            if best_next is None:  # nothing fits the next step: the job idles from there
                best = 0.0
            memo[key] = (best, best_next, best_carry)
            return best

        def start_bound(p: int) -> float:
            return above(-1, p, busy, start_cost(p)[0])

        best_value, best_start, best_carry = -np.inf, None, 0.0
        for p in sorted(layouts[0], key=lambda p: (-start_bound(p), p)):
            if start_bound(p) <= best_value:
                break
            seconds, is_exact = start_cost(p)
            if not is_exact:
                exact.add(p)
                seconds, _ = start_cost(p)
            v, left = value(-1, p, busy, seconds, best_value)
            if v > best_value:
                best_value, best_start, best_carry = v, p, left
        if best_start is None:
            return [], 0.0, 0.0
        path, carry = [best_start], best_carry
        for k in range(len(steps)):
            _, following, carry = memo[k, path[-1], carry]
            if following is None:
                break
            path.append(following)
        return path, best_value, rate[path[-1]] * carry

    def rebuild(self, current: Layout) -> Decision:
        """The running layout on the same workers, its WORLD formed anew in place: for a
        WORLD that broke with no worker lost (a collective timed out on a slow peer)."""
        request = MigrationRequest(current, current.workers, frozenset(), frozenset(), self.distributed_optimizer)
        plan = plan_migration(request, current.parallelism, self.costs.shape)
        return Decision(plan.new, plan, self.costs.plan_cost(plan), (current.parallelism,), 0.0)

    def _realise(self, current: Layout | None, available: frozenset[int], leaving: frozenset[int],
                 lost: frozenset[int], placement: Placement, path: list[Parallelism], value: float,
                 copies: Copies | None = None) -> Decision:
        """Turn the first step of `path` into a layout with workers and the plan to reach it."""
        if not path:
            return Decision(None, None, NO_COST, (), 0.0)
        target = path[0]
        if current is None:
            return Decision(Layout(target, placement.assign(target, sorted(available))), None,
                            self.costs.restart_cost(target, joining=True, cold=True), tuple(path), value)
        if target == current.parallelism and not (lost or leaving) and copies is None:
            return Decision(current, None, NO_COST, tuple(path), value)
        survivors = current.workers & available
        request = MigrationRequest(current, survivors, leaving, available - current.workers, self.distributed_optimizer,
                                   placement=placement, copies=copies)
        joining = target.world_size > len(survivors)
        try:
            plan = plan_migration(request, target, self.costs.shape)
        except LostStateError:
            order = sorted(survivors) + sorted(available - survivors)
            return Decision(Layout(target, placement.assign(target, order)), None,
                            self.costs.restart_cost(target, joining), tuple(path), value)
        cost = self.costs.plan_cost(plan)
        return Decision(plan.new, None if cost.restart else plan, cost, tuple(path), value)
