"""The coordinator's provisioning: how many on-demand instances its job holds, decided at
every interval boundary by the deadline policy (provisioning/policy.py).

With pools, a deadline and a provisioner in its config, the leading coordinator asks the
policy what to hold from what it knows then: the work left (the deadline's target less
the progress record's), the time left (its `hours` count from when dollars started
counting), the spot instances available (those of the spot pool with a live member: a
spot fleet holds all the market gives), the on-demand ones held (asked for and not given
back) and ready (with a live member), the job's samples/s on 0..N instances and the pause
of a change (its throughput model, as learned from step reports, and its migration cost
model), a spot outlook from the spot counts seen at each boundary, the prices now and
the on-demand start-up. Only on-demand instances are provisioned: spot ones are the
market's to give. The first decision waits for the job's first progress record: until
then its members are starting and its rates are the profile's, not the job's.

A backend that runs in the coordinator (SLURM) is called directly: the difference is
requested or released. Either way the counts wanted are published (the `provisioning`
record): a remote backend (the emulator, which `parcae replay` runs) applies them from
there, and a successor coordinator starts from them. Each change is a `provisioned` event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from megatron_parcae.control.cost import CostMeter
from megatron_parcae.control.etcd import JobStore, NotLeader, SchemaError
from megatron_parcae.control.etcd.client import Compare
from megatron_parcae.control.etcd.keys import MemberRecord, ProvisioningRecord
from megatron_parcae.events import EventWriter, Provisioned
from megatron_parcae.provisioning.elastic import ElasticModel, SpotOutlook
from megatron_parcae.provisioning.policy import DeadlinePolicy, ProvisioningState
from megatron_parcae.provisioning.pools import Market, Pool
from megatron_parcae.provisioning.provisioner import (
    Provisioner, ProvisionerConfig, ProvisionerError, create_provisioner, named_pool, provisioner_registry,
)
from megatron_parcae.provisioning.settings import Deadline

log = logging.getLogger("parcae.coordinator")


@dataclass(frozen=True)
class Observed:
    """What the coordinator knows at a boundary. Unix seconds; `done` in the deadline's unit."""

    now: float
    started_at: float  # when dollars started counting: the deadline's `hours` count from it
    spent_dollars: float
    done: float
    samples_per_unit: float  # 1 for a deadline in samples; the global batch for one in iterations
    spot: int  # spot instances with a live member
    on_demand_ready: int  # on-demand instances with a live member
    rates: tuple[float, ...]  # samples/s on 0..N instances
    change_seconds: float  # training lost per change of the instances
    restart_seconds: float  # training lost by a start from nothing


