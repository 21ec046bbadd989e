"""Liveput: what preemptions will probably cost a layout, from plans of the real planner.

A forecast says, for each coming interval, how many instances there will be and how
many preemptions to expect. An instance has G GPUs, one worker each, and runs a block of
G consecutive ranks of a layout (reconfig/placement.py), so a layout of W workers uses
u = ceil(W / G) instances. Preempted instances are a uniform draw among those running,
so a layout using u of n instances loses j of its blocks with the hypergeometric
probability; which blocks those are decides whether the layout shrinks in place (every
stage keeps a replica: intra-stage), fetches a stage from a leaving instance during its
grace period (inter-stage) or, without notice, restarts from a checkpoint. The expected
cost of moving from one layout to another over those scenarios is what the optimizer's
dynamic program charges; liveput is the throughput of a layout net of that expected
cost over one interval. With G = 1 a block is a slot.

Costs of hypothetical changes come from `reconfig.plan.plan_migration` on canonical
layouts (workers 0..W-1 in rank order, worker w on instance w // G, the j lost blocks
spread over distinct stage columns and pipelines, arrivals as new instances), priced by
`MigrationCostModel`. Plans are cached by (old layout, new layout, lost slots, how they
were lost): layouts repeat from one decision to the next.

Some instances go without notice even when the cloud gives one (`SuddenLosses.share`):
hardware faults, notices that never arrive. A scenario in which v instances go is then
sudden with probability 1 - (1 - share)^v and priced as if all v were (at most two priced
outcomes per scenario): the state survives when every stage keeps a replica and the
optimizer is not distributed (its shards exist once); otherwise the job rolls back to its
workers' snapshots (every K steps, a buddy copy on the next instance: reconfig/copies.py)
and retrains K/2 steps, or, when a lost stage's snapshots went with it, restarts from
its checkpoint and retrains half a save interval. Layouts of more than `PLAN_WORKERS_LIMIT`
workers are planned with fewer data-parallel replicas: per-worker bytes, which set the
time, do not depend on D when both sides scale alike, nor do a rank's groups while D
stays above 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from megatron_parcae.liveput.cost import MigrationCost, MigrationCostModel, rank_groups
from megatron_parcae.liveput.throughput import ThroughputModel
from reconfig.layout import Layout, Parallelism
from reconfig.placement import Placement, copy_holders
from reconfig.plan import Copies, LostStateError, MigrationRequest, plan_migration

PLAN_WORKERS_LIMIT = 64
_TAIL = 1e-3  # the least likely outcomes of a distribution, this share of it together, are left out


@dataclass(frozen=True)
class StepOutlook:
    """One coming interval: instances available, and how many of the running ones get
    preempted at its start, as (probability, count) pairs summing to 1."""

    instances: int
    preemptions: tuple[tuple[float, int], ...]


@dataclass(frozen=True)
class SuddenLosses:
    """Preemptions that come without notice, and what the job recovers them from.

    `share`: probability that a preemption gives no notice (0: each is as the cost
    constants' grace period says; with no grace period, 1 prices every loss this way).
    `copy_interval`: steps K between the workers' snapshots (--parcae-copy-interval; 0:
    none). `save_interval`: steps between checkpoints (0: unknown, so a restart is charged
    no retrained steps)."""

    share: float = 0.0
    copy_interval: int = 10  # --parcae-copy-interval's default
    save_interval: int = 0

    def __post_init__(self) -> None:
        share = self.share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"sudden share: expected a probability from 0 to 1, got {share!r}")
        for name in ("copy_interval", "save_interval"):
            steps = getattr(self, name)
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                raise ValueError(f"{name.replace('_', ' ')}: expected a whole number of steps >= 0, got {steps!r}")
        object.__setattr__(self, "share", float(share))

    def check_batch(self, throughput: ThroughputModel) -> None:
        """Refuse a profile that cannot price the steps a sudden loss retrains: a step is
        the global batch at the layout's samples per second."""
        if self.share and (self.copy_interval or self.save_interval) and throughput.global_batch_size <= 0:
            raise ValueError(f"pricing the steps a sudden loss retrains needs the global batch size; the "
                             f"{throughput.model} profile names none (global_batch_size=... in a table's comment)")


