"""The agent: every training process's link to the job's state in etcd.

The training loop must never wait on etcd, so the agent does its network work on
background threads and the loop only reads and writes in-memory state:

    agent = ParcaeAgent(client, job, worker_id, grace_seconds=30, lease_seconds=10)
    agent.start()                          # from the main thread: registers, installs SIGTERM handler
    while training:
        if agent.fenced:                   # lease lost (stalled too long, or fenced by the coordinator)
            break                          # exit without touching the job's state
        plan = agent.pending_plan()        # newest plan newer than what this process runs
        if plan is not None:
            ...apply plan.layout / plan.migration at this iteration boundary...
            agent.acknowledge(plan.generation)
        ...one iteration...
        agent.record_progress(iteration, consumed_samples)  # rank 0: sent when due, answered by the next
        agent.report_step(iteration, seconds, consumed_samples)
    agent.stop()                           # deregisters: the member key disappears at once

SIGTERM (a cloud preemption notice or SLURM preemption) does not stop the process: the
handler records the time and the agent publishes a notice whose deadline is that time
plus `grace_seconds`, so the coordinator can move this process's state away before the
SIGKILL. The training loop can read `notice_received` / `notice_deadline`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import signal
import socket
import threading
import time

from megatron_parcae.control.etcd.client import EtcdClient, EtcdError, KeptLease, StartedTxn, WatchEvent
from megatron_parcae.control.etcd.keys import (
    ChangeReport,
    JobStore,
    MemberRecord,
    NoticeRecord,
    PlanEnvelope,
    ProgressRecord,
    SchemaError,
    StepReport,
)
from megatron_parcae.control.notices import NoticeWatcher
from reconfig.layout import ModelShape

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0  # step reports are averaged and published at most this often (see `report_step`)
PROGRESS_INTERVAL_S = 1.0  # a step's progress record is sent at most this often (see `record_progress`)
REPORTS_PER_SECOND = 200  # step reports a whole job publishes per second, at most about (see `report_step`)
FENCED_EXIT = 3  # the exit code of a training process the job dropped (see `ParcaeAgent.fenced`)


class AgentError(RuntimeError):
    """The agent cannot join the job (the message says why)."""


@dataclasses.dataclass
class _StepWindow:
    """Steps measured since the last published report."""

    seconds: float = 0.0
    count: int = 0
    iteration: int = 0
    consumed_samples: int = 0


class _Doorbell:
    """Wakes the agent thread; unlike `threading.Event.set()`, `ring()` is safe in a signal
    handler. The handler runs on the main thread between two bytecodes, possibly while
    that thread is inside `Event.set()` holding the Event's lock, and taking the lock
    again there deadlocks the process; `SimpleQueue.put` is reentrant."""

    def __init__(self) -> None:
        self._rings: queue.SimpleQueue[None] = queue.SimpleQueue()

    def ring(self) -> None:
        self._rings.put(None)

    def wait(self, timeout: float) -> None:
        """Return at the first ring since the previous wait, or after `timeout` seconds."""
        try:
            self._rings.get(timeout=timeout)
        except queue.Empty:
            return
        while not self._rings.empty():
            self._rings.get_nowait()


def default_instance() -> str:
    """This process's instance name: the host, and the launching torchrun's pid, so that
    each torchrun (one per instance) is one instance even where several share a host;
    a process started without torchrun is an instance of its own."""
    launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    return f"{socket.gethostname()}-{launcher}"


class _PlanFeed:
    """The watch on one job's plans, shared by the agents of a process that use one etcd
    client: it hands each published plan to all of them, so that a process running many
    agents (tests, benchmarks/control_plane.py) holds one watch and decodes each plan
    once, not one of each per agent."""

    _feeds: dict[tuple[int, str], _PlanFeed] = {}  # by (id of the client, job)
    _feeds_lock = threading.Lock()

    def __init__(self, store: JobStore) -> None:
        self._store = store
        self._agents: set[ParcaeAgent] = set()
        self._watch = store.client.watch(store.keys.plans, lambda events: self._deliver(events, self.agents()),
                                         prefix=True)

    @classmethod
    def join(cls, agent: ParcaeAgent) -> _PlanFeed:
        """Hand plans to `agent` from now on, and at once the current one if the agent
        registered before it was published."""
        key = (id(agent._client), agent._store.keys.job)
        with cls._feeds_lock:
            feed = cls._feeds.get(key)
            if feed is None:
                feed = cls._feeds[key] = cls(agent._store)
            feed._agents.add(agent)
        feed._deliver([], [agent])
        return feed

    def leave(self, agent: ParcaeAgent) -> None:
        """Stop handing plans to `agent`; the last agent to leave stops the watch."""
        key = (id(agent._client), agent._store.keys.job)
        with self._feeds_lock:
            self._agents.discard(agent)
            last = not self._agents and self._feeds.get(key) is self
            if last:
                del self._feeds[key]
        if last:
            self._watch.stop()

    def agents(self) -> list[ParcaeAgent]:
        with self._feeds_lock:
            return list(self._agents)

    def _deliver(self, events: list[WatchEvent], agents: list[ParcaeAgent]) -> None:
        """Hand the published plans (in their watch events, so that no agent reads them back;
        with none, as when the watch is (re)established, the current plan) to `agents`."""
        if not agents:
            return
        try:
            if events:
                plans = [self._store.decode_plan(e.key, e.value) for e in events if e.value is not None]
            else:
                generation = self._store.current_generation()
                if generation <= min(agent.generation for agent in agents):
                    return
                plan = self._store.plan(generation)
                if plan is None:
                    raise SchemaError(self._store.keys.plan(generation), "the current generation has no plan")
                plans = [plan]
        except SchemaError as exc:
            for agent in agents:
                agent._refuse(exc)
            return
        except EtcdError as exc:  # the watch calls again once it reconnects
            log.warning("could not read the new plan of job %s: %s", self._store.keys.job, exc)
            return
        for agent in agents:
            agent._offer(plans)


class ParcaeAgent:
    """Membership, preemption notices, plan delivery and step reports of one process.
    `can_save` and `model` go into its member record: the process writes checkpoints
    (--save), and trains that model, so the coordinator plans only layouts it fits.
    `failure_domain` too: its instance may fail with the others of that domain, so the
    coordinator keeps its copies in another (None: not known). `transformer_impl` too: the
    coordinator puts no two implementations in one layout (None: not said)."""

    def __init__(
        self,
        client: EtcdClient,
        job: str,
        worker_id: int,
        grace_seconds: float,
        lease_seconds: float,
        instance: str | None = None,
        local_rank: int = 0,
        notices: NoticeWatcher | None = None,
        can_save: bool = False,
        model: ModelShape | None = None,
        failure_domain: str | None = None,
        transformer_impl: str | None = None,
        pool: str | None = None,
    ) -> None:
        if not grace_seconds >= 0 or not lease_seconds > 0:
            raise ValueError(f"grace_seconds must be >= 0 and lease_seconds > 0, got {grace_seconds}, {lease_seconds}")
        self._client = client
        self._store = JobStore(client, job)
        self.worker_id = worker_id
        self.grace_seconds = grace_seconds
        self.lease_seconds = lease_seconds
        self._member = MemberRecord(worker_id, instance or default_instance(), os.getpid(), time.time(), 0,
                                    local_rank=local_rank, can_save=can_save,
                                    model=None if model is None else model.to_dict(), failure_domain=failure_domain,
                                    transformer_impl=transformer_impl, pool=pool)
        self._member.encode()  # refuse a bad worker id, instance, domain, implementation or pool now, not on a thread
        self._lock = threading.Lock()
        self._wake = _Doorbell()
        self._stopping = threading.Event()
        self._lease: KeptLease | None = None
        self._feed: _PlanFeed | None = None
        self._thread: threading.Thread | None = None
        self._previous_sigterm = None
        self._current = 0  # generation this process runs: applied, or current when it joined
        self._pending: PlanEnvelope | None = None
        self._member_dirty = False
        self._fenced = False
        # Set by the SIGTERM handler or a metadata watcher's thread, as one tuple (an atomic
        # store: the handler may not take locks): (received_at, deadline, reason).
        self._notice: tuple[float, float, str] | None = None
        self._notice_posted = False
        self._progress_sent: tuple[ProgressRecord, StartedTxn] | None = None  # a step's record in flight
        self._progress_held: ProgressRecord | None = None  # a step's record not sent yet (not due)
        self._progress_last: tuple[ProgressRecord, float] | None = None  # the newest sent, and when
        self._notices = notices
        self._steps = _StepWindow()
        self._change: ChangeReport | None = None  # the newest applied change's phases, not yet published
        self._last_report_at = -math.inf
        self._report_interval = REPORT_INTERVAL_S
        self._progress: ProgressRecord | None = None  # the newest one not yet written
        self._progress_lock = threading.Lock()  # records are written one at a time, in order
        self.last_error: str | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Register (waiting up to two lease periods for a dead predecessor's lease to
        expire), then start the background threads and the SIGTERM handler."""
        if self._lease is not None:
            raise AgentError("the agent was already started")
        if threading.current_thread() is not threading.main_thread():
            raise AgentError("ParcaeAgent.start() must run in the main thread (Python installs signal handlers only there)")
        self._lease = KeptLease(self._client, self.lease_seconds, on_lost=self._on_lease_lost)
        try:
            self._current = self._register(self._lease.id)
        except BaseException:
            lease, self._lease = self._lease, None
            try:
                lease.revoke()
            except EtcdError:
                pass  # it expires on its own
            raise
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._notices is not None:
            self._notices.start(lambda n: self.notify(f"{n.source}:{n.action}", n.deadline), self._stopping)
        self._thread = threading.Thread(target=self._run, name=f"parcae-agent {self.worker_id}", daemon=True)
        self._thread.start()
        self._feed = _PlanFeed.join(self)
        log.info("worker %d joined job %s at generation %d", self.worker_id, self._store.keys.job, self._current)

    def _register(self, lease: int) -> int:
        deadline = time.monotonic() + 2 * self.lease_seconds
        while (generation := self._store.register_member(self._member, lease)) is None:
            if time.monotonic() > deadline:
                raise AgentError(
                    f"worker id {self.worker_id} is already registered in job {self._store.keys.job!r} "
                    f"by a live process (key {self._store.keys.member(self.worker_id)}); worker ids must be unique"
                )
            time.sleep(min(0.2, self.lease_seconds / 10))
        return generation

    def stop(self) -> None:
        """Deregister: revoke the lease (member, notice and report keys vanish), stop threads,
        and give SIGTERM back to its previous handler."""
        if self._lease is None:
            return
        if not self._fenced:
            self.progress_written()
        self._stopping.set()
        self._wake.ring()
        if self._thread is not None and self._client.unreachable_seconds == 0:  # else it is stuck in a call
            self._thread.join(timeout=2 * self._client.timeout)
        if self._feed is not None:
            self._feed.leave(self)
        self._lease.revoke()
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # -- what the training loop calls ------------------------------------------------

    def pending_plan(self) -> PlanEnvelope | None:
        """The newest published plan newer than the generation this process runs, if any."""
        with self._lock:
            plan = self._pending
            return plan if plan is not None and plan.generation > self._current else None

    def acknowledge(self, generation: int) -> None:
        """Record that the plan of `generation` was applied; published to etcd in the background.

        The generation may be newer than any this agent's watch has delivered: the
        training loop learns of plans from its peers too.
        """
        with self._lock:
            if generation <= self._current:
                raise AgentError(f"cannot acknowledge generation {generation}: this process already runs {self._current}")
            self._current = generation
            self._member = dataclasses.replace(self._member, generation=generation)
            self._member_dirty = True
        self._wake.ring()

    def report_broken(self, generation: int, state_of: int) -> None:
        """Record that the WORLD of `generation` failed under this process (published in the
        background), and that no plan up to `generation` is pending any more: the
        coordinator answers with a newer one. `state_of`: the generation of the layout
        whose state this process still holds, whole at its last applied step: `generation`
        (it failed while training), an older one (it failed mid-change and kept the state
        it brought into the change), 0 (it holds none)."""
        with self._lock:
            if generation < self._current:
                raise AgentError(f"cannot report generation {generation} broken: this process runs {self._current}")
            self._current = generation
            self._member = dataclasses.replace(self._member, generation=generation, broken=generation,
                                               state_kept=state_of > 0, state_of=state_of)
            self._member_dirty = True
        self._wake.ring()

    def report_step(self, iteration: int, seconds: float, consumed_samples: int) -> None:
        """Record one measured iteration; averaged reports go to etcd every REPORT_INTERVAL_S,
        or less often in a layout of over REPORTS_PER_SECOND workers, and only from local
        rank 0 (an instance's ranks step together): each report is a write that etcd keeps
        until compacted, and a thousand workers reporting every second made most of its
        writes (benchmarks/control_plane.py)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"step time must be a positive number of seconds, got {seconds}")
        if iteration < 0 or consumed_samples < 0:
            raise ValueError(f"iteration and consumed_samples must be >= 0, got {iteration}, {consumed_samples}")
        if self._member.local_rank != 0:
            return
        with self._lock:
            self._steps.seconds += seconds
            self._steps.count += 1
            self._steps.iteration = iteration
            self._steps.consumed_samples = consumed_samples
            due = time.monotonic() - self._last_report_at >= self._report_interval
        if due:
            self._wake.ring()

    def report_change(self, generation: int, kind: str, phases: dict[str, float]) -> None:
        """Record the measured phases of the in-place change to `generation` (the layout's
        rank 0 calls it), for the coordinator to fit its cost model on; published in the
        background before the acknowledgement. A report etcd would refuse is dropped: it
        is not worth stopping training for."""
        report = ChangeReport(generation, kind, dict(phases))
        try:
            report.encode()
        except SchemaError as exc:
            log.warning("worker %d does not report the phases of generation %d: %s", self.worker_id, generation, exc)
            return
        with self._lock:
            self._change = report
        self._wake.ring()

    def record_progress(self, iteration: int, consumed_samples: int, generation: int | None = None,
                        copies: int = 0) -> None:
        """Record how far training got (the running layout's rank 0, after each step, and
        a restart or a rollback, which passes its plan's `generation`: it is not
        acknowledged yet), and the generation of the workers' newest committed snapshots
        (`copies`, 0: none).

        Unlike the rest, this is sent from the caller's thread: a restart from a checkpoint
        counts the steps it loses from it, also when every process that trained them died.
        A restart's record is written at once. A step's is sent when it names a new
        generation or snapshots, or PROGRESS_INTERVAL_S after the last one sent, and is
        otherwise held; `progress_written()` (before a change or a restart reads the job's
        progress) sends the held one. Each write costs etcd a WAL sync and this process a
        gRPC call, which steps of a fraction of a second feel on a small host. A survivor
        of a broken layout raises the record to what it trained (`raise_progress`): only
        when every process that trained the newest steps dies before it sees the layout
        break does a restart count fewer steps lost (up to PROGRESS_INTERVAL_S of them)
        than it retrains.

        A sent record is answered while the next step trains: the next record,
        `progress_written()` and `stop()` read the answer. Waiting for it at the step's end
        cost the step etcd's round trip and WAL sync, and a background thread writing it
        cost more, taking the GIL from the step. While etcd does not answer, the agent
        thread writes the newest record once it does (the step does not wait out a
        deadline).
        """
        record = ProgressRecord(self._current if generation is None else generation, iteration, consumed_samples,
                                time.time(), copies)
        if generation is None and not self._progress_due(record):
            self._progress_held = record
            return
        self._progress_held = None  # older, or of the past a restart or rollback went back from
        self._send_progress(record, step=generation is None)

    def _progress_due(self, record: ProgressRecord) -> bool:
        if self._progress_last is None:
            return True
        last, sent_at = self._progress_last
        return ((record.generation, record.copies) != (last.generation, last.copies)
                or time.monotonic() - sent_at >= PROGRESS_INTERVAL_S)

    def _send_progress(self, record: ProgressRecord, step: bool) -> None:
        self._answer_progress()  # one record in flight at a time, in order
        self._progress_last = (record, time.monotonic())
        if step and self._client.unreachable_seconds == 0:
            with self._lock:
                self._progress = None  # an older record the agent thread has not written yet
            try:
                self._progress_sent = (record, self._store.start_recording_progress(
                    record, self.worker_id, self._lease.id, timeout=self.lease_seconds / 4))
                return
            except (EtcdError, SchemaError):
                pass
        with self._lock:
            self._progress = record
        if self._client.unreachable_seconds > 0:
            self._wake.ring()
            return
        try:  # well within a collective's timeout (a lease period): the step's peers wait
            written = self._publish_progress(timeout=self.lease_seconds / 4)
        except (EtcdError, SchemaError):
            self._wake.ring()
            return
        if not written:
            self._on_lease_lost()

    def progress_written(self) -> None:
        """Send the step's record held back, if any, and wait for the answer to the one in
        flight: fenced if this worker is no longer a member (found a step after the
        write); left to the agent thread if etcd failed."""
        held, self._progress_held = self._progress_held, None
        if held is not None:
            self._send_progress(held, step=True)
        self._answer_progress()

    def raise_progress(self, iteration: int, consumed_samples: int, generation: int, copies: int = 0) -> bool:
        """A survivor of `generation`'s broken layout records what it trained where the job's
        record says less (rank 0 holds records back, and may be gone with its held one);
        a newer generation's record stays. Written now, from the caller's thread: it may be
        preempted next. False where etcd did not take it (a later restart then counts from
        the record as it is)."""
        self.progress_written()
        assert self._lease is not None
        record = ProgressRecord(generation, iteration, consumed_samples, time.time(), copies, raised=True)
        try:
            return self._store.raise_progress(record, self.worker_id, self._lease.id)
        except (EtcdError, SchemaError) as exc:
            log.warning("worker %d could not record that it trained iteration %d: %s", self.worker_id, iteration, exc)
            return False

    def _answer_progress(self) -> None:
        sent, self._progress_sent = self._progress_sent, None
        if sent is None:
            return
        record, started = sent
        try:
            written = started.succeeded()
        except EtcdError:
            with self._lock:
                if self._progress is None:
                    self._progress = record
            self._wake.ring()
            return
        if not written:
            self._on_lease_lost()

    @property
    def generation(self) -> int:
        """The generation this process runs."""
        with self._lock:
            return self._current

    @property
    def notice_received(self) -> bool:
        return self._notice is not None

    @property
    def notice_deadline(self) -> float | None:
        """Wall-clock time by which this process will be killed, once a notice arrived."""
        notice = self._notice
        return None if notice is None else notice[1]

    @property
    def fenced(self) -> bool:
        """True once this process lost its membership (its lease expired, e.g. after a stall
        longer than the lease, or the coordinator revoked it). A fenced process must exit
        without writing anything; it can never rejoin under the same registration."""
        if self._fenced or self._stopping.is_set():  # after stop() the lease is gone by choice
            return self._fenced
        lease = self._lease
        return lease is not None and lease.lost

    # -- background work -------------------------------------------------------------

    def notify(self, reason: str, deadline: float) -> None:
        """A preemption notice from a cloud's metadata service (any thread); the first
        notice this process hears is the one it posts."""
        if self._notice is None:
            self._notice = (time.time(), deadline, reason)
        self._wake.ring()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self._notice is None:
            now = time.time()
            self._notice = (now, now + self.grace_seconds, "SIGTERM")
        self._wake.ring()

    def _on_lease_lost(self) -> None:
        if not self._stopping.is_set():
            log.error("worker %d is fenced: its lease expired or was revoked", self.worker_id)
        self._fenced = True
        self._wake.ring()

    def _offer(self, plans: list[PlanEnvelope]) -> None:
        """Plans from the feed's watch thread: keep the newest one newer than this process's
        generation, and space step reports for the size of its layout."""
        with self._lock:
            for plan in plans:
                if plan.generation > self._current and (self._pending is None
                                                        or plan.generation > self._pending.generation):
                    self._pending = plan
                    self._report_interval = max(REPORT_INTERVAL_S, len(plan.layout["slots"]) / REPORTS_PER_SECOND)

    def _refuse(self, error: SchemaError) -> None:
        self.last_error = str(error)
        log.error("worker %d ignores a plan: %s", self.worker_id, error)

    def _run(self) -> None:
        """Agent thread: publishes the notice, change reports, acknowledgements and step reports."""
        while not self._stopping.is_set():
            self._wake.wait(min(REPORT_INTERVAL_S, self.lease_seconds / 3))
            if self._stopping.is_set() or self.fenced:
                continue
            try:
                self._publish()
            except (EtcdError, SchemaError) as exc:
                log.warning("worker %d could not publish to etcd (will retry): %s", self.worker_id, exc)

    def _publish(self) -> None:
        assert self._lease is not None
        lease = self._lease.id
        published = True
        if self._notice is not None and not self._notice_posted:
            received_at, deadline, reason = self._notice
            notice = NoticeRecord(self.worker_id, self._member.instance, reason, received_at, max(received_at, deadline))
            published = self._store.post_notice(notice, lease)
            self._notice_posted = published
        with self._lock:
            change = self._change
        if published and change is not None:
            published = self._store.report_change(change, self.worker_id, lease)
            with self._lock:
                if self._change is change:
                    self._change = None
        with self._lock:
            member = self._member if self._member_dirty else None
        if published and member is not None:
            published = self._store.update_member(member, lease)
            with self._lock:
                self._member_dirty = self._member is not member
        with self._lock:
            report = None
            if self._steps.count and time.monotonic() - self._last_report_at >= self._report_interval:
                w = self._steps
                report = StepReport(self.worker_id, self._current, w.iteration, w.seconds / w.count, w.count, w.consumed_samples, time.time())
                self._steps = _StepWindow()
                self._last_report_at = time.monotonic()
        if published and report is not None:
            published = self._store.report_step(report, lease)
        if published:
            published = self._publish_progress()
        if not published:  # the member key is no longer on our lease
            self._on_lease_lost()

    def _publish_progress(self, timeout: float | None = None) -> bool:
        """Write the newest unwritten progress record; False if no longer a member."""
        assert self._lease is not None
        with self._progress_lock:
            with self._lock:
                record = self._progress
            if record is None:
                return True
            if not self._store.record_progress(record, self.worker_id, self._lease.id, timeout):
                return False
            with self._lock:
                if self._progress is record:
                    self._progress = None
            return True
