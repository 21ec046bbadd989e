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

    Relax the job: in each interval before the deadline it may share the interval's time
    among instance counts n = 0..N at will, trained at the model's rate r(n), the first
    s_t of them (the spot instances there) paid at the spot price and the rest at the
    on-demand price (within the pool's limit), with no pause for changes, starts or
    start-ups. Any real run is one of these schedules (one count per interval, and it pays
    at least for the instances it trains on: the elastic policies pay for every spot
    instance they hold, a gang for N instances of one market, on spot only when s_t >= N),
    so the cheapest relaxed schedule costs no more than any real run that finishes in time.

    With time shared, what an interval's dollars can buy is the upper concave frontier of
    its points (dollars(n), r(n)): steps of falling samples per dollar. Choosing how much
    of each interval's frontier to buy is a fractional knapsack: taking steps across all
    intervals, most samples per dollar first, until the work is done takes a prefix of
    each interval's steps (a valid schedule) and is optimal by the knapsack's exchange
    argument.
    """
    n = min(job.max_instances, model.max_instances)
    steps = min(len(window.counts), int(np.ceil(job.deadline_hours * 3600 / window.interval_seconds - 1e-9)))
    step_hours = window.interval_seconds / 3600
    rates = np.asarray(model.rates[:n + 1], dtype=float)
    counts = np.arange(n + 1)
    rows = []  # per frontier step: dollars, samples, on-demand and spot instance-hours, interval
    corners: dict[tuple[int, float, float], np.ndarray] = {}
    for t in range(steps):
        clock = window.start_hours + t * step_hours
        spot = min(int(window.counts[t]), n, market.spot.max_count)
        key = (spot, market.spot.price_at(clock), market.on_demand.price_at(clock))
        if key not in corners:
            usable = counts[counts - spot <= market.on_demand.max_count]
            on_spot, on_demand = np.minimum(usable, spot), np.maximum(0, usable - spot)
            hourly = key[1] * on_spot + key[2] * on_demand
            hull = frontier(hourly, rates[usable])
            points = np.column_stack((hourly, rates[usable] * 3600, on_demand, on_spot))[hull]
            corners[key] = np.diff(points, axis=0)  # per step: $/h, samples/h, instances
        share = min(1.0, job.deadline_hours / step_hours - t) * step_hours  # the deadline may cut the last interval
        for step in corners[key]:
            rows.append((*(step * share), t))
    table = np.array(rows).reshape(-1, 5)
    order = np.argsort(table[:, 0] / table[:, 1], kind="stable")
    total = np.cumsum(table[order, 1])
    if not len(total) or total[-1] < job.samples * (1 - 1e-12):
        return Outcome(float(table[:, 0].sum()), None, False, float(table[:, 2].sum()), float(table[:, 3].sum()))
    cut = int(np.searchsorted(total, job.samples))
    taken = np.zeros(len(order))
    taken[order[:cut]] = 1.0
    taken[order[cut]] = (job.samples - (total[cut - 1] if cut else 0.0)) / table[order[cut], 1]
    last = int(table[taken > 0, 4].max())
    finish = min(job.deadline_hours, (last + 1) * step_hours)
    dollars, _, od_hours, spot_hours = (taken[:, None] * table[:, :4]).sum(axis=0)
    return Outcome(float(dollars), finish, True, float(od_hours), float(spot_hours))
