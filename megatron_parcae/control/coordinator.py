"""`parcae coordinator`: the one process that decides the job's layout and publishes plans.

Each interval it feeds the predictor's forecaster the interval's available workers,
preemptions and arrivals, asks the liveput optimizer (the same objects the simulator
drives) for the layout of the coming interval, and publishes the next generation's
`PlanEnvelope` in etcd when the layout changes. It does not wait for the boundary when
membership forces a change: watches on the members and notices wake it at once.

Rules it keeps:
- Only the leader acts: every write is a transaction guarded by the leader lease, and a
  second coordinator waits (doing nothing) until the first resigns or its lease expires.
- All of its state is in etcd: the generation and layout are the newest plan; what the
  forecaster needs (availability history) and who was admitted to the layout are the
  `CoordinatorState` record (etcd/keys.py). A restarted coordinator continues from
  them; a generation is published only in a transaction that sees the previous one,
  so none is published twice.
- A change the membership forces (a notice, a lost worker) is published at once. A
  change the optimizer merely prefers (growth, a better shape) waits until every worker
  of the current layout has acknowledged it, so plans are applied one at a time.
- Workers whose WORLD broke (a peer died without notice or stalled) say so in their
  member record, and which layout's state they hold. Once every live worker of the
  layout has, the next plan moves their state in place without the lost ones, or
  re-forms the same layout if none was lost; a change that broke mid-way is planned
  again, without the lost ones, from the layout it started from, whose state its workers
  kept. What no live worker holds comes from the workers' snapshots, else from the last
  checkpoint.
- A worker whose member record changed process (it died and came back under the same
  id) lost its state: it counts as lost, and joins again later as a new worker. Workers
  dropped as lost that still hold a member key (a notice whose deadline passed) are
  fenced: their lease is revoked, so their agents report `fenced` and they exit.
- Notices that come together (every step of a preempted SLURM job, instances a cloud
  reclaims at once) get one plan: a change a new notice forces waits a moment for the
  rest of the batch (`_batching`), rather than move state onto a worker noticed next.
- When the layout's workers are leaving and no layout can be formed from the workers
  that remain, the job stops rather than lose what it trained since its last
  checkpoint: a save-and-exit plan asks the layout's workers to write a checkpoint of
  the iteration they are at and leave. It is published only if every one of them writes
  checkpoints (`can_save` in its member record: it runs with --save) and none was lost
  (the save is collective over the layout's WORLD). Once each has acknowledged it or is
  gone, a plan on the workers then available (at least min-workers, as for the first)
  resumes from that checkpoint.
- Workers a layout does not use are standby (a plan's `standby`); they join later.
- Only layouts the workers' model can be built in are planned: each member record says
  which model its worker trains, and a throughput table (unlike a layer profile) does
  not. While no layout of the profile can train it, the coordinator warns and waits.
- No layout mixes transformer implementations (implementations.py): workers stating
  another than the running layout's are left out, and a job that starts mixed is refused.
- Prices are learnt from the job: step times from the workers' step reports (at interval
  boundaries), migration costs from the phases each in-place change took, which the new
  layout's rank 0 reports (`ChangeReport`): the cost model's phase rates are fitted on the
  changes still kept, beside their plans, as soon as one is reported; the network between
  instances from the figures the workers measure when the first layout on two is built.
- With pools in its config it counts the job's dollars by pool as instances run, and
  projects its finish and cost against the deadline (control/cost.py). With a deadline
  and a provisioner too, it decides at each boundary how many on-demand instances to
  hold, and gets or gives them back (control/provisioning.py).
- When training ends (the `done` record a worker writes), the coordinator exits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_parcae.events import EventWriter, MigrationCostLearned, NetworkMeasured, PlanPublished, ThroughputLearned
from megatron_parcae.control.etcd import (
    EtcdClient,
    EtcdError,
    EtcdGone,
    JobStore,
    Leadership,
    NotLeader,
    PlanEnvelope,
    SchemaError,
)
from megatron_parcae.control.etcd.options import add_etcd_arguments, connect
from megatron_parcae.control.etcd.keys import (
    DECISIONS_KEPT,
    HISTORY_KEPT,
    SAVE_AND_EXIT,
    TRAIN,
    ChangeReport,
    CoordinatorState,
    MemberRecord,
    NetworkRecord,
    NoticeRecord,
    ProfileRecord,
)
from megatron_parcae.control.cost import CostMeter, Pricing
from megatron_parcae.control.implementations import MixedImplementations, one_implementation
from megatron_parcae.control.provisioning import Provisioning
from megatron_parcae.liveput import CostConstants, Decision, LiveputOptimizer, SuddenLosses, build_liveput
from megatron_parcae.liveput.cost import DEFAULT_CONSTANTS, MigrationCostModel, PhaseRates
from megatron_parcae.liveput.learned import ThroughputLearner
from megatron_parcae.liveput.throughput import ForModels, ProfileError, ThroughputModel
from megatron_parcae.provisioning.pools import Pool
from megatron_parcae.provisioning.provisioner import ProvisionerConfig, ProvisionerError
from megatron_parcae.provisioning.settings import Deadline, budget_of, config_pools
from megatron_parcae.scalars import ScalarBackend
from predictor.forecast import FORECASTERS, AvailabilityForecast, Forecaster, make_forecaster
from predictor.rates import RATES, ForecastRates, make_rates
from reconfig.layout import Layout, ModelShape
from reconfig.plan import Copies, MigrationPlan
from reconfig.placement import MAX_GPUS_PER_INSTANCE, ONE_GPU, Placement, copy_holders

log = logging.getLogger("parcae.coordinator")

STUCK_LEASES = 3  # a live worker silent this many lease periods after its WORLD broke counts as lost
# Retries of a change from one layout's kept state before the snapshots or the checkpoint,
# and of a rollback to one generation's snapshots before the checkpoint.
MAX_RETRIES = 3
NOTICE_BATCH_SECONDS = 1.0  # how long a forced change waits for the rest of a batch of notices (at most)
MAX_REST_SECONDS = 0.25  # the longest rest after a reconcile (see Coordinator._lead)


class ConfigError(ValueError):
    """A coordinator config that cannot be used; the message names the file, key and why."""


# -- configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class CoordinatorConfig:
    """What the coordinator is told in its YAML file (keys are these names with '-')."""

    profile: Path  # throughput table (CSV) or layer profile (JSON), as `parcae simulate --profile`
    model: str | None = None  # model shape in the cost constants, for a CSV profile
    cost_constants: Path = DEFAULT_CONSTANTS
    interval_seconds: float | None = None  # default: the cost constants'
    lookahead: int = 8  # intervals the liveput optimizer plans over
    grace_seconds: float | None = None  # notice before a preemption; default: the cost constants'
    lease_seconds: float = 10.0  # leader lease: how long a dead coordinator blocks its successor
    max_workers: int = 64  # largest job the layer-profile model enumerates layouts for
    min_workers: int = 1  # the first plan waits for this many workers
    distributed_optimizer: bool = False  # the workers train with --use-distributed-optimizer
    gpus_per_instance: int = 1  # workers (GPUs) of an instance: a preemption takes them all
    forecaster: str = "default"  # predictor.forecast.FORECASTERS: availability over the lookahead
    rates: str = "none"  # predictor.rates.RATES: expected preemptions from a rate model, not the forecaster
    tensorboard_dir: Path | None = None  # where each interval's forecast and liveput go as TensorBoard scalars
    sudden_share: float = 0.0  # share of preemptions that come without notice (liveput/scenarios.SuddenLosses)
    copy_interval: int = SuddenLosses.copy_interval  # the workers' --parcae-copy-interval (0: no snapshots)
    save_interval: int = 0  # the workers' --save-interval (0: unknown)
    # What the job buys (provisioning/settings.py): with pools, the coordinator counts dollars.
    pools: tuple[Pool, ...] = ()
    deadline: Deadline | None = None  # samples or iterations by a time
    budget: float | None = None  # dollars
    provisioner: ProvisionerConfig | None = None  # the backend that gets and gives back instances

    @classmethod
    def load(cls, path: str | Path) -> CoordinatorConfig:
        """Read and validate a YAML file; paths in it are relative to the file's folder."""
        where = f"coordinator config {path}"
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"{where}: not valid YAML: {str(exc).splitlines()[0]}") from None
        return cls.from_dict(data, where, Path(path).parent)

    @classmethod
    def from_dict(cls, data: Any, where: str, base: Path) -> CoordinatorConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
        names = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(names)}")
        if "profile" not in data:
            raise ConfigError(f"{where}: 'profile' is required (a throughput CSV or a layer-profile JSON)")
        values: dict[str, Any] = {}
        for key, value in data.items():
            name = names[key]
            if name in ("profile", "cost_constants"):
                values[name] = _existing_file(where, key, value, base)
            elif name == "model":
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{where}: model: expected a model name, got {value!r}")
                values[name] = value
            elif name == "tensorboard_dir":
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{where}: {key}: expected a folder path, got {value!r}")
                folder = Path(value) if Path(value).is_absolute() else base / value
                if folder.exists() and not folder.is_dir():
                    raise ConfigError(f"{where}: {key}: {folder} is not a folder")
                values[name] = folder
            elif name == "forecaster":
                if value not in FORECASTERS:
                    raise ConfigError(f"{where}: forecaster: expected one of {', '.join(FORECASTERS)}, got {value!r}")
                values[name] = value
            elif name == "rates":
                if value not in RATES:
                    raise ConfigError(f"{where}: rates: expected one of {', '.join(RATES)}, got {value!r}")
                values[name] = value
            elif name == "distributed_optimizer":
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}: {key}: expected true or false, got {value!r}")
                values[name] = value
            elif name == "sudden_share":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                    raise ConfigError(f"{where}: {key}: expected a probability from 0 to 1, got {value!r}")
                values[name] = float(value)
            elif name in ("copy_interval", "save_interval"):
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000_000:
                    raise ConfigError(f"{where}: {key}: expected a number of steps from 0 to 1000000000, "
                                      f"got {value!r}")
                values[name] = value
            elif name in ("pools", "deadline", "budget", "provisioner"):
                values[name] = _provisioning(where, name, value, base)
            elif name in ("lookahead", "max_workers", "min_workers", "gpus_per_instance"):
                top = MAX_GPUS_PER_INSTANCE if name == "gpus_per_instance" else 1_000_000
                if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                    raise ConfigError(f"{where}: {key}: expected an integer from 1 to {top}, got {value!r}")
                values[name] = value
            else:
                minimum = 0.0 if name == "grace_seconds" else None
                values[name] = _seconds(where, key, value, minimum)
        config = cls(**values)
        if config.min_workers > config.max_workers:
            raise ConfigError(f"{where}: min-workers {config.min_workers} exceeds max-workers {config.max_workers}")
        _check_pools(where, config)
        return config

    def optimizer(self, throughput: ThroughputModel | None = None, phase_rates: PhaseRates | None = None,
                  network: NetworkRecord | None = None) -> LiveputOptimizer:
        """The liveput optimizer of this job, built as `parcae simulate` builds it
        (liveput/factory.py), on the profile or on `throughput` made of it (learned from
        step reports, kept to the workers' models), pricing changes by the constants (on
        the `network` the workers measured, once they have) or by `phase_rates` (fitted on
        the changes' measured phases), with preemptions that give no notice priced by
        sudden-share, copy-interval and save-interval."""
        constants = CostConstants.load(self.cost_constants)
        constants = dataclasses.replace(
            constants,
            interval_seconds=self.interval_seconds or constants.interval_seconds,
            grace_period_seconds=constants.grace_period_seconds if self.grace_seconds is None else self.grace_seconds,
        )
        if network is not None:
            constants = constants.on_network(network.latency_seconds, network.bytes_per_second)
        return build_liveput(throughput or self.profile, constants, model=self.model, max_workers=self.max_workers,
                             lookahead=self.lookahead, distributed_optimizer=self.distributed_optimizer,
                             gpus_per_instance=self.gpus_per_instance, phase_rates=phase_rates,
                             sudden=SuddenLosses(self.sudden_share, self.copy_interval, self.save_interval)).optimizer()


