"""`--parcae-etcd`: the training loop's hook in a job that `parcae coordinator` drives.

Every training process is one worker with an id unique over the job's life. Its agent
(megatron_parcae/control/agent.py) keeps it registered in etcd, turns SIGTERM into a preemption
notice and delivers the coordinator's plans; this module applies them:

- `start()` registers and waits on standby, holding nothing, until a plan places the
  worker.
- `advance()` runs at every iteration boundary. About every AGREEMENT_SECONDS the
  layout's workers agree on the newest generation any of them has seen (one all-reduce
  of a few integers, which also agrees the iteration of the next agreement), so all of
  them apply a plan at the same boundary even though each learns of it at its own
  moment; the all-reduce is posted after a step and answered after the next one, so no
  step waits for it. Plans are applied in generation order with
  `reconfig.execute.migrate`. The time between two calls is the step time the agent
  reports (the throughput model learns from it).
- A plan without a migration (the job's first layout, or a restart after state was lost)
  builds its layout from the newest checkpoint under --save or --load, or from the seed.
- A worker with a notice sends what the plan asks of it and exits; one a plan does not
  use waits on standby for a later plan.
- A save-and-exit plan (the layout's workers are leaving and no layout can be formed
  without them): they write a checkpoint of the iteration they are at, after the save
  in flight, and leave the layout; those with a notice exit. The plan that resumes the
  job builds its layout from that checkpoint, losing no step.
- `recover()`: a collective failed because a peer died without notice or stalled (a
  running layout's collectives time out after one lease period; a longer wait, as in a
  layout's first step, is aborted once the peer's lease ends: reconfig/timeouts.py).
  This worker aborts and leaves WORLD, so that peers blocked on it fail at once, tells
  the coordinator (`broken` in its member record) and waits for the next plan. Its state is whole at its last applied step (the training step
  makes no collective after its update), so that plan can be an in-place migration
  without the lost peer. A failure while a migration is applied keeps the state the
  worker brought into it (a migration only reads it) and says of which layout, so the
  coordinator can retry the change from that layout without the lost peer; a failed
  rollback to snapshots or restart drops it.
- Snapshots (reconfig/copies.py, every --parcae-copy-interval steps and after the first
  step of each layout): each worker keeps its state in host memory and a copy of its
  ward's (none sent when the ward is a DP peer: its own snapshot is the same). When no
  live worker holds some lost state (no replica, the distributed optimizer's shards, a
  failed rollback), the next plan rolls the survivors back to
  their snapshots and fills the lost workers' slots from their buddies' copies; only
  when a worker and its buddy are both lost does the job resume from its checkpoint.
- `finish()`: the worker that ends training records it in etcd, so standby workers and
  the coordinator exit too.
- Without etcd the job cannot change, so it does not wait for it for ever: once etcd has
  not answered for --parcae-etcd-outage-seconds, or a notice has used half its grace
  period while etcd does not answer (the coordinator cannot hear it), the layout's
  workers agree at the next boundary to write a checkpoint (with --save) and exit with
  an error.

WORLD is formed on an etcd-backed store under the job's prefix (control/etcd/store.py), so the
workers need no address but etcd's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron_parcae import events
from megatron_parcae.training import checkpointing
from megatron_parcae.training.device import collective_timeout, first_step_timeout, prepare_device
from megatron_parcae.control.agent import ParcaeAgent
from megatron_parcae.control.etcd.client import EtcdClient, EtcdGone, EtcdUnavailable
from megatron_parcae.control.etcd.keys import (SAVE_AND_EXIT, DoneRecord, JobStore, PlanEnvelope, ProfileRecord,
                                               ProgressRecord, SchemaError)
from megatron_parcae.control.etcd.store import EtcdStore
from megatron_parcae.control.notices import build_watcher
from megatron_parcae.training.network import measure_network
from megatron_parcae.training.progress import Progress
from reconfig.execute import (
    HeldState,
    MigrationError,
    Runtime,
    StatesDiffer,
    built_layout,
    change_figures,
    export_held_state,
    hand_over,
    layout_args,
    migrate,
    release_runtime,
)
from reconfig import planes
from reconfig.copies import SnapshotStore
from reconfig.layout import Layout, ModelShape, Parallelism
from reconfig.plan import MigrationPlan
from reconfig.world import World, WorldBroken, is_peer_failure, process_group_backend, set_timeouts

STANDBY_POLL_SECONDS = 0.2
# How long a published plan may wait for the boundary that applies it (plus the step the
# agreement is in flight). An agreement every step cost its all-reduce in every step (a few
# % of a short CPU step); a notice's grace period is tens of seconds.
AGREEMENT_SECONDS = 0.5
DONE_POLL_SECONDS = 1.0
T = TypeVar("T")


class LiveJobError(RuntimeError):
    """This worker cannot go on; the message says why (it exits without touching the job)."""


class WorkerFenced(LiveJobError):
    """The job dropped this worker (its lease expired during a stall, or the coordinator
    counted it lost): its peers went on without it. Not a failure of the job, so it exits
    with agent.FENCED_EXIT, which launchers can tell from an error."""


class ChangeFailed(MigrationError):
    """A migration failed after this worker brought `held` into it: `held` is still whole
    (a migration only reads it), so the change can be retried from it."""

    def __init__(self, held: HeldState, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.held = held


def _is_running(runtime: Runtime | HeldState | None) -> bool:
    """Whether this worker runs a layout (not just holds state it took out of a broken one)."""
    return runtime is not None and not isinstance(runtime, HeldState)


def _change_failed(error: BaseException) -> bool:
    """Whether `error` ends a change this worker can report and wait out: a peer failed, a
    newer plan superseded the change, or the plan could not be carried out."""
    return not isinstance(error, LiveJobError) and (isinstance(error, MigrationError) or is_peer_failure(error))


class LiveReconfiguration:
    """Plans from etcd, applied at iteration boundaries (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, vocab_size: int,
                 runtime_factory: Callable[[argparse.Namespace, int], Runtime], client: EtcdClient,
                 before_change: Callable[[], None]) -> None:
        prepare_device()
        self.args = args
        self.store = JobStore(client, args.parcae_job)
        if args.parcae_worker_id is None:
            args.parcae_worker_id = self._etcd("get a worker id", self.store.allocate_worker_id)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        notices = build_watcher(args.parcae_notice, args.parcae_metadata_endpoint) if local_rank == 0 else None
        self.shape = ModelShape.from_args(args, vocab_size)
        self.agent = ParcaeAgent(client, args.parcae_job, args.parcae_worker_id, args.parcae_grace_seconds,
                                 args.parcae_lease_seconds, args.parcae_instance, local_rank, notices,
                                 can_save=bool(args.save), model=self.shape,
                                 failure_domain=args.parcae_failure_domain, transformer_impl=args.transformer_impl,
                                 pool=args.parcae_pool)
        self.world = World(args.parcae_worker_id, (), EtcdStore(client, self.store.keys.store), process_group_backend(),
                           collective_timeout=collective_timeout(args), abandon=self._wait_in_vain)
        self.world.watch(args.parcae_lease_seconds / 3)  # a peer lost in a long collective: abort WORLD
        self.generation = 0  # the newest plan this worker has applied (or skipped, or failed in)
        self._applying = 0  # the plan being applied, while one is
        self._next_members_check = 0.0  # monotonic time a wait for peers may next read who is a member
        self._lost_by_generation: dict[int, frozenset[int] | None] = {}
        self.samples_per_iteration = args.global_batch_size
        self.build: Callable[[Parallelism], Runtime] = lambda p: runtime_factory(layout_args(args, p), vocab_size)
        self._last_boundary: float | None = None
        self._agreed: tuple[int, bool] | None = None  # what trained() agreed for the coming boundary
        self._agreeing: tuple[dist.Work | None, torch.Tensor, int] | None = None  # posted, not answered yet
        self._agree_at = 0  # the iteration whose boundary the layout's ranks agree at next (0: the next one)
        self._step_seconds: float | None = None  # the newest measured step of the running layout
        self._first_step = False  # the running layout's collectives wait up to first_step_timeout
        self.before_change = before_change  # complete what needs this WORLD (a save in flight)
        self._profile_checked: ProfileRecord | None = None
        self.snapshots = SnapshotStore() if args.parcae_copy_interval else None
        self._copy_holders: dict[int, int] = {}  # of the running layout: worker -> keeper of its copy
        self._broken_at = 0  # the newest generation whose WORLD broke under this worker
        self._copies_generation = 0  # of the layout's newest snapshots (some joiners hold none), 0: none
        # The layout whose state this worker runs, or holds after a failure, and the
        # generation of the plan that built it.
        self._state_of = 0
        self._state_layout: Layout | None = None
        self._recovered_from: Layout | None = None  # the layout the newest `recover` came from
        self._recorded_when_broken: ProgressRecord | None = None  # the job's record then

    # -- the training loop's calls ---------------------------------------------------

    def start(self) -> tuple[Runtime | None, int]:
        """Register, then wait for a plan that places this worker (None: the job ended first)."""
        self._etcd("register in the job", self.agent.start)
        self.generation = self.agent.generation
        return self._await_plan(None, 0)

    def advance(self, runtime: Runtime, consumed_samples: int) -> tuple[Runtime | None, int]:
        """Apply the plans due at this iteration boundary; None: this worker leaves the job."""
        if self.world.aborted:  # gloo's collectives go on after an abort: a peer failed all the same
            raise WorldBroken(f"worker {self.world.worker} aborted WORLD: {self.world.aborted}")
        now = time.perf_counter()
        iteration = consumed_samples // self.samples_per_iteration
        if self._last_boundary is not None:
            self._step_seconds = now - self._last_boundary
            self.agent.report_step(iteration, self._step_seconds, consumed_samples)
        agreed, self._agreed = self._agreed, None
        if agreed is None:
            if self._agreeing is None:
                self._post_agreement(iteration)
            agreed = self._answer_agreement()
        newest, cut_off = agreed
        if (newest > self.generation or cut_off or self._copies_due(iteration)) and self._agreeing is not None:
            # Answered before the change's or the snapshot's own collectives (every rank posted
            # it): a peer lost in the step fails it before a snapshot drops the one held.
            later, later_cut_off = self._answer_agreement()
            newest, cut_off = max(newest, later), cut_off or later_cut_off
        if cut_off:
            self._save_and_stop(runtime, consumed_samples)
        changed = newest > self.generation
        if changed:
            self.agent.progress_written()  # the old layout's last record goes before the new layout's
            self.before_change()
            runtime, consumed_samples = self._apply_until(newest, runtime, consumed_samples)
            if not _is_running(runtime):
                return self._await_plan(runtime, consumed_samples)
        if not changed:  # a joiner's first boundary in the layout is after its first step: wait for it
            self._keep_copies(runtime, consumed_samples)
        # As after _await_plan: the first step of a new layout warms it up (allocations, the
        # first collectives on its groups; several steps' time) and is not a measured one,
        # or the coordinator would learn that the layout is slow.
        if changed:
            self._layout_started()
        else:
            self._last_boundary = time.perf_counter()
            if self._first_step:  # and the first snapshot: steps wait for peers a lease period again
                set_timeouts(self.world.collective_timeout)
                self._first_step = False
        return runtime, consumed_samples

    def _layout_started(self) -> None:
        """A layout was formed: its ranks agree at its first boundary, and its first step
        is not measured. Its collectives wait up to --parcae-first-step-timeout until its
        first boundary is done: the first step compiles kernels and forms communicators."""
        self._last_boundary, self._step_seconds, self._agree_at = None, None, 0
        self._first_step = bool(self.world.members) and not self.world.aborted
        if self._first_step:
            set_timeouts(first_step_timeout(self.args))

    def _keep_copies(self, runtime: Runtime, consumed_samples: int) -> None:
        """Snapshot the layout's state with its buddies' copies, when due (every worker of the
        layout decides alike: same generation, same iteration). A layout of one worker takes
        none: losing that worker loses the job, and no peer has a step to roll back to it."""
        iteration = consumed_samples // self.samples_per_iteration
        if not self._copies_due(iteration):
            return
        started = time.perf_counter()
        me, holders = self.world.worker, self._copy_holders
        ward = next((w for w, h in holders.items() if h == me), None)
        peers = self._state_layout.dp_peers(me)
        damaged = self.snapshots.damaged_exchanges
        self._copies_generation = 0  # taking one overwrites the snapshots held until now
        snapshot = self.snapshots.take(runtime, self.world, self.generation, iteration, consumed_samples,
                                       holders.get(me), ward, peers)
        if snapshot is not None:
            self._copies_generation = self.generation
        if dist.get_rank() == 0:
            events.report(events.CopiesKept(
                self.generation, iteration, self.args.parcae_copy_interval,
                0.0 if snapshot is None else snapshot.nbytes() / 2**20, time.perf_counter() - started,
                ward is not None and ward not in peers, committed=snapshot is not None,
                damaged=self.snapshots.damaged_exchanges - damaged, host_mib=self.snapshots.host_bytes() / 2**20,
                allocations=self.snapshots.allocations))

    def _copies_due(self, iteration: int) -> bool:
        """Whether this boundary takes snapshots (every rank of the layout decides alike)."""
        if self.snapshots is None or len(self.world.members) < 2:
            return False
        return self.snapshots.generation != self.generation or iteration % self.args.parcae_copy_interval == 0

    def trained(self, consumed_samples: int) -> None:
        """A step was applied and rank 0 logged it: rank 0 records how far the job got (so
        a record of the step says it was logged); the agreement posted after the previous
        step is answered, for the coming boundary to apply, and the next one is posted when
        due. Waiting for an agreement posted here cost the step the all-reduce's round
        trip: about 2 ms on a loaded 2-core host (each rank's gloo thread must be
        scheduled), twice a second."""
        iteration = consumed_samples // self.samples_per_iteration
        if dist.get_rank() == 0:
            self.agent.record_progress(iteration, consumed_samples, copies=self._copies_generation)
        answered = self._answer_agreement()
        if iteration >= self._agree_at:
            self._post_agreement(iteration)
        self._agreed = answered if answered is not None else (self.generation, False)

    def _post_agreement(self, iteration: int) -> None:
        """Start the ranks' all-reduce of (newest plan generation this rank has, whether it
        must stop without a plan, minus the steps to the next agreement: AGREEMENT_SECONDS
        of the slowest rank's steps)."""
        self._check_fenced()  # an etcd gone past the bound is agreed on below, to save first
        pending = self.agent.pending_plan()
        steps = 1 if self._step_seconds is None else max(1, int(AGREEMENT_SECONDS / self._step_seconds))
        agreed = planes.control_tensor([pending.generation if pending is not None else self.generation,
                                        int(self._cut_off() is not None), -steps])
        work = None
        if dist.get_world_size() > 1:  # alone, the worker agrees with itself
            work = dist.all_reduce(agreed, op=dist.ReduceOp.MAX, async_op=True)
        self._agreeing = (work, agreed, iteration)

    def _answer_agreement(self) -> tuple[int, bool] | None:
        """The posted agreement's (newest generation, stop), once every rank posted it; None
        if none is in flight. A failed all-reduce raises like any collective of the step."""
        if self._agreeing is None:
            return None
        (work, agreed, iteration), self._agreeing = self._agreeing, None
        if work is not None:
            work.wait()
        self._agree_at = iteration - int(agreed[2])
        return int(agreed[0]), bool(agreed[1])

    def logs_again(self, consumed_samples: int) -> bool:
        """Rank 0 records a step after logging it, so a record of it when WORLD broke says it
        was logged (a rollback or a restart records where training went back to). A record
        a survivor raised (another survivor of the same break may have been first) says only
        that rank 0's was below it."""
        old, new, recorded = self._recovered_from, self._state_layout, self._recorded_when_broken
        if old is None or new is None:
            return False
        keepers = [w for w in new.slots if w in old.workers]
        logged = recorded is not None and (recorded.consumed_samples > consumed_samples if recorded.raised
                                           else recorded.consumed_samples >= consumed_samples)
        return keepers[:1] == [self.world.worker] and not logged

    def can_recover(self, error: BaseException) -> bool:
        """A peer died or stalled: its survivors carry on without it."""
        return is_peer_failure(error)

    def recover(self, runtime: Runtime, consumed_samples: int, error: BaseException) -> tuple[Runtime | None, int]:
        """A collective of the running layout failed (a peer died or stalled): report it,
        keep this worker's state and apply the coordinator's next plan."""
        self._agreed = self._agreeing = None  # agreed in the broken WORLD
        # First: on NCCL a collective may still be blocked on the failed peer, and every
        # later use of the device (the state's export) would wait behind it.
        self.world.abort(f"a collective failed: {str(error).strip()[:200]}")
        self._recovered_from = self._state_layout
        self._layout_started()
        self._check_membership()
        # With the plain optimizer this rank's state is local and whole at its last applied
        # step; the distributed optimizer would need its (broken) data-parallel group.
        held = None if self.args.use_distributed_optimizer else export_held_state(runtime)
        release_runtime(runtime)
        self._report_broken(self.generation, consumed_samples, error, self._state_of if held is not None else 0)
        recorded = self._recorded_when_broken = self._progress_record()
        if recorded is None or recorded.consumed_samples < consumed_samples:  # after the read: see `logs_again`
            self.agent.raise_progress(consumed_samples // self.samples_per_iteration, consumed_samples,
                                      self.generation, self._copies_generation)
        return self._await_plan(held, consumed_samples)

    def finish(self, consumed_samples: int | None) -> None:
        """Leave the job; with `consumed_samples` (training reached its end) say so in etcd."""
        try:
            if consumed_samples is not None and dist.is_initialized():
                try:
                    if dist.get_rank() == 0:
                        done = DoneRecord(self.generation, consumed_samples // self.samples_per_iteration,
                                          consumed_samples, time.time())
                        self._etcd("record the end of training", lambda: self.store.mark_done(done))
                finally:
                    # No rank lets its membership go before the end is recorded: a coordinator
                    # that saw members go first would plan a change without them.
                    self._answer_agreement()
                    dist.all_reduce(planes.control_tensor([0]))
        finally:
            self.world.close()
            self.agent.stop()

    # -- plans -----------------------------------------------------------------------

    def _etcd(self, what: str, call: Callable[[], T]) -> T:
        """`call`, retried while etcd is unreachable (it restarts) up to the client's outage
        bound, then LiveJobError. The agent keeps the lease meanwhile, on its own threads."""
        while True:
            try:
                return call()
            except EtcdUnavailable:
                try:
                    self.store.client.check_reachable()
                except EtcdGone as exc:
                    raise LiveJobError(f"worker {self.world.worker} could not {what}: {exc}") from None
                time.sleep(STANDBY_POLL_SECONDS)

    def _check_fenced(self) -> None:
        if self.agent.fenced:
            raise WorkerFenced(f"worker {self.world.worker} lost its membership in job {self.args.parcae_job} "
                               "(its lease expired or the coordinator dropped it); its state is no longer wanted")

    def _check_membership(self) -> None:
        """Raise if this worker cannot go on: fenced, or etcd gone for longer than the bound."""
        self._check_fenced()
        try:
            self.store.client.check_reachable()
        except EtcdGone as exc:
            raise LiveJobError(f"worker {self.world.worker}: {exc}") from None

    def _cut_off(self) -> str | None:
        """Why this worker must stop without a plan, if it must: etcd is gone, or a notice
        has used half its grace period while etcd does not answer."""
        client = self.store.client
        try:
            client.check_reachable()
        except EtcdGone as exc:
            return str(exc)
        deadline = self.agent.notice_deadline
        if deadline is not None and client.unreachable_seconds > 0 \
                and deadline - time.time() <= self.args.parcae_grace_seconds / 2:
            return f"a preemption notice came while etcd at {client.endpoint} does not answer"
        return None

    def _save_and_stop(self, runtime: Runtime, consumed_samples: int) -> None:
        """Every worker of the layout agreed that the job cannot go on without etcd: write
        a checkpoint of this iteration where --save is set, then stop (LiveJobError)."""
        self.before_change()  # the save in flight
        progress = Progress.at(consumed_samples, self.samples_per_iteration)
        why = self._cut_off() or "a peer of this layout is cut off from etcd"
        saved = "steps since the last checkpoint are lost (no --save)"
        if self.args.save:
            self._save_now(runtime, progress)
            saved = f"saved iteration {progress.iteration} under {self.args.save}"
        release_runtime(runtime)
        raise LiveJobError(f"worker {self.world.worker} stops: {why}; {saved}")

    def _wait_in_vain(self, peers: tuple[int, ...], waited: float) -> str:
        """Why waiting `waited` seconds for `peers` while the plan being applied is formed
        is in vain ("" while it is not): this worker was fenced, a newer plan counts one
        of them lost or starts over (a newer plan that only follows this one is applied
        after it), or one of them is no longer a member (its lease ended): nothing else
        ends the wait while the coordinator holds back its plan for that loss until the
        survivors report the change broken (its `_awaits_change`). Membership is read every
        third of a lease period, the first a third into the wait: a thousand waiting
        workers each read every member key."""
        if self.agent.fenced:
            return "this worker was fenced"
        pending = self.agent.pending_plan()
        for generation in range(self._applying + 1, 1 + (0 if pending is None else pending.generation)):
            lost = self._lost_in(generation)
            if lost is None or lost & frozenset(peers):
                return f"the plan of generation {generation} supersedes it and counts a peer waited for as lost"
        now = time.monotonic()
        period = self.agent.lease_seconds / 3
        if waited < period or now < self._next_members_check:
            return ""
        self._next_members_check = now + period
        try:
            gone = frozenset(peers) - self.store.member_ids()
        except (EtcdUnavailable, SchemaError):
            return ""  # asked again a period on
        return f"workers {sorted(gone)} are no longer members of the job" if gone else ""

    def _lost_in(self, generation: int) -> frozenset[int] | None:
        """The workers the plan of `generation` counts as lost; None for a restart or a
        rollback to snapshots, which start over (a save-and-exit loses none: it saves the
        layout the plans before it make)."""
        if generation not in self._lost_by_generation:
            try:
                envelope = self.store.plan(generation)
            except (EtcdUnavailable, SchemaError):
                return frozenset()  # asked again at the next poll
            if envelope is None:
                return frozenset()
            request = None if envelope.migration is None else MigrationPlan.from_dict(envelope.migration).request
            self._lost_by_generation[generation] = (
                frozenset() if envelope.action == SAVE_AND_EXIT
                else None if request is None or request.copies is not None else request.lost)
        return self._lost_by_generation[generation]

    def _report_broken(self, generation: int, consumed_samples: int, error: BaseException, state_of: int) -> None:
        """Tell the coordinator that `generation` broke under this worker, which holds the
        state of `state_of`'s layout (0: none)."""
        self._broken_at = generation
        self.world.break_generation(generation)  # peers blocked on this worker fail now, not at their timeout
        self.agent.report_broken(generation, state_of)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        kept = f"keeping its state of generation {state_of}" if state_of else "holding no state"
        print(f" worker {self.world.worker}: generation {generation} broke at iteration "
              f"{consumed_samples // self.samples_per_iteration} ({reason}); {kept}, waiting for the next plan",
              flush=True)

    def _await_plan(self, state: HeldState | None, consumed_samples: int) -> tuple[Runtime | None, int]:
        """Wait for the next plan and apply it, then, left without a slot, for one that
        places this worker. `state`: what it kept of a layout that broke. None: a notice
        came while it held nothing and no plan is pending (one made before the notice
        came may place it: its peers wait for it), or training ended."""
        runtime: Runtime | HeldState | None = state
        next_done_check = 0.0
        while True:
            self._check_membership()
            pending = self.agent.pending_plan()
            # What it kept of a broken layout (its state, or its snapshots: they may hold the
            # only copy of a lost peer's) goes with it when no plan can come for it in time.
            kept = runtime is not None or (self._broken_at == self.generation and self.snapshots is not None
                                           and self.snapshots.generation > 0)
            if pending is None and self.agent.notice_received and (not kept or self._cut_off()):
                return None, consumed_samples
            if time.monotonic() >= next_done_check:
                try:
                    if self._profile_checked is None:  # afterwards each plan checks it (_apply)
                        self._check_profile()
                    if self.store.done() is not None:
                        return None, consumed_samples
                except EtcdUnavailable:
                    pass  # asked again; _check_membership gives up after the outage bound
                next_done_check = time.monotonic() + DONE_POLL_SECONDS
            if pending is None:
                time.sleep(STANDBY_POLL_SECONDS)
                continue
            runtime, consumed_samples = self._apply_until(pending.generation, runtime, consumed_samples)
            if _is_running(runtime):
                self._layout_started()
                return runtime, consumed_samples

    def _apply_until(self, newest: int, runtime: Runtime | HeldState | None,
                     consumed_samples: int) -> tuple[Runtime | HeldState | None, int]:
        """Apply the plans up to `newest` in order (`runtime` is a HeldState only after a
        failure); a failure on the way is reported and leaves this worker with the state it
        kept (ChangeFailed), else with nothing."""
        for generation in range(self.generation + 1, newest + 1):
            self._applying = generation
            try:
                runtime, consumed_samples = self._apply(self._plan(generation), runtime, consumed_samples)
            except RuntimeError as exc:
                if not _change_failed(exc):
                    raise
                self.world.abort(f"generation {generation} failed: {str(exc).strip()[:200]}")
                if _is_running(runtime):
                    release_runtime(runtime)  # already done unless the failure came first
                kept = exc.held if isinstance(exc, ChangeFailed) else None
                self.generation = generation
                self._report_broken(generation, consumed_samples, exc, self._state_of if kept is not None else 0)
                return kept, consumed_samples
            self.generation = generation
            self.agent.acknowledge(generation)
        return runtime, consumed_samples

    def _plan(self, generation: int) -> PlanEnvelope:
        try:
            envelope = self._etcd(f"read the plan of generation {generation}", lambda: self.store.plan(generation))
        except SchemaError as exc:
            raise LiveJobError(f"the plan of generation {generation} is unreadable: {exc}") from None
        if envelope is None:
            raise LiveJobError(f"the plan of generation {generation} is gone from etcd (only the newest are kept); "
                               "this worker fell too far behind")
        return envelope

    def _check_profile(self) -> None:
        """Refuse a coordinator whose layer profile was measured on another model: its
        plans would be shaped and priced for that one."""
        try:
            record = self.store.profile()
            theirs = None if record is None else ModelShape.from_dict(record.model)
        except (SchemaError, ValueError) as exc:
            raise LiveJobError(f"the coordinator's profile record is unreadable: {exc}") from None
        if record is None or record == self._profile_checked:
            return
        differ = [f"{f.name} {getattr(theirs, f.name)} (this worker: {getattr(self.shape, f.name)})"
                  for f in dataclasses.fields(ModelShape) if getattr(theirs, f.name) != getattr(self.shape, f.name)]
        if differ:
            raise LiveJobError(f"the coordinator's profile {record.source} was measured on another model than this "
                               f"worker trains: {'; '.join(differ)}. Give the coordinator a profile of this model "
                               "(`parcae profile -- <this run's model flags>`)")
        self._profile_checked = record

    def _apply(self, envelope: PlanEnvelope, runtime: Runtime | HeldState | None,
               consumed_samples: int) -> tuple[Runtime | None, int]:
        self._etcd("read the coordinator's profile", self._check_profile)
        if envelope.action == SAVE_AND_EXIT:
            return self._save_and_exit(envelope.generation, runtime, consumed_samples)
        layout = Layout.from_dict(envelope.layout)
        self._check_buildable(envelope.generation, layout.parallelism)
        if envelope.migration is None:
            return self._restart(envelope, layout, runtime, consumed_samples)
        plan = MigrationPlan.from_dict(envelope.migration)
        me = self.world.worker
        if plan.request.distributed_optimizer != self.args.use_distributed_optimizer:
            raise LiveJobError(f"the plan of generation {envelope.generation} is for a job "
                               f"{'with' if plan.request.distributed_optimizer else 'without'} the distributed "
                               "optimizer, this run is not (set distributed-optimizer in the coordinator's config "
                               "as --use-distributed-optimizer is here)")
        request = plan.request
        # A plan from another layout than the one whose state this worker kept when a change
        # failed was made before the coordinator heard of it: failing it at once, keeping
        # the state, has the coordinator plan from that layout.
        if isinstance(runtime, HeldState) and request.copies is None and request.old != self._state_layout:
            raise ChangeFailed(runtime, MigrationError(
                f"generation {envelope.generation} migrates from another layout than generation {self._state_of}'s, "
                "whose state this worker holds"))
        # From copies, a worker of the current layout that joined after the snapshots were
        # taken holds nothing of theirs: it joins again.
        if runtime is not None and me not in request.survivors | request.leaving \
                and (request.copies is None or me not in request.joining):
            raise WorkerFenced(f"generation {envelope.generation} counts worker {me} as lost, but it still runs")
        if runtime is None and me not in plan.new.workers and me not in {t.src for t in plan.transfers}:
            return None, consumed_samples  # not in this change
        started = time.perf_counter()
        if request.copies is not None:  # what it rolls back from: also steps whose workers are all gone
            consumed_samples = max(consumed_samples, self._recorded_samples())
        handed_over = _is_running(runtime)
        held = hand_over(runtime) if handed_over else runtime
        try:
            runtime, consumed_samples = self._enter(envelope, plan, held, consumed_samples)
        except RuntimeError as exc:
            # A rollback's state came from snapshots: what it held before is not kept; nor is
            # state of another step than its peers' (the coordinator then plans without it).
            if held is None or request.copies is not None or not _change_failed(exc) \
                    or isinstance(exc, StatesDiffer):
                raise
            raise ChangeFailed(held, exc) from exc
        if runtime is None:
            return runtime, consumed_samples
        if dist.get_rank() == 0:
            figures = change_figures(plan, started)
            gbs = self.samples_per_iteration
            source = None if request.copies is None else f"snapshots of generation {request.copies.generation}"
            events.report(events.LayoutChange.of_migration(envelope.generation, consumed_samples // gbs, figures,
                                                           source, figures.rolled_back_samples // gbs))
            if request.copies is not None:  # training went back: the job's progress is here now
                self.agent.record_progress(consumed_samples // gbs, consumed_samples, envelope.generation,
                                           copies=self._copies_generation)
            # The coordinator refits its cost model on these. A worker that held no running
            # layout began timing before its peers' last step ended: not the change's time.
            if handed_over:
                self.agent.report_change(envelope.generation, figures.kind, figures.phases)
        return runtime, consumed_samples

    def _enter(self, envelope: PlanEnvelope, plan: MigrationPlan, held: HeldState | None,
               consumed_samples: int) -> tuple[Runtime | None, int]:
        """Migrate to the plan's layout, then agree on what its workers need before their
        first step (collective); if that fails, the new layout is released (its groups would
        block the next one's)."""
        runtime, consumed_samples = migrate(plan, envelope.generation, self.world, held, self.build,
                                            consumed_samples, self.snapshots)
        if runtime is None:
            return runtime, consumed_samples
        try:
            # The snapshots the layout's workers hold until they take its own: a joiner that
            # is rank 0 holds none, but records their generation for the coordinator.
            copies = planes.control_tensor([0 if self.snapshots is None else self.snapshots.generation])
            dist.all_reduce(copies, op=dist.ReduceOp.MAX)
            measure_network(self.store, plan.new, envelope.generation, collective_timeout(self.args))  # once per job
        except BaseException:
            release_runtime(runtime)
            raise
        self._copies_generation = int(copies[0])
        self._copy_holders = envelope.holders()
        self._state_of, self._state_layout = envelope.generation, plan.new
        return runtime, consumed_samples

    def _save_and_exit(self, generation: int, runtime: Runtime | HeldState | None,
                       consumed_samples: int) -> tuple[None, int]:
        """Write a checkpoint of this iteration and leave the layout: its workers are
        leaving and no layout can be formed without them, and the plan that resumes the
        job from this checkpoint then loses no step."""
        if not _is_running(runtime):
            return None, consumed_samples  # nothing to save: on standby, or its layout broke
        if not self.args.save:
            raise LiveJobError(f"generation {generation} asks the job to save a checkpoint and exit (its workers are "
                               "leaving), but this worker runs without --save: the steps trained since the last "
                               "checkpoint are lost")
        progress = Progress.at(consumed_samples, self.samples_per_iteration)
        self._save_now(runtime, progress)
        release_runtime(runtime)
        self.world.leave()
        print(f" worker {self.world.worker}: generation {generation} saved the job at iteration {progress.iteration}; "
              "leaving its layout", flush=True)
        return None, consumed_samples

    def _save_now(self, runtime: Runtime, progress: Progress) -> None:
        """A synchronous checkpoint of this iteration under --save, unless the newest is of it
        (collective)."""
        if not self._checkpointed(progress.iteration):
            checkpointing.Checkpointer(self.args.save, False, collective_timeout(self.args)).save(runtime, progress)

    def _checkpointed(self, iteration: int) -> bool:
        """Whether the newest checkpoint under --save is of `iteration` (collective): rank 0,
        which writes the tracker once every rank's files are complete, tells the others."""
        newest = -1
        if dist.get_rank() == 0:
            try:
                newest = checkpointing.read_progress(self.args.save)[1]["iteration"]
            except checkpointing.CheckpointError:
                pass  # none yet
        found = planes.control_tensor([newest])
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return int(found) == iteration

    def _restart(self, envelope: PlanEnvelope, layout: Layout, runtime: Runtime | HeldState | None,
                 consumed_samples: int) -> tuple[Runtime | None, int]:
        """Build `layout` from the newest checkpoint (or the seed): nothing to migrate from."""
        generation = envelope.generation
        started = time.perf_counter()
        if _is_running(runtime):
            release_runtime(runtime)
        if self.snapshots is not None:
            self.snapshots = SnapshotStore()  # of a past the job went back from
        self._copies_generation = 0
        if self.world.worker not in layout.workers:
            self.world.leave()
            # Training goes back to a checkpoint without this worker: what it knew is no
            # longer how far the job got, and would overstate what a later restart loses.
            return None, 0
        self.world.reform(layout.slots, f"g{generation}")
        measure_network(self.store, layout, generation, collective_timeout(self.args))  # once per job
        # How far training got: what these workers know, or the job's record if further
        # (the workers that trained the last steps may all be gone).
        known = planes.control_tensor([max(consumed_samples, self._recorded_samples())])
        dist.all_reduce(known, op=dist.ReduceOp.MAX)
        source = next((d for d in (self.args.save, self.args.load)
                       if d is not None and checkpointing.is_checkpoint(d)), None)
        # --finetune takes the weights of --load until this job has saved its own.
        finetune = self.args.finetune and source == self.args.load and source != self.args.save
        with built_layout(self.build, layout.parallelism, self.world, generation) as runtime:
            consumed_samples = 0 if source is None else checkpointing.load(source, runtime, finetune).consumed_samples
        self._copy_holders = envelope.holders()
        self._state_of, self._state_layout = generation, layout
        if dist.get_rank() == 0:
            gbs = self.samples_per_iteration
            self.agent.record_progress(consumed_samples // gbs, consumed_samples, generation)  # training goes back here
            p = layout.parallelism
            events.report(events.LayoutChange(
                generation, consumed_samples // gbs, "restart", p.tp, p.pp, p.dp, time.perf_counter() - started,
                source=source or "the seed", lost_steps=max(0, int(known) - consumed_samples) // gbs))
        return runtime, consumed_samples

    def _progress_record(self) -> ProgressRecord | None:
        """The job's progress record (None without one)."""
        self.agent.progress_written()  # this worker's own record, if one is in flight
        try:
            return self._etcd("read the job's progress", self.store.progress)
        except SchemaError as exc:
            print(f" worker {self.world.worker}: ignoring the job's progress record: {exc}", flush=True)
            return None

    def _recorded_samples(self) -> int:
        """The samples the job's progress record says were consumed (0 without one)."""
        recorded = self._progress_record()
        return 0 if recorded is None else recorded.consumed_samples

    def _check_buildable(self, generation: int, p: Parallelism) -> None:
        """Refuse a layout this run's model or batch cannot take (every worker refuses alike)."""
        try:
            self.shape.check(p, self.args.micro_batch_size, self.args.global_batch_size)
        except ValueError as exc:
            raise LiveJobError(f"the plan of generation {generation} asks for T={p.tp} P={p.pp} D={p.dp}, which this "
                               f"run cannot train: {exc} (does the coordinator's profile describe this model and "
                               "batch?)") from None