def preemption_distribution(expected: float, at_least: int, certain: bool) -> tuple[tuple[float, int], ...]:
    """Distribution of the number of preemptions in one interval.

    `certain`: the forecast knows the future (its quantiles coincide), the count is
    `expected` rounded. Otherwise Poisson with mean `expected`, conditioned on at least
    `at_least` (the drop in the forecast count cannot happen with fewer), tail cut at 0.1%.
    """
    at_least = max(0, at_least)
    if certain:
        return ((1.0, max(at_least, round(expected))),)
    lam = max(expected, 0.0)
    if lam == 0.0:
        return ((1.0, at_least),)
    k, p = 0, math.exp(-lam)
    mass, terms = 0.0, []
    while True:
        if k >= at_least:
            terms.append((p, k))
            mass += p
        if k >= at_least and k > lam and p <= _TAIL * mass:
            break
        k += 1
        p *= lam / k
    if mass == 0.0:  # `at_least` is far out in the tail: it is all that can happen
        return ((1.0, at_least),)
    return tuple((q / mass, k) for q, k in terms)


def instances_used(parallelism: Parallelism, gpus_per_instance: int) -> int:
    """Instances a layout runs on: its blocks of G ranks."""
    return -(-parallelism.world_size // gpus_per_instance)


@lru_cache(maxsize=65536)
def victims_distribution(instances: int, used: int, preempted: int) -> tuple[tuple[float, int], ...]:
    """(probability, j): j of the `used` instances a layout runs on are among `preempted`
    instances drawn uniformly from `instances` (hypergeometric; the least likely j, 0.1%
    of the probability together, are left out)."""
    preempted = min(preempted, instances)
    total = math.comb(instances, preempted)
    terms = [(math.comb(used, j) * math.comb(instances - used, preempted - j) / total, j)
             for j in range(max(0, preempted - (instances - used)), min(preempted, used) + 1)]
    mass, out = 0.0, []
    for p, j in sorted(terms, reverse=True):  # likeliest first; the tails (many j when hundreds go) drop out
        out.append((p, j))
        mass += p
        if mass >= 1.0 - _TAIL:
            break
    return tuple(sorted(((p / mass, j) for p, j in out), key=lambda t: t[1]))


@lru_cache(maxsize=65536)
def wipe_probability(columns: int, replicas: int, victims: int, per_block: int = 1) -> float:
    """Probability that `victims` uniform distinct blocks include every replica of some
    column, the slots of a columns x replicas grid cut, column after column, into blocks
    of `per_block` (the last may be short; a block is what one preemption takes).

    Blocks that hold replicas of one column only form a columns x (replicas / per_block)
    grid: inclusion-exclusion. Otherwise a column's blocks are a run, and the subsets
    that cover no run are counted block by block, by the length of the chosen run they
    end with."""
    if replicas % per_block == 0:
        replicas //= per_block
        slots = columns * replicas
        if victims < replicas:
            return 0.0
        total = math.comb(slots, victims)
        p = 0.0
        for i in range(1, min(columns, victims // replicas) + 1):
            p += (-1) ** (i + 1) * math.comb(columns, i) * math.comb(slots - i * replicas,
                                                                     victims - i * replicas) / total
        return min(max(p, 0.0), 1.0)
    blocks = -(-columns * replicas // per_block)
    shortest: dict[int, int] = {}  # last block of a column -> fewest blocks of a column ending there
    for c in range(columns):
        first, last = c * replicas // per_block, ((c + 1) * replicas - 1) // per_block
        shortest[last] = min(shortest.get(last, blocks), last - first + 1)
    total = math.comb(blocks, victims)
    return (total - _ways_without_runs(blocks, shortest, victims, False)) / total


def _ways_without_runs(blocks: int, ends: dict[int, int], chosen: int, first_chosen: bool) -> int:
    """Ways to choose `chosen` of `blocks` blocks in a row (the first among them when
    `first_chosen`) so that the chosen blocks up to block b never end in a run of
    `ends[b]` or more."""
    longest = max(ends.values(), default=1)
    ways = {(0, 0): 1}  # (blocks chosen, chosen run at the end, capped) -> ways
    for b in range(blocks):
        following: dict[tuple[int, int], int] = {}
        for (count, run), n in ways.items():
            if not (first_chosen and b == 0):
                following[count, 0] = following.get((count, 0), 0) + n
            if count < chosen:
                key = (count + 1, min(run + 1, longest))
                following[key] = following.get(key, 0) + n
        limit = ends.get(b, longest + 1)
        ways = {key: n for key, n in following.items() if key[1] < limit}
    return sum(n for (count, _), n in ways.items() if count == chosen)


@lru_cache(maxsize=65536)
def copies_recovery_probability(parallelism: Parallelism, gpus_per_instance: int, victims: int,
                                distributed_optimizer: bool) -> float:
    """Probability that the snapshots make up for `victims` uniform instances of a
    canonical layout lost without notice, given that they took state no survivor holds
    (a stage's every replica; any worker's, with the distributed optimizer).

    A worker's buddy is the worker G ranks on (placement.copy_holders), on the next
    instance, round the layout's instances in a ring (a short last instance taken as a
    whole one). A survivor's snapshot is whole over DP, so the planner (plan.Copies)
    fails only on a stage whose every worker went together with its buddy: with ranks
    in stage order, the stage's instances and the next one all lost. That is counted
    exactly: as `wipe_probability` counts a stage's instances, with each stage's run one
    instance longer and the last stage's wrapping round to the first instance."""
    used = instances_used(parallelism, gpus_per_instance)
    if used < 2 or victims == 0:
        return 0.0  # one instance keeps no copy elsewhere (copy_holders is empty)
    size = parallelism.tp * parallelism.dp
    runs = {(size * p // gpus_per_instance, (size * (p + 1) - 1) // gpus_per_instance + 1)
            for p in range(parallelism.pp)}  # (first, last) instance a stage's recovery needs, last may be `used`
    # Block 0 not chosen: no run through it can be, the rest is a row from block 1.
    apart = {}
    for first, last in runs:
        if first >= 1 and last <= used - 1:
            apart[last - 1] = min(apart.get(last - 1, used), last - first + 1)
    avoided = _ways_without_runs(used - 1, apart, victims, False)
    # Block 0 chosen: a run wrapping round to it needs only its part in the row.
    together: dict[int, int] = {}
    for first, last in runs:
        end = min(last, used - 1)
        together[end] = min(together.get(end, used), end - first + 1)
    avoided += _ways_without_runs(used, together, victims, True)
    failed = 1.0 - avoided / math.comb(used, victims)
    if distributed_optimizer:
        return max(0.0, 1.0 - failed)
    lost = wipe_probability(parallelism.pp, parallelism.dp, victims, gpus_per_instance // parallelism.tp)
    return 0.0 if lost == 0.0 else min(1.0, max(0.0, 1.0 - failed / lost))


@lru_cache(maxsize=4096)
def spread_order(parallelism: Parallelism, gpus_per_instance: int) -> tuple[int, ...]:
    """Every block of `parallelism`, in the order canonical preemptions take them: its
    tensor-parallel groups (T divides G: each lies in one block) walked over distinct
    stages and pipelines, a block when its first group comes up (with G = 1, the ranks)."""
    T, P, D = parallelism.tp, parallelism.pp, parallelism.dp
    order: dict[int, None] = {}
    for i in range(P * D):
        stage, round_ = i % P, i // P
        order.setdefault(T * ((round_ + stage) % D + D * stage) // gpus_per_instance)
    return tuple(order)


def spread_victims(parallelism: Parallelism, count: int, gpus_per_instance: int = 1) -> tuple[int, ...]:
    """Ranks of `count` lost instances (blocks of G ranks), spread over distinct stages
    and pipelines."""
    lost = set(spread_order(parallelism, gpus_per_instance)[:count])
    return tuple(r for r in range(parallelism.world_size) if r // gpus_per_instance in lost)


@lru_cache(maxsize=4096)
def survivable(parallelism: Parallelism, gpus_per_instance: int) -> int:
    """How many blocks can go, in spread order, with every (stage, tp) column keeping a
    replica; every block when not even one can."""
    T, P, D = parallelism.tp, parallelism.pp, parallelism.dp
    columns = [frozenset((t + T * (d + D * p)) // gpus_per_instance for d in range(D))
               for p in range(P) for t in range(T)]
    order = spread_order(parallelism, gpus_per_instance)
    lost: set[int] = set()
    for count, block in enumerate(order):
        lost.add(block)
        if any(column <= lost for column in columns):
            return count or len(order)
    return len(order)


@lru_cache(maxsize=256)
def canonical_placement(gpus_per_instance: int, workers: int) -> Placement:
    """Workers 0..workers-1 on instances of G, in id order: a canonical layout's blocks."""
    return Placement(gpus_per_instance, {w: str(w // gpus_per_instance) for w in range(workers)})


def _reduced(p: Parallelism, dp: int) -> Parallelism:
    return Parallelism(p.tp, p.pp, dp, p.stage_layers)


NOTICED, SUDDEN, FROM_COPIES = "noticed", "sudden", "copies"  # how a canonical plan's victims went


class ScenarioCosts:
    """Expected seconds of layout changes over preemption scenarios, with a plan cache,
    for layouts whose T divides G (see throughput.OnInstances). `distributed_optimizer`:
    the job's, which decides whether a sudden loss takes state no survivor holds."""

    def __init__(self, throughput: ThroughputModel, costs: MigrationCostModel, gpus_per_instance: int = 1,
                 sudden: SuddenLosses = SuddenLosses(), distributed_optimizer: bool = False):
        sudden.check_batch(throughput)
        self.throughput = throughput
        self.costs = costs
        self.gpus_per_instance = gpus_per_instance
        self.sudden = sudden
        self.distributed_optimizer = distributed_optimizer
        self.interval = costs.constants.interval_seconds
        self._with_notice = costs.constants.grace_period_seconds > 0
        self._loss = NOTICED if self._with_notice else SUDDEN  # how the constants say instances go
        self._cache: dict[tuple, MigrationCost] = {}
        self._floors: dict[tuple[Parallelism | None, Parallelism], float] = {}

    # -- one change --------------------------------------------------------------------

    def change_cost(self, old: Layout, lost: frozenset[int], leaving: frozenset[int],
                    target: Parallelism) -> MigrationCost:
        """Cost of moving `old` (minus `lost` and `leaving` workers) to `target`, with as many
        fresh instances as it needs. Cached by the slots lost, so it holds for any worker
        ids; above the plan size limit, leaving instances are taken as spread out."""
        if not lost and (not leaving or self._with_notice) and \
                max(old.parallelism.world_size, target.world_size) > PLAN_WORKERS_LIMIT:
            blocks = {old.rank_of(w) // self.gpus_per_instance for w in leaving}
            return self._canonical_cost(old.parallelism, target, len(blocks))
        lost_ranks = frozenset(old.rank_of(w) for w in lost)
        leaving_ranks = frozenset(old.rank_of(w) for w in leaving)
        if not lost_ranks and not leaving_ranks:
            return self._canonical_cost(old.parallelism, target, 0)
        key = (old.parallelism, lost_ranks, leaving_ranks, target)
        cost = self._cache.get(key)
        if cost is None:
            cost = self._cache[key] = self._plan_cost(old.parallelism, lost_ranks, leaving_ranks, target)
        return cost

    def _plan_cost(self, old: Parallelism, lost_ranks: frozenset[int], leaving_ranks: frozenset[int],
                   target: Parallelism, from_copies: bool = False) -> MigrationCost:
        """Cost of `old` on canonical workers (worker = rank, instance = rank // G) to
        `target`. The spare GPUs of the last instance wait as standbys unless a rank of it
        went; fresh instances arrive for what the workers left cannot hold in blocks.
        `from_copies`: the state comes from the workers' snapshots (plan.Copies)."""
        g = self.gpus_per_instance
        used = instances_used(old, g)
        layout = Layout(old, tuple(range(old.world_size)))
        copies = Copies(1, copy_holders(layout, canonical_placement(g, used * g))) if from_copies else None
        survivors = frozenset(range(old.world_size)) - lost_ranks - leaving_ranks
        gone = {r // g for r in lost_ranks | leaving_ranks}
        spares = frozenset() if used - 1 in gone else frozenset(range(old.world_size, used * g))
        capacity = canonical_placement(g, used * g).capacity(survivors | spares)
        fresh = max(0, -(-(target.world_size - capacity) // g))
        joining = spares | frozenset(range(used * g, (used + fresh) * g))
        request = MigrationRequest(layout, survivors, frozenset(leaving_ranks), joining,
                                   placement=canonical_placement(g, (used + fresh) * g), copies=copies)
        try:
            plan = plan_migration(request, target, self.costs.shape)
        except LostStateError:
            return self.costs.restart_cost(target, joining=target.world_size > len(survivors))
        return self.costs.plan_cost(plan)

    def _canonical_cost(self, old: Parallelism, new: Parallelism, victims: int,
                        how: str | None = None) -> MigrationCost:
        """Cost of old -> new when `victims` of old's instances are preempted `how` (NOTICED,
        SUDDEN: spread out; FROM_COPIES: every other instance, so each victim's buddy on the
        next one lives; more than half of the instances are priced as that half, as each
        buddy sends its one ward's copy either way). Default: as the constants say."""
        how = self._loss if how is None or victims == 0 else how
        full_key = ("full", old, new, victims, how)
        cost = self._cache.get(full_key)
        if cost is not None:
            return cost
        g = self.gpus_per_instance
        scale = PLAN_WORKERS_LIMIT / max(old.world_size, new.world_size)
        small_old, small_new, small_victims = old, new, victims
        if scale < 1:  # fewer replicas, the same share of them preempted
            small_old = _reduced(old, max(min(old.dp, 2), round(old.dp * scale)))
            small_new = _reduced(new, max(min(new.dp, 2), round(new.dp * scale)))
            if victims:
                small_victims = min(max(1, round(victims * instances_used(small_old, g) / instances_used(old, g))),
                                    survivable(small_old, g))
        if how == FROM_COPIES:
            small_victims = min(small_victims, max(1, instances_used(small_old, g) // 2))
        key = ("planned", old, new, small_victims, how)
        cost = self._cache.get(key)
        if cost is None:
            if how == FROM_COPIES:
                ranks = frozenset(r for r in range(small_old.world_size) if r // g in range(0, 2 * small_victims, 2))
            else:
                ranks = frozenset(spread_victims(small_old, small_victims, g))
            lost, leaving = (frozenset(), ranks) if how == NOTICED else (ranks, frozenset())
            cost = self._cache[key] = self._plan_cost(small_old, lost, leaving, small_new, how == FROM_COPIES)
        self._cache[full_key] = cost
        return cost

    # -- expectations over scenarios -----------------------------------------------------

    def expected_seconds(self, old: Parallelism, new: Parallelism, previous_instances: int,
                         step: StepOutlook) -> float:
        """Expected cost of changing old -> new at the start of `step`, when old ran on
        `previous_instances` instances and the step's preemptions hit them."""
        return sum(pk * self.preempted_seconds(old, new, previous_instances, preempted)
                   for pk, preempted in step.preemptions)

    def preempted_seconds(self, old: Parallelism, new: Parallelism, previous_instances: int, preempted: int) -> float:
        """Expected cost of old -> new when `preempted` of `previous_instances` instances go."""
        used = instances_used(old, self.gpus_per_instance)
        return sum(pj * self._victims_seconds(old, new, victims)
                   for pj, victims in victims_distribution(previous_instances, used, preempted))

    def _victims_seconds(self, old: Parallelism, new: Parallelism, victims: int) -> float:
        """Cost of old -> new after `victims` of old's instances are preempted. A change of
        T or of the stage partition re-sends nearly every worker's state whoever was
        preempted, so it is planned without victims (fewer plans), unless the victims
        decide whether it takes in new instances (Parcae's engine then pays a rendezvous
        and every group at the new-worker rate); the chance that victims take every
        replica of a stage without notice is still counted: a stage's replicas are D
        tensor-parallel groups, G / T of them to an instance. With probability
        1 - (1 - share)^victims some victim gives no notice: priced as if none did."""
        if victims == 0 and old == new:
            return 0.0
        used = instances_used(old, self.gpus_per_instance)
        reshape = old.tp != new.tp or old.stage_layers != new.stage_layers
        joins_for_victims = used - victims < instances_used(new, self.gpus_per_instance) <= used
        planned = 0 if reshape and not joins_for_victims else victims
        sudden = 1.0 - (1.0 - self.sudden.share) ** victims
        if sudden == 0.0:
            return self._noticed_seconds(old, new, victims, planned)
        seconds = sudden * self._sudden_seconds(old, new, victims, planned)
        if sudden < 1.0:
            seconds += (1.0 - sudden) * self._noticed_seconds(old, new, victims, planned)
        return seconds

    def _noticed_seconds(self, old: Parallelism, new: Parallelism, victims: int, planned: int) -> float:
        """`_victims_seconds` as the constants' grace period says: each victim noticed or,
        with no grace period, lost without notice, a stage left without a replica restarting
        from the checkpoint (with no step retrained: that needs `SuddenLosses`)."""
        cost = self._canonical_cost(old, new, planned).seconds
        if self._with_notice or victims == 0:
            return cost
        wipe = wipe_probability(old.pp, old.dp, victims, self.gpus_per_instance // old.tp)
        if wipe == 0.0:
            return cost
        lost = len(spread_victims(old, victims, self.gpus_per_instance))
        restart = self.costs.restart_cost(new, joining=new.world_size > old.world_size - lost).seconds
        return (1 - wipe) * cost + wipe * restart

    def _sudden_seconds(self, old: Parallelism, new: Parallelism, victims: int, planned: int) -> float:
        """`_victims_seconds` when every victim goes without notice. Survivors hold the
        state unless a stage lost every replica or the optimizer is distributed; if not,
        the job rolls back to its snapshots and retrains K/2 steps, or restarts from the
        checkpoint and retrains half a save interval, steps of the old layout."""
        g = self.gpus_per_instance
        lost_state = 1.0 if self.distributed_optimizer else wipe_probability(old.pp, old.dp, victims, g // old.tp)
        seconds = 0.0
        if lost_state < 1.0:
            seconds += (1.0 - lost_state) * self._canonical_cost(old, new, planned, SUDDEN).seconds
        if lost_state == 0.0:
            return seconds
        step = self.throughput.global_batch_size / self.throughput.samples_per_second(old)
        lost = len(spread_victims(old, victims, g))
        recovery = self.costs.restart_cost(new, joining=new.world_size > old.world_size - lost).seconds \
            + self.sudden.save_interval / 2 * step
        if self.sudden.copy_interval:
            rolled_back = copies_recovery_probability(old, g, victims, self.distributed_optimizer)
            if rolled_back:
                from_copies = self._canonical_cost(old, new, planned, FROM_COPIES).seconds \
                    + self.sudden.copy_interval / 2 * step
                recovery = rolled_back * from_copies + (1.0 - rolled_back) * recovery
        return seconds + lost_state * recovery

    def change_floor(self, old: Parallelism | None, new: Parallelism) -> float:
        """A bound below the cost of changing `old` to `new` (any old when None), from the
        layouts alone, so no plan is needed. Any change creates the world and every rank's
        groups again, at the cheaper group rate. With the same T, each worker of a new stage
        receives at least what the best-overlapping old stage lacks of it. A larger layout
        takes in new workers: each receives a whole stage, and creates each of its groups
        at the new-worker rate (counted for planned sizes only: a reduced plan may take in
        none). Bytes take the network, or the faster of it and the instance's own links
        when an instance has several GPUs. Parcae's charges move bytes by Parcae's own rule
        (its last new stage's only, when D is 1), so for them only the first part holds."""
        key = (old, new)
        floor = self._floors.get(key)
        if floor is not None:
            return floor
        c, shape, width = self.costs.constants, self.costs.shape, self.costs.shape.state_bytes_per_param
        slow, fast = sorted((c.group_create_seconds_survivors_only, c.group_create_seconds_with_new_worker))
        groups, _ = rank_groups(new, np.zeros(new.world_size, dtype=bool))
        floor = c.world_init_seconds + groups.max() * slow
        if old is not None and self.costs.moves_missing_state:
            def stage_bytes(p: Parallelism, stage: int) -> dict[str, float]:
                return {u.name: (u.split_params / p.tp + u.replicated_params) * width
                        for u in p.stage_units(shape, stage)}

            new_stages = [stage_bytes(new, s) for s in range(new.pp)]
            receive = 0.0
            if old.tp == new.tp:
                old_stages = [stage_bytes(old, s) for s in range(old.pp)]
                for needed in new_stages:
                    kept = max(sum(b for name, b in needed.items() if name in held) for held in old_stages)
                    receive = max(receive, sum(needed.values()) - kept)
            joiners = new.world_size - old.world_size
            if joiners > 0:
                receive = max(receive, min(sum(needed.values()) for needed in new_stages))
                if max(old.world_size, new.world_size) <= PLAN_WORKERS_LIMIT:
                    floor += max(0.0, groups.min() * fast - groups.max() * slow)
            seconds = c.transfer_seconds(receive)
            if self.gpus_per_instance > 1:
                seconds = min(seconds, c.intra_instance_seconds(receive))
            floor += seconds
        self._floors[key] = floor
        return floor

    def liveput(self, layout: Parallelism, instances: int, step: StepOutlook) -> float:
        """Expected samples per second of keeping `layout` through `step` (after running on
        `instances`), net of what its preemptions cost: equal to the throughput when nothing
        is preempted, 0 when the step has too few instances for it."""
        if layout.world_size > step.instances * self.gpus_per_instance:
            return 0.0
        seconds = self.expected_seconds(layout, layout, instances, step)
        return self.throughput.samples_per_second(layout) * (self.interval - seconds) / self.interval
