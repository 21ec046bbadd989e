"""The policies the deadline policy is measured against, from their published rules.

- `on-demand`: N on-demand instances from the start to the finish (one start).
- `spot`: today's parcae: the elastic job on whatever spot instances there are.
- `greedy` and `uniform-progress`: Can't Be Late's (NSDI '24) policies for a job that
  runs on a fixed gang of N instances, all-or-nothing: on spot only while all N spot
  instances are there, otherwise on N on-demand instances or idle, losing the restart
  hours at every start and every switch of market. Greedy runs on spot whenever it can,
  idles otherwise, and moves to on-demand for good once the slack left (time left minus
  work left) is down to one restart (plus an interval: decisions are per interval).
  Uniform Progress runs on spot whenever it can; without spot it runs on on-demand while
  its progress is behind the straight line from nothing at the start to all the work at
  the deadline, and idles when ahead; it leaves on-demand (for spot or for idling) only
  once a restart's work ahead of the line, and has greedy's safety net. Neither starts a
  gang on spot whose restart would leave less than that safety net's slack.
- `omniscient`: a lower bound on what the elastic job can cost, knowing the whole trace
  (`omniscient`'s docstring says why it is one).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_matrix

from megatron_parcae.provisioning.elastic import ElasticModel, run_elastic
from megatron_parcae.provisioning.job import DeadlineJob, Outcome, SpotWindow
from megatron_parcae.provisioning.pools import Market

IDLE, SPOT, ON_DEMAND = "idle", "spot", "on-demand"
GANG_RULES = ("on-demand", "greedy", "uniform-progress")


def spot_only(job: DeadlineJob, window: SpotWindow, market: Market, model: ElasticModel) -> Outcome:
    return run_elastic(job, window, market, model, None)


def gang(rule: str, job: DeadlineJob, window: SpotWindow, market: Market, model: ElasticModel) -> Outcome:
    """Replay a gang of N instances under `rule` (one of GANG_RULES, module docstring)."""
    if rule not in GANG_RULES:
        raise ValueError(f"unknown gang rule {rule!r}; known: {', '.join(GANG_RULES)}")
    n = min(job.max_instances, model.max_instances)
    rate = model.rates[n]
    step_hours = window.interval_seconds / 3600
    restart = job.restart_hours
    net = restart + step_hours  # the slack a gang keeps to switch to on-demand in time
    mode, committed = IDLE, rule == "on-demand"
    done = dollars = spot_hours = od_hours = 0.0
    pause = 0.0  # hours still lost to the last start
    for i, count in enumerate(window.counts):
        now = i * step_hours
        clock = window.start_hours + now
        full = min(int(count), market.spot.max_count) >= n
        left_hours = (job.samples - done) / rate / 3600
        slack = job.deadline_hours - now - left_hours - (pause if mode != IDLE else 0.0)
        ahead = done - job.samples * now / job.deadline_hours  # samples ahead of the straight line
        restart_work = restart * 3600 * rate
        if not committed and slack <= net:
            committed = True
        if committed:
            target = ON_DEMAND
        elif full and (mode == SPOT or slack - restart > net):
            target = SPOT
            if rule == "uniform-progress" and mode == ON_DEMAND and ahead < restart_work:
                target = ON_DEMAND
        elif full:  # spot is there but a start on it would eat the safety net
            committed, target = True, ON_DEMAND
        elif rule == "greedy":
            target = IDLE
        else:
            target = ON_DEMAND if ahead < 0 or (mode == ON_DEMAND and ahead < restart_work) else IDLE
        if target != mode:
            pause = 0.0 if target == IDLE else restart
            mode = target
        if mode == IDLE:
            continue
        price = market.spot.price_at(clock) if mode == SPOT else market.on_demand.price_at(clock)
        lost = min(pause, step_hours)
        pause -= lost
        gain = rate * (step_hours - lost) * 3600
        share = 1.0
        if done + gain >= job.samples:
            share = (lost + (job.samples - done) / rate / 3600) / step_hours
        dollars += share * step_hours * n * price
        if mode == SPOT:
            spot_hours += share * step_hours * n
        else:
            od_hours += share * step_hours * n
        if share < 1.0:
            finish = now + share * step_hours
            return Outcome(dollars, finish, finish <= job.deadline_hours + 1e-9, od_hours, spot_hours)
        done += gain
    return Outcome(dollars, None, False, od_hours, spot_hours)


def frontier(dollars: np.ndarray, rates: np.ndarray) -> list[int]:
    """The corners of the upper concave frontier of the points (dollars[k], rates[k]),
    from point 0 (which must be (0, 0)): the most samples each spend buys when time may
    be shared between the points; samples per dollar fall from corner to corner."""
    hull = [0]
    for k in sorted(range(len(dollars)), key=lambda k: (dollars[k], -rates[k])):
        if rates[k] <= rates[hull[-1]]:
            continue  # costs as much or more, trains no more
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (rates[b] - rates[a]) * (dollars[k] - dollars[a]) <= (rates[k] - rates[a]) * (dollars[b] - dollars[a]):
                hull.pop()
            else:
                break
        hull.append(k)
    return hull


def omniscient(job: DeadlineJob, window: SpotWindow, market: Market, model: ElasticModel) -> Outcome:
    """A lower bound on the dollars of any elastic run that finishes by the deadline.

    Relax the job to a linear program over the intervals before the deadline. In each
    interval it may share the time at will among pairs (a, b): a spot instances (at most
    the s_t there) and b on-demand ones that have started, a + b <= N, trained at the
    model's rate r(a + b) with no pause for changes or restarts. Every rise of the
    interval's mean b over the last one pays the on-demand start-up for the rise.

    Any real run is one such schedule, one pair per interval, and pays at least its
    dollars: its spot and started on-demand instances at their prices (holding more than
    N costs more and trains no more), and a start-up for every on-demand instance that
    starts, which the rises of b count at most. So the program's optimum costs no more
    than any real run that finishes in time. Intervals in a row with the same spot count
    and prices are one variable: sharing each pair's time evenly over them keeps the
    samples and dollars and counts no more rises (a path through the values of b passes
    through their mean). For each b only the pairs on the upper concave frontier of
    (dollars, rate) over a are kept: the others are mixtures of those at less cost. A
    start-up is priced at the lowest on-demand price of the intervals it may have run in
    (a rising price trace would otherwise charge more than a run that started early paid).
    """
    n = min(job.max_instances, model.max_instances)
    step_hours = window.interval_seconds / 3600
    steps = min(len(window.counts), int(np.ceil(job.deadline_hours / step_hours - 1e-9)))
    rates = np.asarray(model.rates[:n + 1], dtype=float)
    most_on_demand = min(n, market.on_demand.max_count)
    on_demand_prices = [market.on_demand.price_at(window.start_hours + t * step_hours) for t in range(steps)]
    starting = int(np.ceil(market.on_demand.startup_hours / step_hours - 1e-9))  # intervals a start-up is paid in
    blocks: list[list] = []  # [hours, spot count, spot price, on-demand price]
    start_ups = []  # per block: the least a start-up that ends at its first interval can have cost
    for t in range(steps):
        clock = window.start_hours + t * step_hours
        key = [min(int(window.counts[t]), n, market.spot.max_count), market.spot.price_at(clock), on_demand_prices[t]]
        share = min(1.0, job.deadline_hours / step_hours - t) * step_hours  # the deadline may cut the last interval
        if blocks and blocks[-1][1:] == key:
            blocks[-1][0] += share
        else:
            blocks.append([share, *key])
            start_ups.append(market.on_demand.startup_hours * min(on_demand_prices[max(0, t - starting):t + 1]))
    columns = []  # per pair and block: block, dollars, samples, on-demand and spot instance-hours, b
    for j, (hours, spot, spot_price, on_demand_price) in enumerate(blocks):
        for b in range(most_on_demand + 1):
            most_spot = min(spot, n - b)
            hull = frontier(np.arange(most_spot + 1) * spot_price, rates[b:b + most_spot + 1])
            for a in hull:
                if a + b:
                    columns.append((j, hours * (a * spot_price + b * on_demand_price), hours * 3600 * rates[a + b],
                                    hours * b, hours * a, b))
    table = np.array(columns, dtype=float).reshape(-1, 6)
    block = table[:, 0].astype(int)
    best = np.zeros(len(blocks), dtype=int)  # per block, its fastest pair (the cheapest of them): the most a run can do
    for k in np.lexsort((-table[:, 1], table[:, 2])):
        best[block[k]] = k
    dollars, samples, on_demand_hours, spot_hours = table[best, 1:5].sum(axis=0)
    if samples < job.samples * (1 - 1e-12):
        return Outcome(float(dollars), None, False, float(on_demand_hours), float(spot_hours))
    chosen, dollars = _cheapest_schedule(job, table, block, start_ups)
    last = int(block[chosen > 1e-9].max())
    finish = min(job.deadline_hours, sum(b[0] for b in blocks[:last + 1]))
    return Outcome(dollars, finish, True, float(chosen @ table[:, 3]), float(chosen @ table[:, 4]))


def _cheapest_schedule(job: DeadlineJob, table: np.ndarray, block: np.ndarray,
                       start_up: list[float]) -> tuple[np.ndarray, float]:
    """The linear program of `omniscient`: each pair's share of its block, and the rises
    of b as slack variables paying `start_up[j]` dollars each. Returns the shares and the
    dollars."""
    pairs, blocks = len(table), len(start_up)
    column = np.arange(pairs)
    later = block + 1 < blocks
    rows = np.concatenate([block, np.full(pairs, blocks), blocks + 1 + block, blocks + 1 + block[later] + 1,
                           blocks + 1 + np.arange(blocks)])
    cols = np.concatenate([column, column, column, column[later], pairs + np.arange(blocks)])
    values = np.concatenate([np.ones(pairs), -table[:, 2], table[:, 5], -table[later, 5], -np.ones(blocks)])
    bounds = np.concatenate([np.ones(blocks), [-job.samples], np.zeros(blocks)])
    result = linprog(np.concatenate([table[:, 1], start_up]), A_ub=csr_matrix((values, (rows, cols)),
                     shape=(2 * blocks + 1, pairs + blocks)), b_ub=bounds, bounds=(0, None), method="highs")
    if result.status != 0:
        raise RuntimeError(f"the omniscient bound's linear program failed: {result.message}")
    return result.x[:pairs], float(result.fun)