def _existing_file(where: str, key: str, value: Any, base: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {key}: expected a file path, got {value!r}")
    path = Path(value) if Path(value).is_absolute() else base / value
    if not path.is_file():
        raise ConfigError(f"{where}: {key}: no file {path}")
    return path


def _provisioning(where: str, name: str, value: Any, base: Path) -> Any:
    """The pools, deadline, budget or provisioner of the config."""
    try:
        if name == "pools":
            return config_pools(value, base)
        if name == "deadline":
            return Deadline.from_dict(value)
        return budget_of(value) if name == "budget" else ProvisionerConfig.from_dict(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_pools(where: str, config: CoordinatorConfig) -> None:
    """A deadline, budget or provisioner prices pools; pools hold instances of the job's size."""
    if not config.pools:
        needing = [k for k in ("deadline", "budget", "provisioner") if getattr(config, k) is not None]
        if needing:
            raise ConfigError(f"{where}: {', '.join(needing)}: needs pools, the instances the job buys and their prices")
        return
    for pool in config.pools:
        if pool.gpus_per_instance != config.gpus_per_instance:
            raise ConfigError(f"{where}: pools: pool {pool.name!r} has gpus_per_instance {pool.gpus_per_instance}, "
                              f"but gpus-per-instance is {config.gpus_per_instance}: set them equal")


def _seconds(where: str, key: str, value: Any, minimum: float | None) -> float:
    """A number of seconds: positive, or at least `minimum` when one is given."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value < 1e9
    if not ok or (value < minimum if minimum is not None else value <= 0):
        kind = f"number of seconds >= {minimum:g}" if minimum is not None else "positive number of seconds"
        raise ConfigError(f"{where}: {key}: expected a {kind}, got {value!r}")
    return float(value)


# -- the state machine ---------------------------------------------------------------


def _process(member: MemberRecord) -> list:
    """Which process a member record belongs to: [pid, registered_at]."""
    return [member.pid, member.registered_at]


@dataclass(frozen=True)
class MemberView:
    """The workers as one decision sees them, relative to the current layout."""

    available: frozenset[int]  # members without a notice that can hold a slot now
    leaving: frozenset[int]  # in the layout, under a notice whose deadline has not passed
    lost: frozenset[int]  # in the layout, and neither available nor leaving
    restarted: frozenset[int]  # in the layout, but their member key belongs to a new process
    broken: frozenset[int]  # in the layout and available, but the layout's WORLD broke under them
    state_kept: bool  # every broken worker holds its state of the layout (not an older one's, not none)
    placement: Placement  # the instances of the members (and of the layout's lost workers)
    notices: dict[int, NoticeRecord]  # of the members
    noticed: frozenset[int]  # members under a notice whose deadline has not passed


@dataclass
class FirstSeen:
    """When the coordinator first saw a condition in a generation: it waits on one a
    bounded time (STUCK_LEASES lease periods), counted afresh in each generation."""

    generation: int = -1  # none yet
    at: float = 0.0  # monotonic

    def seconds(self, generation: int) -> float:
        """Seconds since first seen in `generation`; the first call of a generation starts at 0."""
        if generation != self.generation:
            self.generation, self.at = generation, time.monotonic()
        return time.monotonic() - self.at


@dataclass
class Attempts:
    """How many plans in a row started from one source (the generation whose kept state or
    snapshots they start from): a failure that recurs must not loop."""

    source: int = 0
    times: int = 0

    def of(self, source: int) -> int:
        return self.times if source == self.source else 0

    def count(self, source: int) -> None:
        self.source, self.times = source, self.of(source) + 1


class Coordinator:
    """Leader election, then reconcile on every membership change and interval boundary.

    `serve()` blocks until `stop()`; use one instance per process. Decisions go through
    one `LiveputOptimizer` kept for the coordinator's life (it caches plans and costs).
    """

    def __init__(self, store: JobStore, config: CoordinatorConfig, optimizer: LiveputOptimizer, candidate: str,
                 events: EventWriter | None = None, scalars: ScalarBackend | None = None,
                 provisioning: Provisioning | None = None) -> None:
        self._store = store
        self._events = events or EventWriter(None)  # each published plan, for programs (--events)
        self._scalars = scalars  # each interval's availability, forecast and liveput, for dashboards
        self._liveput: float | None = None  # samples/s the newest decision expects over the lookahead
        self._client: EtcdClient = store.client
        self._config = config
        self._optimizer = optimizer
        self._learner = ThroughputLearner(optimizer.throughput)
        self._throughput = optimizer.throughput  # the profile, or what was learned of it
        self._models: frozenset[ModelShape] = frozenset()  # the members' models it plans for
        self._unbuildable = ""  # why no layout can train them, while none can
        self._reported: dict[int, tuple[int, int]] = {}  # worker -> (generation, iteration) last learned from
        self._learned_intervals: dict[tuple[int, int, int], int] = {}  # (T, P, D) -> boundaries with reports
        self._phase_rates: PhaseRates = {}  # the cost model's, fitted on the changes' measured phases
        self._changes_reported = threading.Event()  # a change report was written since the last read
        # The reported changes fitted on, by generation; None: none read since leadership was won.
        self._changes: dict[int, tuple[MigrationPlan, ChangeReport]] | None = None
        self._interval = optimizer.interval
        self._network: NetworkRecord | None = None  # as the workers measured it, once they have
        # A layer profile was measured on one model (a throughput table names one only).
        self._profile = ProfileRecord(config.profile.name, optimizer.costs.shape.to_dict()) \
            if config.profile.suffix.lower() == ".json" else None
        self._leadership = Leadership(store.client, store.keys.job, candidate, config.lease_seconds)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._resumed = False
        self._last_warning = ""
        # Loaded from etcd by _resume() each time leadership is won; made here once so
        # that its imports are paid before a takeover, not during one.
        self._forecaster: Forecaster = make_forecaster(config.forecaster, self._interval)
        self._rates: ForecastRates | None = make_rates(config.rates, self._interval)
        self._forecast: AvailabilityForecast | None = None
        self._history: deque[list[int]] = deque(maxlen=HISTORY_KEPT)
        self._boundary_at = 0.0
        self._previous: set[int] | None = None
        self._seen: set[int] = set()
        self._admitted: dict[int, list] = {}
        self._instance_of: dict[int, str] = {}  # every worker's instance, as its member record said
        self._domain_of: dict[int, str] = {}  # the failure domain of every worker whose record named one
        self._decisions: deque[dict] = deque(maxlen=DECISIONS_KEPT)
        self._busy_until = 0.0  # monotonic time the last migration is expected to end
        self._broken_seen = FirstSeen()  # a worker said the generation's WORLD broke
        self._loss_in_change = FirstSeen()  # a worker was lost while the change to the generation is applied
        self._stuck: tuple[int, frozenset[int]] = (0, frozenset())  # the workers last counted lost for not reporting
        self._retried = Attempts()  # changes retried from a generation's kept state
        self._rolled_back = Attempts()  # rollbacks to a generation's snapshots
        self._noticed_at: dict[int, float] = {}  # monotonic time each leaving worker was first seen leaving
        self._batch_until = 0.0  # monotonic time the newest batch of notices is answered
        grace = optimizer.costs.constants.grace_period_seconds
        self._batch_seconds = min(NOTICE_BATCH_SECONDS, grace / 10)  # a small part of the grace period
        self._cost = None if not config.pools else CostMeter(
            Pricing(config.pools, config.deadline, config.budget), store, self._leadership.guard, self._events, scalars,
            None if provisioning is None else provisioning.pool_of)
        self._provisioning = provisioning if self._cost is not None else None  # on-demand instances, by deadline

    @property
    def is_leader(self) -> bool:
        return self._leadership.is_leader

    def stop(self) -> None:
        """Ask `serve()` to return (from another thread, or a signal handler while `serve()`
        runs on another thread)."""
        self._stopping.set()
        self._wake.set()

    def serve(self) -> None:
        """Campaign for leadership, lead while it lasts, campaign again if it is lost."""
        keys = self._store.keys
        watches = [self._client.watch(prefix, lambda events: self._wake.set(), prefix=True)
                   for prefix in (keys.members, keys.notices, keys.done)]
        watches.append(self._client.watch(keys.changes, lambda events: self._change_reported(), prefix=True))
        try:
            with self._leadership:
                while not self._stopping.is_set():
                    holder = self._leader_name()
                    if holder:
                        log.info("waiting for leadership of job %s: %s holds it", keys.job, holder)
                    if not self._leadership.wait_until_leader(self._stopping):
                        break
                    log.info("%s leads job %s", self._leadership.candidate, keys.job)
                    self._lead()
        finally:
            for watch in watches:
                watch.stop()

    def _change_reported(self) -> None:
        self._changes_reported.set()
        self._wake.set()

    def _leader_name(self) -> str:
        try:
            leader = self._store.leader()
        except (EtcdError, SchemaError):
            return ""
        return "" if leader is None else f"{leader.candidate} (pid {leader.pid})"

    def _lead(self) -> None:
        """Reconcile when woken, at a batch's end or an interval boundary, and at least
        every third of a lease period. After each reconcile rest as long as it took (up to
        MAX_REST_SECONDS): each one reads every member, and while a thousand workers
        register or acknowledge a plan, back-to-back reconciles would take a whole core
        from the etcd and workers beside the coordinator; a decision waits at most that long."""
        self._resumed = False
        while not self._stopping.is_set() and self._leadership.is_leader:
            self._wake.clear()
            started = time.monotonic()
            try:
                if not self._resumed:
                    self._resume()
                self._reconcile()
            except NotLeader as exc:
                log.warning("leadership lost: %s", exc)
                return
            except SchemaError as exc:
                self._warn_once(f"cannot decide: {exc}; waiting for a change")
            except EtcdError as exc:
                self._client.check_reachable()
                log.warning("etcd: %s; retrying", exc)
                self._stopping.wait(1.0)
                continue
            self._stopping.wait(min(time.monotonic() - started, MAX_REST_SECONDS))
            until_boundary = self._boundary_at + self._interval - time.time() if self._resumed else 1.0
            wait = min(until_boundary, self._config.lease_seconds / 3)
            if self._batch_until > time.monotonic():
                wait = min(wait, self._batch_until - time.monotonic())
            self._wake.wait(max(0.05, wait))
        if not self._stopping.is_set():
            log.warning("%s no longer holds the leader lease", self._leadership.candidate)

    def _warn_once(self, message: str) -> None:
        if message != self._last_warning:
            log.warning("%s", message)
            self._last_warning = message

    # -- state kept in etcd --------------------------------------------------------

    def _resume(self) -> None:
        """Say which model the profile describes; load the availability history and admitted
        workers; rebuild the forecaster."""
        try:
            state = self._store.coordinator_state()
        except SchemaError as exc:
            log.error("%s; starting a new availability history", exc)
            state = None
        self._store.publish_profile(self._profile, self._leadership.guard())
        if self._cost is not None:
            self._cost.resume()
        if self._provisioning is not None:
            self._provisioning.resume_from(self._store)
        self._forecaster = make_forecaster(self._config.forecaster, self._interval)
        self._rates = make_rates(self._config.rates, self._interval)
        self._history.clear()
        self._forecast = None
        self._previous, self._seen = None, set()
        self._boundary_at = time.time()
        if state is not None and state.interval_seconds == self._interval:
            for row in state.history:
                self._observe(row)
            self._boundary_at = state.boundary_at
            self._previous, self._seen = set(state.previous), set(state.seen)
            self._forecast = self._make_forecast()
        elif state is not None:
            log.warning("the saved availability history has %g s intervals, this coordinator %g s: starting a new one",
                        state.interval_seconds, self._interval)
        self._admitted = {int(w): p for w, p in state.admitted.items()} if state is not None else {}
        self._decisions = deque(state.decisions if state is not None else (), maxlen=DECISIONS_KEPT)
        self._busy_until = 0.0
        self._changes = None
        self._changes_reported.set()
        self._resumed = True
        log.info("resumed with %d intervals of availability history and generation %d",
                 len(self._history), self._store.current_generation())

    def _save(self) -> None:
        state = CoordinatorState(
            self._interval, self._boundary_at, list(self._history), sorted(self._previous or ()), sorted(self._seen),
            {str(w): p for w, p in sorted(self._admitted.items())}, list(self._decisions),
            None if self._forecast is None else self._forecast.to_dict(),
        )
        if not self._store.save_coordinator_state(state, self._leadership.guard()):
            raise NotLeader(f"{self._leadership.candidate} lost the leader lease while saving its state")

    # -- forecasting ---------------------------------------------------------------

    def _observe(self, row: list[int]) -> None:
        self._history.append(row)
        self._forecaster.observe(*row)

    def _make_forecast(self) -> AvailabilityForecast | None:
        """The forecast of the intervals after the coming one (None: assume no change), its
        expected events the rate model's when the config names one (the last row of the
        history starts at the boundary just passed)."""
        if not self._history or self._optimizer.horizon < 2:
            return None
        forecast = self._forecaster.forecast(self._optimizer.horizon - 1)
        return forecast if self._rates is None else self._rates.apply(forecast, self._history, self._boundary_at)

    def _instances(self, workers: set[int] | frozenset[int]) -> int:
        """How many instances `workers` run on: what forecasts count."""
        if self._config.gpus_per_instance == 1:
            return len(workers)
        return len({self._instance_of.get(w, w) for w in workers})  # an unknown worker: its own

    def _close_intervals(self, available: frozenset[int], now: float) -> bool:
        """Record every interval that ended by `now`; True if any did.

        Intervals missed while no coordinator ran get the count seen now and no events
        (the first of them takes the events seen), so the history stays one row per interval.
        """
        if self._previous is None:
            self._previous, self._seen = set(available), set(available)
            return False
        self._seen |= available
        elapsed = math.floor((now - self._boundary_at) / self._interval)
        if elapsed < 1:
            return False
        count = self._instances(available)
        self._observe([count, self._instances(self._seen - available), self._instances(self._seen - self._previous)])
        for _ in range(min(elapsed - 1, HISTORY_KEPT)):
            self._observe([count, 0, 0])
        self._boundary_at += elapsed * self._interval
        self._previous, self._seen = set(available), set(available)
        self._forecast = self._make_forecast()
        return True

    # -- deciding ------------------------------------------------------------------

    def _view(self, generation: int, current: Layout | None, members: dict[int, MemberRecord],
              now: float) -> MemberView:
        notices = {w: n for w, n in self._store.notices().items() if w in members}
        in_layout = current.workers if current is not None else frozenset()
        restarted = frozenset(w for w in in_layout & frozenset(members)
                              if w in self._admitted and self._admitted[w] != _process(members[w]))
        placement = self._placement(members, in_layout)
        expired = self._expired(notices, placement, now)
        noticed, unplaced = frozenset(notices), frozenset()
        if placement.gpus_per_instance > 1:  # a notice, or a loss, concerns the whole instance
            going = {placement.instance(w) for w in noticed}
            going |= {placement.instance(w) for w in in_layout - frozenset(members)}
            gone = {placement.instance(w) for w in expired}
            warned = {placement.instance(w) for w in notices}  # the others go with a lost worker
            noticed = frozenset(w for w in members if placement.instance(w) in going)
            expired = frozenset(w for w in noticed
                                if placement.instance(w) in gone or placement.instance(w) not in warned)
            unplaced = frozenset(members) - frozenset(placement.instance_of)
            unplaced |= self._arriving(members, placement, in_layout, now)
        available = frozenset(members) - noticed - restarted - unplaced
        leaving = (noticed - expired - restarted) & in_layout
        broken = frozenset(w for w in in_layout & available if members[w].broken == generation)
        return MemberView(available, leaving, in_layout - available - leaving, restarted, broken,
                          all(members[w].kept_state_of() == generation for w in broken), placement, notices,
                          noticed - expired - restarted)

    def _expired(self, notices: dict[int, NoticeRecord], placement: Placement, now: float) -> frozenset[int]:
        """Noticed workers that can no longer send state: the deadline passed and their
        instance has not trained since. One still training past it (its instance outlived
        the notice, while this coordinator was away or slow to act) still hands over."""
        overdue = {w: n.deadline for w, n in notices.items() if n.deadline <= now}
        if not overdue:
            return frozenset()
        trained_at: dict[str, float] = {}
        for worker, report in self._store.step_reports().items():
            instance = placement.instance(worker)
            trained_at[instance] = max(trained_at.get(instance, 0.0), report.reported_at)
        return frozenset(w for w, deadline in overdue.items() if trained_at.get(placement.instance(w), 0.0) <= deadline)

    def _arriving(self, members: dict[int, MemberRecord], placement: Placement, in_layout: frozenset[int],
                  now: float) -> frozenset[int]:
        """Workers of a new instance whose other workers are still starting: the instance
        joins whole, unless some never come (one lease period after the last arrived)."""
        waiting = set()
        for workers in placement.instances(frozenset(members) - in_layout).values():
            if len(workers) < placement.gpus_per_instance \
                    and now - max(members[w].registered_at for w in workers) < self._config.lease_seconds:
                waiting.update(workers)
        return frozenset(waiting)

    def _placement(self, members: dict[int, MemberRecord], in_layout: frozenset[int]) -> Placement:
        """Where members run, and in which failure domains; lost workers of the layout keep
        the instance and domain they had. An instance reporting more workers than it has
        GPUs places only its first ones, and is in the domain its first named worker says."""
        g = self._config.gpus_per_instance
        for worker, member in members.items():
            if member.failure_domain is not None:
                self._domain_of[worker] = member.failure_domain
        if g == 1:
            domains = {w: self._domain_of[w] for w in (frozenset(members) | in_layout) & self._domain_of.keys()}
            return Placement(1, {}, domains) if domains else ONE_GPU
        for worker, member in members.items():
            self._instance_of[worker] = member.instance
        placed: dict[int, str] = {}
        counts: dict[str, int] = {}
        # A lost worker whose instance this coordinator never saw stays its own instance.
        for worker in sorted((frozenset(members) | in_layout) & self._instance_of.keys()):
            instance = self._instance_of[worker]
            if counts.get(instance, 0) < g:
                counts[instance] = counts.get(instance, 0) + 1
                placed[worker] = instance
            else:
                self._warn_once(f"instance {instance} runs more than {g} workers (gpus-per-instance); "
                                f"worker {worker} is not placed")
        domain_of_instance: dict[str, str] = {}
        for worker in sorted(placed.keys() & self._domain_of.keys()):
            domain = domain_of_instance.setdefault(placed[worker], self._domain_of[worker])
            if domain != self._domain_of[worker]:
                self._warn_once(f"the workers of instance {placed[worker]} name failure domains {domain} and "
                                f"{self._domain_of[worker]}; it is taken to be in {domain}")
        return Placement(g, placed, {w: domain_of_instance[i] for w, i in placed.items() if i in domain_of_instance})

    def _reconcile(self) -> None:
        """Read the job's state once and publish the next generation if it must change."""
        done = self._store.done()
        if done is not None:
            log.info("training ended at iteration %d (%d samples); the coordinator exits",
                     done.iteration, done.consumed_samples)
            self.stop()
            return
        now = time.time()
        generation = self._store.current_generation()
        envelope = self._store.plan(generation) if generation else None
        if generation and envelope is None:
            raise SchemaError(self._store.keys.plan(generation), "the current generation has no plan")
        layout = None if envelope is None else Layout.from_dict(envelope.layout)
        saved = envelope is not None and envelope.action == SAVE_AND_EXIT
        current = None if saved else layout  # after a save-and-exit nothing runs: the next layout resumes
        members, left_out = one_implementation(self._store.members(),
                                               frozenset() if current is None else current.workers)
        if left_out:
            self._warn_once(left_out)
        view = self._view(generation, current, members, now)
        boundary = self._close_intervals(view.available, now)
        if boundary and self._scalars is not None:
            self._chart()
        if self._cost is not None:
            self._cost.count(members, now, boundary)
        if boundary and self._provisioning is not None:
            self._provisioning.at_boundary(now, {w: members[w] for w in view.available}, self._cost, self._optimizer,
                                           self._config.gpus_per_instance, self._store, self._leadership.guard)
        if boundary and current is not None:
            self._learn(generation, current)
        self._refit(members)
        self._use_network()
        batching = self._batching(view)
        if not self._plans_for(members):
            pass  # warned; a change of members may bring a model it can train
        elif current is None and len(view.available) < self._config.min_workers:
            self._warn_once(f"waiting for {self._config.min_workers} workers before "
                            f"{'resuming from the checkpoint' if saved else 'the first plan'} "
                            f"({len(view.available)} registered)")
        elif saved:
            if not self._saving(generation, layout, members):
                decision = self._decide(None, view.available, self._forecast, placement=view.placement)
                if decision.layout is None:
                    self._warn_once(f"no feasible layout for {len(view.available)} available workers; waiting")
                else:
                    reason = (f"resume from the checkpoint of generation {generation} on "
                              f"{len(decision.layout.workers)} of {len(view.available)} workers")
                    self._publish(generation + 1, decision.layout, None, decision.cost.seconds, "restart", reason,
                                  view, members)
                    return
        elif current is not None and view.broken:
            # Live workers that have not failed yet soon will (their next collective has a
            # failed peer); one that never does is dead, and its lease ends. One whose lease
            # lives on but that stays blocked (a synchronous save's collectives wait
            # SAVE_TIMEOUT for a peer killed mid-save) counts as lost after STUCK_LEASES
            # lease periods, until it reports.
            waiting = (current.workers & view.available) - view.broken
            silent = self._broken_seen.seconds(generation)
            if waiting and silent > STUCK_LEASES * self._config.lease_seconds:
                if self._stuck != (generation, waiting):
                    self._stuck = (generation, waiting)
                    log.warning("workers %s have not reported the broken WORLD of generation %d for %.0f s: "
                                "counting them as lost", _ids(waiting), generation, silent)
                view = dataclasses.replace(view, available=view.available - waiting, lost=view.lost | waiting)
                waiting = frozenset()
            if not waiting:
                decision = self._recovery(generation, current, view, members)
                if decision.layout is None:
                    self._warn_once(f"no feasible layout for {len(view.available)} available workers; waiting")
                else:
                    self._publish_decision(generation + 1, decision, current, view, members)
                    return
        else:
            forced = current is not None and bool(view.lost or view.leaving)
            settled = current is None or all(members[w].generation >= generation
                                             for w in current.workers & view.available)
            # A change the membership forces waits only for the rest of a batch of notices.
            if not batching if forced else settled:
                busy = 0.0 if settled else max(0.0, self._busy_until - time.monotonic())
                decision = self._decide(current, view.available, self._forecast, view.leaving, busy,
                                        placement=view.placement)
                if decision.layout is None and forced and self._can_save_and_exit(current, view, members):
                    reason = (f"{self._reason(current, current, view)}; no layout for the {len(view.available)} "
                              "workers left: save a checkpoint and exit")
                    seconds = self._optimizer.costs.constants.checkpoint_save_load_seconds
                    self._publish(generation + 1, current, None, seconds, SAVE_AND_EXIT, reason, view, members,
                                  SAVE_AND_EXIT)
                    return
                restart = bool(view.lost) and decision.layout is not None and decision.plan is None
                if restart:
                    decision = self._from_copies(view) or decision  # state lost: restart only if it must
                if view.lost and not settled and self._awaits_change(generation, view):
                    pass  # the change's workers report it broken with the state they kept (_retry)
                elif decision.layout is None:
                    self._warn_once(f"no feasible layout for {len(view.available)} available workers; waiting"
                                    f"{self._unsaved(current, view, members)}")
                elif decision.layout != current:
                    self._publish_decision(generation + 1, decision, current, view, members)
                    return
        if boundary:
            self._save()

    def _awaits_change(self, generation: int, view: MemberView) -> bool:
        """Whether to hold back a plan for workers lost while the change to `generation` is
        applied: its live workers, whose next collective fails (within a lease period) or
        who see at its rendezvous that a peer is no longer a member (within a third of a
        lease period), report it broken with the state they brought into it, from which
        `_retry` plans the change again. A plan from the new layout before that would
        assume state its workers may never have had. STUCK_LEASES lease periods at most."""
        if self._loss_in_change.generation != generation:
            log.info("workers %s were lost while the change to generation %d is applied: waiting for its workers "
                     "to report it broken", _ids(view.lost), generation)
        return self._loss_in_change.seconds(generation) <= STUCK_LEASES * self._config.lease_seconds

    def _plans_for(self, members: dict[int, MemberRecord]) -> bool:
        """Keep the optimizer to the layouts every member's model can be built in; False
        (warned) while there is none."""
        models: dict[ModelShape, set[int]] = {}
        for worker, member in sorted(members.items()):
            shape = member.shape()
            if shape is not None:
                models.setdefault(shape, set()).add(worker)
        if frozenset(models) != self._models:
            self._models = frozenset(models)
            if len(models) > 1:
                log.error("workers train different models: %s; planning only layouts each of them can be built in",
                          _differences(models))
            self._rebuild()
        if self._unbuildable:
            self._warn_once(self._unbuildable)
        return not self._unbuildable

    def _rebuild(self) -> None:
        """A new optimizer on what is known of throughput and migration costs, for the
        members' models."""
        try:
            self._optimizer = self._config.optimizer(ForModels(self._throughput, self._models), self._phase_rates,
                                                     self._network)
            self._unbuildable = ""
        except ProfileError as exc:
            self._unbuildable = f"{exc}; waiting for workers of a model it can train"

    def _decide(self, *args, **kwargs) -> Decision:
        """The optimizer's decision; its expected liveput is kept for the interval's scalars."""
        decision = self._optimizer.decide(*args, **kwargs)
        if decision.layout is not None:
            self._liveput = decision.horizon_samples / (self._optimizer.horizon * self._interval)
        return decision

    def _chart(self) -> None:
        """An interval ended: its available instances, the forecast of the intervals after
        the coming one and the newest decision's liveput, at the job's iteration (the step
        the workers' scalars use)."""
        progress = self._store.progress()
        scalars = {"parcae/available-instances": float(self._history[-1][0])}
        if self._forecast is not None:
            scalars["parcae/forecast-instances"] = float(self._forecast.expected[0])
        if self._liveput is not None:
            scalars["parcae/liveput-samples-per-second"] = self._liveput
        self._scalars.add_scalars(scalars, 0 if progress is None else progress.iteration)

    def _learn(self, generation: int, current: Layout) -> None:
        """Feed the running layout's new step reports to the learner; re-plan with what it
        learned once a price has moved (liveput/learned.py)."""
        layout = current.parallelism
        fresh = 0
        for worker, report in self._store.step_reports().items():
            seen = (report.generation, report.iteration)
            if worker in current.workers and report.generation == generation \
                    and seen > self._reported.get(worker, (0, -1)):
                self._reported[worker] = seen
                self._learner.observe(layout, report.seconds)
                fresh += 1
        estimate = next((e for e in self._learner.estimates() if e.layout == layout), None)
        if not fresh or estimate is None:  # none new, or a layout the profile cannot run
            return
        key = (layout.tp, layout.pp, layout.dp)
        self._learned_intervals[key] = self._learned_intervals.get(key, 0) + 1
        learned = self._learner.replan()
        if learned is not None:
            self._throughput = learned
            self._rebuild()
        self._events.write(ThroughputLearned(generation, *key, self._learned_intervals[key], estimate.reports,
                                             self._learner.model().iteration_seconds(layout),
                                             estimate.prior_seconds))

    def _refit(self, members: dict[int, MemberRecord]) -> None:
        """Once a change is reported: fit the migration cost model on the phases the kept
        changes took and re-plan with it. A change is left out when its WORLD broke (a
        member says so) or its plan is gone. Each change reported since the last read
        gets a MigrationCostLearned event (on resuming, the reports found were the
        previous leader's to announce)."""
        if not self._changes_reported.is_set():
            return
        self._changes_reported.clear()
        known = self._changes or {}
        broken = {member.broken for member in members.values()}
        changes: dict[int, tuple[MigrationPlan, ChangeReport]] = {}
        try:
            for generation, report in sorted(self._store.change_reports().items()):
                plan = known[generation][0] if generation in known else self._migration(generation)
                if generation not in broken and plan is not None and plan.kind == report.kind:
                    changes[generation] = (plan, report)
        except SchemaError as exc:
            self._warn_once(f"migration costs not fitted: {exc}")
            return
        except EtcdError:
            self._changes_reported.set()  # read again once etcd answers
            raise
        fresh = [] if self._changes is None else sorted(changes.keys() - known.keys())
        self._changes = changes
        costs = self._optimizer.costs
        prior = MigrationCostModel(costs.constants, costs.shape)
        fitted = prior.fitted([(plan, report.phases) for plan, report in changes.values()])
        for generation in fresh:
            plan, report = changes[generation]
            measured, predicted = sum(report.phases.values()), _phases_seconds(costs, plan, report)
            log.info("generation %d: the %s change took %.3f s, %.3f s predicted; migration costs fitted on %d "
                     "changes", generation, report.kind, measured, predicted, len(changes))
            self._events.write(MigrationCostLearned(generation, report.kind, len(changes), measured, predicted,
                                                    _phases_seconds(fitted, plan, report),
                                                    _phases_seconds(prior, plan, report)))
        if fitted.phase_rates != self._phase_rates:
            self._phase_rates = fitted.phase_rates
            self._rebuild()

    def _use_network(self) -> None:
        """Once the workers have measured the network between two instances (the first
        layout built on two does, training/network.py), plan with it: the profile's link
        becomes it (the step reports kept correct the new prior as they did the old) and
        so do the cost constants' messages between instances."""
        if self._network is not None:
            return
        try:
            record = self._store.network()
        except SchemaError as exc:
            self._warn_once(f"the network stays as assumed: {exc}")
            return
        if record is None:
            return
        before = self._optimizer
        self._network = record
        self._throughput = self._learner.reprice(self._learner.prior.with_link(record.bytes_per_second))
        self._rebuild()
        link, prior_link = self._optimizer.throughput.link_bytes_per_second, before.throughput.link_bytes_per_second
        transfer, prior_transfer = _sending_rate(self._optimizer.costs), _sending_rate(before.costs)
        shown = "as the throughput table measured it" if link is None else \
            f"at {link:.3g} bytes/s (the profile's: {prior_link:.3g})"
        log.info("network between instances %s and %s, measured by generation %d: %.3g bytes/s, %.3g s latency; "
                 "pipeline and data-parallel traffic now %s, state between instances at %.3g bytes/s (the cost "
                 "constants': %.3g)", record.instance, record.peer_instance, record.generation,
                 record.bytes_per_second, record.latency_seconds, shown, transfer, prior_transfer)
        self._events.write(NetworkMeasured(record.generation, (record.instance, record.peer_instance),
                                           record.latency_seconds, record.bytes_per_second, link, prior_link,
                                           transfer, prior_transfer))

    def _migration(self, generation: int) -> MigrationPlan | None:
        """The migration the plan of `generation` made; None if it made none or is gone."""
        envelope = self._store.plan(generation)
        return None if envelope is None or envelope.migration is None else MigrationPlan.from_dict(envelope.migration)

    def _batching(self, view: MemberView) -> bool:
        """Whether a worker's instance got its notice too recently to act: the rest of its
        batch of notices may be on its way. The wait counts from when the notice came (by
        the wall clocks deadlines rely on already), not from when this coordinator saw it:
        seeing it takes a reconcile, a long one with a thousand workers. A worker leaving
        without a notice on its instance counts from when it was first seen leaving."""
        clock = time.monotonic()
        came: dict[str, float] = {}  # by instance, on this clock
        if view.leaving - self._noticed_at.keys():
            now = time.time()
            for worker, notice in view.notices.items():
                instance = view.placement.instance(worker)
                came[instance] = min(came.get(instance, clock), clock - max(0.0, now - notice.received_at))
        self._noticed_at = {w: self._noticed_at.get(w, came.get(view.placement.instance(w), clock))
                            for w in view.leaving}
        self._batch_until = max(self._noticed_at.values(), default=0.0) + self._batch_seconds
        return clock < self._batch_until

    @staticmethod
    def _can_save_and_exit(current: Layout, view: MemberView, members: dict[int, MemberRecord]) -> bool:
        """Whether the layout's workers can write a checkpoint before they go: some are
        leaving, none is lost or broken (the save is collective over their WORLD), and
        every one writes checkpoints."""
        return bool(view.leaving) and not view.lost and not view.broken \
            and all(members[w].can_save for w in current.workers)

    @staticmethod
    def _unsaved(current: Layout | None, view: MemberView, members: dict[int, MemberRecord]) -> str:
        """For the warning: the leaving workers of the layout that cannot save and exit."""
        if current is None or not view.leaving:
            return ""
        unable = frozenset(w for w in current.workers & frozenset(members) if not members[w].can_save)
        return f" (workers {_ids(unable)} run without --save: the job cannot save and exit)" if unable else ""

    def _saving(self, generation: int, layout: Layout, members: dict[int, MemberRecord]) -> bool:
        """Whether a worker of the save-and-exit plan of `generation` may still be writing
        the checkpoint: the process admitted to it is registered and has not acknowledged it."""
        return any(self._admitted.get(w) == _process(members[w]) and members[w].generation < generation
                   for w in layout.workers & frozenset(members))

    def _recovery(self, generation: int, current: Layout, view: MemberView,
                  members: dict[int, MemberRecord]) -> Decision:
        """The plan after the current layout's WORLD broke (every live worker of it reported):
        from the state the workers kept (of the current layout, or of the one its change
        started from), else from their snapshots, else from the last checkpoint."""
        if view.state_kept:
            decision = self._in_place(current, view, view.leaving)
            if decision.plan is not None or decision.layout is None:
                return decision
        return self._retry(generation, view, members) or self._from_copies(view) \
            or self._decide(None, view.available, self._forecast, placement=view.placement)

    def _in_place(self, layout: Layout, view: MemberView, leaving: frozenset[int]) -> Decision:
        """The optimizer's decision from `layout`, whose state its live workers hold after its
        WORLD broke: `layout` itself, re-formed, where it stays."""
        decision = self._decide(layout, view.available, self._forecast, leaving, placement=view.placement)
        return self._optimizer.rebuild(layout) if decision.layout == layout else decision

    def _retry(self, generation: int, view: MemberView, members: dict[int, MemberRecord]) -> Decision | None:
        """After the change of `generation` broke mid-way: the change planned again, without
        the lost workers, from the layout it started from, whose state its workers kept. A
        worker of that layout that kept none of it is left out of this plan like a lost one
        (its slots refilled from replicas); it may join a later one. None when they kept
        none (or of several layouts), a left-out one's state is not held by another, or
        changes from that state broke MAX_RETRIES times already (a failure that recurs
        would loop)."""
        kept = {members[w].kept_state_of() for w in view.broken} - {0}
        if len(kept) != 1 or generation in kept:
            return None
        source = kept.pop()
        times = self._retried.of(source)
        if times >= MAX_RETRIES:
            log.warning("the change from generation %d's state broke %d times after retries: not retried again",
                        source, times + 1)
            return None
        envelope = self._store.plan(source)
        if envelope is None or envelope.action != TRAIN:
            return None
        layout = Layout.from_dict(envelope.layout)
        holders = frozenset(w for w in layout.workers & frozenset(members)
                            if members[w].broken == generation and members[w].kept_state_of() == source)
        emptied = (layout.workers & view.available) - holders
        decision = self._in_place(layout, dataclasses.replace(view, available=view.available - emptied),
                                  view.noticed & holders)
        if decision.plan is None:
            return None
        self._retried.count(source)
        return decision

    def _from_copies(self, view: MemberView) -> Decision | None:
        """A plan that rolls the workers back to their newest snapshots (reconfig/copies.py)
        and fills the lost ones' slots from their buddies' copies; None when the workers
        keep none (the progress record names their generation), they cannot make up for
        what was lost (a worker and its buddy both gone), or rollbacks to these snapshots
        broke MAX_RETRIES times after the first (a worker lost while the snapshots were
        being replaced leaves none whole, and the record can be a step behind)."""
        progress = self._store.progress()
        envelope = None if progress is None or not progress.copies else self._store.plan(progress.copies)
        holders = {} if envelope is None or envelope.action != TRAIN else envelope.holders()
        if not holders:
            return None
        times = self._rolled_back.of(envelope.generation)
        if times > MAX_RETRIES:
            self._warn_once(f"rolling back to generation {envelope.generation}'s snapshots broke {times} times: "
                            "not tried again")
            return None
        layout = Layout.from_dict(envelope.layout)
        decision = self._decide(layout, view.available, self._forecast, view.noticed & layout.workers,
                                placement=view.placement, copies=Copies(envelope.generation, holders))
        return decision if decision.plan is not None else None

    def _publish_decision(self, generation: int, decision: Decision, current: Layout | None, view: MemberView,
                          members: dict[int, MemberRecord]) -> None:
        """Publish the optimizer's layout, reached by its migration or from a checkpoint."""
        assert decision.layout is not None
        kind = "start" if current is None else "restart" if decision.plan is None else decision.plan.kind
        self._publish(generation, decision.layout, decision.plan, decision.cost.seconds, kind,
                      self._reason(current, decision.layout, view, decision.plan), view, members)

    def _publish(self, generation: int, layout: Layout, plan: MigrationPlan | None, seconds: float, kind: str,
                 reason: str, view: MemberView, members: dict[int, MemberRecord], action: str = TRAIN) -> None:
        holders = copy_holders(layout, view.placement)
        envelope = PlanEnvelope(generation, time.time(), layout.to_dict(), None if plan is None else plan.to_dict(),
                                action, [holders.get(w) for w in layout.slots] if holders else None)
        if not self._store.publish_plan(envelope, self._leadership.guard()):
            log.warning("generation %d was not published: the generation or the leader changed; re-reading", generation)
            self._wake.set()
            return
        p = layout.parallelism
        log.info("generation %d published: T=%d P=%d D=%d on workers %s, standby %s; %s, %.2f s expected; %s",
                 generation, p.tp, p.pp, p.dp, list(layout.slots), sorted(view.available - layout.workers), kind,
                 seconds, reason)
        self._last_warning = ""
        self._busy_until = time.monotonic() + seconds
        if plan is not None and plan.request.copies is not None:  # counted once published, not once decided
            self._rolled_back.count(plan.request.copies.generation)
        self._admitted = {w: _process(members[w]) for w in layout.workers}
        self._decisions.append({"generation": generation, "at": envelope.created_at, "reason": reason, "kind": kind,
                                "seconds": round(float(seconds), 6)})
        self._events.write(PlanPublished(generation, kind, p.tp, p.pp, p.dp, tuple(layout.slots), float(seconds),
                                         reason, tuple(sorted(view.lost)), tuple(sorted(view.broken)),
                                         tuple(view.placement.instance(w) for w in layout.slots),
                                         _recovery_path(plan, kind) if view.lost or view.broken else "",
                                         time=envelope.created_at))
        self._save()
        for worker in sorted((view.lost & frozenset(members)) - view.restarted):
            if self._store.fence_member(worker):
                log.info("fenced worker %d: dropped from the layout as lost while still registered", worker)

    @staticmethod
    def _reason(current: Layout | None, layout: Layout, view: MemberView, plan: MigrationPlan | None = None) -> str:
        if current is None:
            return f"start on {len(layout.workers)} of {len(view.available)} workers"
        parts = []
        if view.broken:
            # A plan after a break mid-change that moves live workers' state is a retry (_retry).
            retried = plan is not None and plan.request.copies is None
            mid = "" if view.state_kept else \
                ", mid-change: retried from the state the workers kept" if retried else ", some mid-change"
            parts.append(f"WORLD broke under workers {_ids(view.broken)}{mid}")
        if view.leaving:
            parts.append(f"notice from workers {_ids(view.leaving)}")
        if view.lost:
            parts.append(f"lost workers {_ids(view.lost)}")
        if layout.workers - current.workers:
            parts.append(f"workers {_ids(layout.workers - current.workers)} join")
        if not parts:
            parts.append("liveput prefers another layout")
        return "; ".join(parts)


def _recovery_path(plan: MigrationPlan | None, kind: str) -> str:
    """Where the state of a plan made after a loss comes from (PlanPublished.RECOVERIES)."""
    if plan is None:
        return "checkpoint" if kind == "restart" else ""
    return "copies" if plan.request.copies is not None else "replicas"


def _phases_seconds(costs: MigrationCostModel, plan: MigrationPlan, report: ChangeReport) -> float:
    """What `costs` predict of the phases of `plan` that `report` measured."""
    predicted = costs.phase_seconds(plan)
    return sum(predicted[phase] for phase in report.phases)


def _sending_rate(costs: MigrationCostModel) -> float:
    """Bytes per second at which `costs` send a GiB between two instances."""
    return 2**30 / costs.constants.transfer_seconds(2**30)


def _ids(workers: frozenset[int], shown: int = 8) -> str:
    """'[1, 2, 3]', or '[1, 2, ... 40 in all]' for many: reasons stay one short line."""
    ordered = sorted(workers)
    if len(ordered) <= shown:
        return str(ordered)
    return f"[{', '.join(map(str, ordered[:shown]))}, ... {len(ordered)} in all]"


def _differences(models: dict[ModelShape, set[int]]) -> str:
    """What sets the models apart, by worker: 'workers [0, 1] num_query_groups=None; ...'."""
    names = [f.name for f in dataclasses.fields(ModelShape) if len({getattr(m, f.name) for m in models}) > 1]
    return "; ".join(f"workers {_ids(frozenset(workers))} " + ", ".join(f"{n}={getattr(m, n)}" for n in names)
                     for m, workers in models.items())


# -- command line --------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser, long_running=True)
    parser.add_argument("--config", required=True, metavar="FILE.yaml",
                        help="profile, model, cost-constants, interval-seconds, lookahead, grace-seconds, "
                             "lease-seconds, max-workers, min-workers, distributed-optimizer, gpus-per-instance, "
                             "forecaster, rates, tensorboard-dir, sudden-share, copy-interval, save-interval, "
                             "pools, deadline, budget, provisioner "
                             "(see CoordinatorConfig)")
    parser.add_argument("--events", default=None, metavar="FILE",
                        help="append each published plan to FILE as a JSON line (megatron_parcae/events.py)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s parcae coordinator: %(levelname)s %(message)s")
    events = EventWriter(args.events)
    try:
        config = CoordinatorConfig.load(args.config)
        optimizer = config.optimizer()
        provisioning = Provisioning.of(config.pools, config.deadline, config.budget, config.provisioner, args.job,
                                       optimizer.interval, config.max_workers // config.gpus_per_instance, events)
        client = connect(args)
    except (ValueError, ProvisionerError) as exc:
        print(f"parcae coordinator: error: {exc}", file=sys.stderr)
        return 2
    except EtcdError as exc:
        print(f"parcae coordinator: error: {exc}", file=sys.stderr)
        return 1
    scalars = None
    if config.tensorboard_dir is not None:
        from megatron_parcae.scalars.tensorboard_backend import TensorBoardBackend

        scalars = TensorBoardBackend(str(config.tensorboard_dir))
    with client, contextlib.closing(scalars) if scalars is not None else contextlib.nullcontext():
        candidate = f"{socket.gethostname()}:{os.getpid()}"
        coordinator = Coordinator(JobStore(client, args.job), config, optimizer, candidate, events, scalars,
                                  provisioning)
        # serve() runs on a thread: a handler runs on the main thread between two bytecodes,
        # and stop() there would deadlock if it interrupted serve() holding the same lock.
        with ThreadPoolExecutor(1, thread_name_prefix="parcae-coordinator") as pool:
            serving = pool.submit(coordinator.serve)
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: coordinator.stop())
            try:
                serving.result()
            except EtcdGone as exc:
                print(f"parcae coordinator: error: {exc}", file=sys.stderr, flush=True)
                return 1
            except MixedImplementations as exc:
                print(f"parcae coordinator: error: {exc}", file=sys.stderr, flush=True)
                return 2
    return 0
