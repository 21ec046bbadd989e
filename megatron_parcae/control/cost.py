"""The coordinator's count of dollars: what its job's instances cost, by pool, live.

An instance is paid from when the coordinator first sees a member on it until its last
member is gone (the members of the job are its instances' workers, standby ones too).
Its pool is the one its member record names, else the one the provisioner says (its
`pool_of`), else the config's first pool. At each interval boundary, and whenever the
instances held by pool change, the coordinator publishes the `CostRecord` (etcd/keys.py),
which `parcae status` shows; at each boundary it also writes a `Cost` event and, with
tensorboard-dir, the cost scalars (dollars by pool, dollars an hour, the deadline and
the projected finish in hours from the start, the projected dollars).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_parcae.control.etcd import JobStore, NotLeader, SchemaError
from megatron_parcae.control.etcd.client import Compare
from megatron_parcae.control.etcd.keys import CostRecord, MemberRecord, ProgressRecord
from megatron_parcae.events import Cost, EventWriter
from megatron_parcae.provisioning.ledger import CostLedger, ProgressRate
from megatron_parcae.provisioning.pools import Pool
from megatron_parcae.provisioning.settings import Deadline
from megatron_parcae.scalars import ScalarBackend

log = logging.getLogger("parcae.coordinator")


@dataclass(frozen=True)
class Pricing:
    """The coordinator config's pools, deadline and budget."""

    pools: tuple[Pool, ...]
    deadline: Deadline | None = None
    budget: float | None = None


class CostMeter:
    """Counts the job's dollars for one coordinator while it leads (see the module docstring)."""

    def __init__(self, pricing: Pricing, store: JobStore, guard: Callable[[], Sequence[Compare]],
                 events: EventWriter, scalars: ScalarBackend | None = None,
                 pool_of: Callable[[str], str | None] | None = None) -> None:
        self._pricing = pricing
        self._pools = {pool.name: pool for pool in pricing.pools}
        self._default = pricing.pools[0].name
        self._store, self._guard, self._events, self._scalars = store, guard, events, scalars
        self._pool_of = pool_of
        self._ledger: CostLedger | None = None  # None: counting starts at the next count
        self._rate = ProgressRate()
        self._unknown: set[str] = set()  # pools named by members that the config lacks (warned)

    def resume(self) -> None:
        """Go on from the record a previous leader published (its instances are paid until
        the next count), or start counting at the next count."""
        self._rate = ProgressRate()
        try:
            record = self._store.cost()
        except SchemaError as exc:
            log.error("%s; counting dollars afresh", exc)
            record = None
        if record is None:
            self._ledger = None
            return
        dropped = sorted(set(record.dollars) - set(self._pools))
        if dropped:
            log.warning("the cost record has pools %s that the config does not: their dollars are no longer counted",
                        ", ".join(dropped))
        self._ledger = CostLedger(self._pools, record.started_at, record.counted_at,
                                  {p: d for p, d in record.dollars.items() if p in self._pools},
                                  {p: n for p, n in record.instances.items() if p in self._pools})

    @property
    def ledger(self) -> CostLedger | None:
        """The dollars counted so far; None before the first count."""
        return self._ledger

    def pool(self, member: MemberRecord) -> str:
        named = member.pool or (self._pool_of(member.instance) if self._pool_of is not None else None)
        if named is None:
            return self._default
        if named not in self._pools:
            if named not in self._unknown:
                self._unknown.add(named)
                log.warning("members name pool %r, which the config does not have: counted in pool %r",
                            named, self._default)
            return self._default
        return named

    def instances(self, members: dict[int, MemberRecord]) -> dict[str, int]:
        """Instances held by pool: an instance is in the pool of its first worker."""
        pool_of_instance: dict[str, str] = {}
        for _, member in sorted(members.items()):
            pool_of_instance.setdefault(member.instance, self.pool(member))
        counts = dict.fromkeys(self._pools, 0)
        for pool in pool_of_instance.values():
            counts[pool] += 1
        return counts

    def count(self, members: dict[int, MemberRecord], now: float, boundary: bool) -> None:
        """Pay what ran since the last count; publish at a boundary or when the instances
        held change (and at a boundary write the event and scalars too)."""
        held = self.instances(members)
        if self._ledger is None:
            self._ledger = CostLedger(self._pools, now, now)
        changed = held != self._ledger.instances
        self._ledger.advance(now, held)
        if not (boundary or changed):
            return
        progress = self._store.progress()
        record = self.record(progress)
        if not self._store.publish_cost(record, self._guard()):
            raise NotLeader("the leader lease was lost while publishing the cost record")
        if boundary:
            self._report(record, 0 if progress is None else progress.iteration)

    def record(self, progress: ProgressRecord | None) -> CostRecord:
        """The cost record now, the job's rate fed with `progress`."""
        ledger, deadline = self._ledger, self._pricing.deadline
        unit = None if deadline is None else deadline.unit
        done = 0 if progress is None else progress.iteration if unit == "iterations" else progress.consumed_samples
        if progress is not None:
            self._rate.observe(progress.recorded_at, done)
        finish = due = spend = None
        if deadline is not None:
            due = deadline.due(ledger.started_at)
            finish = self._rate.finish_at(deadline.target)
            spend = None if finish is None else ledger.projected(max(finish, ledger.counted_at))
        return CostRecord(ledger.started_at, ledger.counted_at, dict(ledger.dollars), dict(ledger.instances),
                          ledger.hourly(), unit, int(done), None if deadline is None else deadline.target, due, finish,
                          spend, self._pricing.budget)

    def _report(self, record: CostRecord, iteration: int) -> None:
        """The boundary's Cost event, and its scalars at the job's iteration (the workers' step)."""
        self._events.write(Cost(record.dollars, record.instances, record.hourly_dollars, record.unit, record.done,
                                record.target, record.deadline_at, record.projected_finish_at, record.projected_dollars,
                                record.budget, time=record.counted_at))
        if self._scalars is None:
            return

        def hours(at: float) -> float:
            return (at - record.started_at) / 3600

        scalars = {"parcae/dollars": sum(record.dollars.values()), "parcae/dollars-per-hour": record.hourly_dollars,
                   **{f"parcae/dollars/{pool}": dollars for pool, dollars in record.dollars.items()}}
        if record.deadline_at is not None:
            scalars["parcae/deadline-hours"] = hours(record.deadline_at)
        if record.projected_finish_at is not None:
            scalars["parcae/projected-finish-hours"] = hours(record.projected_finish_at)
            scalars["parcae/projected-dollars"] = record.projected_dollars
        self._scalars.add_scalars(scalars, iteration)