class Provisioning:
    """See the module docstring. `provisioner`: the backend, None where another process
    applies the published counts."""

    def __init__(self, market: Market, deadline: Deadline, interval_seconds: float, max_instances: int,
                 events: EventWriter, provisioner: Provisioner | None = None, budget: float | None = None,
                 policy: DeadlinePolicy = DeadlinePolicy()) -> None:
        self.market, self.deadline, self.budget = market, deadline, budget
        self._interval = interval_seconds
        self._max = max_instances
        self._events, self._provisioner, self._policy = events, provisioner, policy
        self._held = 0  # on-demand instances asked for and not given back
        self._outlook = SpotOutlook(max_instances, interval_seconds)
        self._model: tuple[object, ElasticModel] | None = None  # (the optimizer it was made of, the model)

    @classmethod
    def of(cls, pools: tuple[Pool, ...], deadline: Deadline | None, budget: float | None,
           config: ProvisionerConfig | None, job: str, interval_seconds: float, max_instances: int,
           events: EventWriter) -> Provisioning | None:
        """For a coordinator config: None without a deadline or a provisioner. PoolConfigError
        (a ValueError) where the pools are not one spot and one on-demand pool."""
        if deadline is None or config is None:
            return None
        market = Market.of(pools)
        provisioner = None if provisioner_registry.remote(config.backend) else create_provisioner(config, job, pools)
        return cls(market, deadline, interval_seconds, min(max_instances, market.spot.max_count +
                                                           market.on_demand.max_count),
                   events, provisioner, budget)

    @property
    def held(self) -> int:
        return self._held

    def pool_of(self, instance: str) -> str | None:
        """A member's pool by its instance: the backend's answer, or `<pool>/<number>`."""
        if self._provisioner is not None:
            return self._provisioner.pool_of(instance)
        return named_pool(instance, (self.market.spot.name, self.market.on_demand.name))

    def resume(self, record: ProvisioningRecord | None) -> None:
        """Hold what the previous leader wanted; a new spot outlook."""
        self._held = 0 if record is None else int(record.wanted.get(self.market.on_demand.name, 0))
        self._outlook = SpotOutlook(self._max, self._interval)

    def step(self, observed: Observed) -> ProvisioningRecord | None:
        """Decide and, in-process, apply; the record to publish when the count changed."""
        o, on_demand = observed, self.market.on_demand
        self._outlook.observe(o.spot)
        left = max(0.0, self.deadline.target - o.done)
        time_left = (self.deadline.due(o.started_at) - o.now) / 3600
        hour = (o.now - o.started_at) / 3600
        state = ProvisioningState(
            time_left_hours=time_left, remaining_samples=left * o.samples_per_unit, spot_available=o.spot,
            spot_held=o.spot, on_demand_held=self._held, on_demand_ready=min(o.on_demand_ready, self._held),
            rates=o.rates, spot_outlook=tuple(float(w) for w in self._outlook.weights),
            spot_price=self.market.spot.price_at(hour), on_demand_price=on_demand.price_at(hour),
            startup_hours=on_demand.startup_hours, change_hours=o.change_seconds / 3600,
            restart_hours=o.restart_seconds / 3600, interval_hours=self._interval / 3600,
            max_on_demand=on_demand.max_count, spent_dollars=o.spent_dollars, budget=self.budget)
        wanted = max(0, min(self._policy.decide(state).on_demand, on_demand.max_count))
        if wanted == self._held:
            return None
        reason = self._reason(wanted, left, time_left, o)
        names: list[str] = []
        if self._provisioner is not None:
            try:
                names = self._provisioner.request(on_demand.name, wanted - self._held) if wanted > self._held \
                    else self._provisioner.release(on_demand.name, self._held - wanted)
            except ProvisionerError as exc:
                log.warning("%s: %s; trying again at the next interval", reason, exc)
                return None
        log.info("on-demand pool %s: %d -> %d instances; %s", on_demand.name, self._held, wanted, reason)
        self._events.write(Provisioned(on_demand.name, self._held, wanted, reason, tuple(names), left, time_left,
                                       time=o.now))
        self._held = wanted
        return ProvisioningRecord(o.now, {on_demand.name: wanted}, reason)

    def _reason(self, wanted: int, left: float, time_left: float, o: Observed) -> str:
        running = min(self._max, o.spot + min(o.on_demand_ready, self._held))
        rate = o.rates[running] / o.samples_per_unit if running < len(o.rates) else 0.0
        finish = f"{left / rate / 60:.1f} min" if rate > 0 else "never"
        return (f"{'behind' if wanted > self._held else 'ahead'}: {left:.0f} {self.deadline.unit} left, "
                f"{time_left * 60:.1f} min to the deadline; {o.spot} spot and "
                f"{min(o.on_demand_ready, self._held)} on-demand instances finish in {finish}")

    # -- the coordinator's side --------------------------------------------------------

    def at_boundary(self, now: float, members: Mapping[int, MemberRecord], meter: CostMeter, optimizer,
                    gpus_per_instance: int, store: JobStore, guard: Callable[[], Sequence[Compare]]) -> None:
        """One decision from the coordinator's state (`members`: the available ones; the
        meter has counted up to `now`); publish the record if the count changed."""
        ledger = meter.ledger
        if ledger is None:
            return
        progress = store.progress()
        if progress is None:
            return
        iterations = self.deadline.unit == "iterations"
        done = progress.iteration if iterations else progress.consumed_samples
        per_unit = 1.0
        if iterations:
            per_unit = progress.consumed_samples / progress.iteration if progress.iteration \
                else float(optimizer.throughput.global_batch_size)
        held = meter.instances(dict(members))
        model = self._elastic(optimizer, gpus_per_instance)
        changes = model.change_seconds[1:]
        record = self.step(Observed(now, ledger.started_at, ledger.total, done, per_unit,
                                    held.get(self.market.spot.name, 0), held.get(self.market.on_demand.name, 0),
                                    model.rates, sum(changes) / len(changes), max(changes)))
        if record is not None and not store.publish_provisioning(record, guard()):
            raise NotLeader("the leader lease was lost while publishing the provisioning record")

    def resume_from(self, store: JobStore) -> None:
        try:
            record = store.provisioning()
        except SchemaError as exc:
            log.error("%s; holding no on-demand instances until the next decision", exc)
            record = None
        self.resume(record)

    def _elastic(self, optimizer, gpus_per_instance: int) -> ElasticModel:
        """Samples/s and change pauses on 0..N instances, made again when the optimizer is
        (it is rebuilt on what is learned)."""
        if self._model is None or self._model[0] is not optimizer:
            self._model = (optimizer, ElasticModel.from_throughput(optimizer.throughput, optimizer.costs, self._max,
                                                                   gpus_per_instance))
        return self._model[1]
