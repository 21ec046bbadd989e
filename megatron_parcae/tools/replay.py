"""`parcae replay`: the spot emulator. Replays a real availability trace on one machine
with real processes, real etcd and the real coordinator.

A trace segment (predictor.AvailabilityTrace, cut and scaled to this machine) becomes
a list of `ReplayStep`s in wall-clock time (`--speedup` trace seconds per second). Each
step tells the job under test how many instances it has from then on; an instance is
one training process, or with `--gpus-per-instance G` one torchrun of G processes.
Instances that go away are preempted as a cloud does it, all their processes at once:
SIGTERM, then SIGKILL after the grace period.

Jobs under test implement `resize(count)` and `stop()`:
- `ParcaeJob` starts etcd and `parcae coordinator`, and `--parcae` workers on each arriving
  instance (fresh worker ids: a new instance is new processes). With a deadline
  (`--deadline-hours`, `DeadlineSetting`) it buys from two pools through the emulator's
  provisioner (provisioning/emulator.py): a spot fleet as large as --max-instances that
  runs what the trace allows, and the on-demand instances the coordinator's deadline
  policy wants (its `provisioning` record in etcd), each started after its start-up; it
  pays them by pool in trace hours. `--baseline spot-only` replays the same without
  on-demand instances;
- `CheckpointRestartJob` is the reactive baseline (what users run today): a torchrun job
  with periodic checkpoints, killed and restarted from its last checkpoint on every
  change of the instance count.
The training processes write their events (iterations, consumed samples, losses,
checkpoints, layout changes) to files, one per worker or torchrun job (--parcae-events);
a `JobLog` follows those files, and that is all a `ReplaySummary` needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol

import psutil

from megatron_parcae.control.agent import FENCED_EXIT
from megatron_parcae.events import (
    Event, EventError, EventFollower, Iteration, LayoutChange, Load, Save, ThroughputLearned, read_events,
)
from megatron_parcae.provisioning.emulator import EmulatorProvisioner
from megatron_parcae.provisioning.ledger import CostLedger
from megatron_parcae.provisioning.pools import Market, Pool
from megatron_parcae.tools.progress import Progress, hms
from megatron_parcae.training.arguments import ArgumentError, parse_args
from reconfig.placement import MAX_GPUS_PER_INSTANCE

BASELINES = ("checkpoint-restart", "spot-only")
# The coordinator's planning interval and Parcae's, in trace seconds: what a restart or a
# migration is compared with.
INTERVAL_TRACE_SECONDS = 60.0
PREDICTION_INTERVALS = 5  # the coordinator's learned step time is checked after this many intervals of a layout
# Workers and the coordinator renew leases from background threads; on a machine running
# more processes than it has cores those threads can stall for seconds.
LEASE_SECONDS = 5.0
# How long a deadline's replay waits for the coordinator's first cost record (its clock).
COORDINATOR_START_SECONDS = 180.0
# torchrun's per-process error files go here, in the replay's folder, not in a temporary
# folder of torchrun's own that nobody removes.
TORCHRUN_LOGS = "torchrun-logs"


class ReplayError(RuntimeError):
    """The replay cannot go on (a worker failed on its own); the message says which and why."""


@dataclass(frozen=True)
class ReplayStep:
    at_seconds: float  # wall-clock seconds from the start of the replay
    count: int  # instances available from then on


def replay_steps(trace, speedup: float) -> list[ReplayStep]:
    """One step per change of the instance count, in wall-clock time."""
    if speedup <= 0:
        raise ValueError(f"--speedup must be positive, got {speedup}")
    steps: list[ReplayStep] = []
    for t, count in zip(trace.times, trace.counts):
        if not steps or int(count) != steps[-1].count:
            steps.append(ReplayStep(float(t) / speedup, int(count)))
    return steps


@dataclass
class JobLog:
    """What the job's processes have reported so far, read from their events files."""

    started: float = field(default_factory=time.time)  # Unix time, as in the events
    iteration: int = 0
    consumed_samples: int = 0
    trained_samples: int = 0  # consumed less fp16's skipped steps: the figure replays compare
    loss: float | None = None
    saved_iteration: int = 0
    lost_steps: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    progress: list[tuple[float, int]] = field(default_factory=list)  # (seconds, trained samples)
    trained: list[tuple[int, int]] = field(default_factory=list)  # (iteration, consumed samples), as logged
    changes: list[dict] = field(default_factory=list)  # layout changes the workers reported
    step_seconds: dict[str, list[float]] = field(default_factory=dict)  # by layout, each step but a change's first
    _after_change: bool = field(default=True, repr=False)
    events: list[dict] = field(default_factory=list)  # what the emulator did: preempt, arrive
    _files: list[EventFollower] = field(default_factory=list, repr=False)

    def seconds(self, at: float | None = None) -> float:
        """Seconds since the replay started, until now or the Unix time `at`."""
        return round((time.time() if at is None else at) - self.started, 3)

    def follow(self, path: Path) -> None:
        """Read the events a process appends to `path` from now on."""
        self._files.append(EventFollower(path))

    def poll(self) -> None:
        """Take in the events written since the last call, in the order they happened."""
        try:
            new = sorted((e for f in self._files for e in f.read()), key=lambda e: e.time)
        except EventError as exc:
            raise ReplayError(f"a training process wrote a bad event: {exc}") from None
        for event in new:
            self._take(event)

    def _take(self, event: Event) -> None:
        if isinstance(event, Iteration) and event.repeats(self.trained[-1][0] if self.trained else None):
            return
        if isinstance(event, Iteration):
            self.iteration, self.consumed_samples = event.iteration, event.consumed_samples
            self.trained_samples = event.trained_samples
            self.loss = event.losses["lm loss"]
            self.losses[self.iteration] = self.loss
            self.progress.append((self.seconds(event.time), self.trained_samples))
            self.trained.append((self.iteration, self.consumed_samples))
            if self.changes and not self._after_change:
                key = "T{}P{}D{}".format(*self.changes[-1]["layout"])
                self.step_seconds.setdefault(key, []).append(event.ms_per_iteration / 1000)
            self._after_change = False
        elif isinstance(event, LayoutChange):
            self._after_change = True  # its first step's time includes the change
            self.lost_steps += event.lost_steps
            self.changes.append({"at_seconds": self.seconds(event.time), "iteration": event.iteration,
                                 "generation": event.generation, "kind": event.kind,
                                 "layout": [event.tp, event.pp, event.dp], "seconds": round(event.seconds, 4),
                                 "lost_steps": event.lost_steps})
        elif isinstance(event, Save):
            self.saved_iteration = event.iteration
        elif isinstance(event, Load):
            self.iteration = event.iteration

    def event(self, what: str, count: int) -> None:
        self.events.append({"at_seconds": self.seconds(), "event": what, "instances": count})

    def rollback_to_checkpoint(self) -> None:
        """The job was killed: what it trained since its last checkpoint is lost."""
        self.lost_steps += self.iteration - self.saved_iteration
        self.iteration = self.saved_iteration


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class _Process:
    """One child process whose output goes to a log file."""

    def __init__(self, cmd: list[str], log_file: Path, env: dict[str, str]) -> None:
        self.log_file = log_file
        self.preempted = False  # gone by the replay's doing, or fenced: not a failure
        with log_file.open("w") as out:
            out.write(" ".join(cmd) + "\n")
            out.flush()
            self.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def preempt(self, grace_seconds: float) -> None:
        """SIGTERM now, SIGKILL after the grace period (on a timer: the replay goes on)."""
        self.preempted = True
        self.signal(signal.SIGTERM)
        timer = threading.Timer(grace_seconds, self.signal, args=(signal.SIGKILL,))
        timer.daemon = True
        timer.start()

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            # SIGKILL is the instance going away with everything on it. torchrun starts each
            # worker in a session of its own, out of reach of the group's signal.
            gone_too = _descendants(self.popen.pid) if signum == signal.SIGKILL else []
            try:
                os.killpg(self.popen.pid, signum)
            except ProcessLookupError:
                pass
            for child in gone_too:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait()

    def tail(self, lines: int = 5) -> str:
        """The last lines of the log of this process, which has exited."""
        text = self.log_file.read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])


def _child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}


def analytic_prior(flags: list[str], model: str, workdir: Path) -> Path:
    """`parcae profile --analytic` of the training command, run as its workers run (one
    thread): the coordinator's prior when no profile is given."""
    path = workdir / "analytic-profile.json"
    command = [sys.executable, "-m", "megatron_parcae.cli", "profile", "--analytic", "--model", model,
               "--output", str(path), "--", *flags]
    done = subprocess.run(command, env=_child_env(), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ReplayError(f"`parcae profile --analytic` of the training command exited {done.returncode}: {last}")
    return path


def largest_world(command_args: list[str], model: str, available: int) -> int:
    """The most processes (<= available) the command's layout flags accept, or 0."""
    for world in range(available, 0, -1):
        try:
            parse_args(command_args, prog="replay", model=model, world_size=world)
            return world
        except ArgumentError:
            continue
    return 0


class Job(Protocol):
    log: JobLog

    def resize(self, count: int) -> None: ...
    def stop(self) -> None: ...
    def check(self) -> bool: ...


@dataclass(frozen=True)
class DeadlineSetting:
    """A replay with a deadline: train `iterations` within `hours` of the trace from its
    hour 0 (`Buyer`), buying spot and on-demand instances from `market` (prices per trace
    hour, start-up in trace hours); `on_demand`: whether the coordinator may buy them."""

    market: Market
    hours: float
    iterations: int
    speedup: float
    on_demand: bool = True

    def coordinator_config(self) -> dict:
        """The coordinator's pools, deadline and provisioner, on its clock (the wall's):
        prices per wall hour, so that its dollars are the trace's."""
        def wall(pool: Pool) -> dict:
            return {"name": pool.name, "market": pool.market, "gpus_per_instance": pool.gpus_per_instance,
                    "price": float(pool.price) * self.speedup, "max_count": pool.max_count,
                    "startup_hours": pool.startup_hours / self.speedup}

        return {"pools": [wall(self.market.spot), wall(self.market.on_demand)],
                "deadline": {"iterations": self.iterations, "hours": self.hours / self.speedup},
                **({"provisioner": {"backend": "emulator"}} if self.on_demand else {})}


class ParcaeJob:
    """The job under test with --parcae: coordinator, etcd and one worker per instance."""

    def __init__(self, script: str, command_args: list[str], workdir: Path, profile: Path, grace_seconds: float,
                 interval_seconds: float, max_instances: int, seed: int, gpus_per_instance: int = 1,
                 deadline: DeadlineSetting | None = None) -> None:
        from megatron_parcae.control.etcd import EtcdServer

        self.script, self.args, self.workdir = script, command_args, workdir
        self.grace_seconds = grace_seconds
        self.gpus_per_instance = gpus_per_instance
        self.log = JobLog()
        self.preemptions = self.arrivals = 0
        self._rng = random.Random(seed)
        self._workers: dict[int, _Process] = {}
        self._instances: dict[str, int] = {}  # the emulator provisioner's instances, by name
        self._next_id = 0
        self._initial = 0  # instances started at the first step (a deadline's replay): not arrivals
        self.job = f"replay-{os.getpid()}-{int(time.time())}"
        self.deadline = deadline
        self._server = EtcdServer().start()
        # The first plan does not wait for every initial instance: some may be preempted
        # before they have started (as in real traces), and joining later costs little.
        config = {"profile": str(profile.resolve()), "interval-seconds": interval_seconds, "lookahead": 8,
                  "grace-seconds": grace_seconds, "lease-seconds": LEASE_SECONDS,
                  "max-workers": max_instances * gpus_per_instance, "min-workers": 1,
                  "distributed-optimizer": "--use-distributed-optimizer" in command_args,
                  "gpus-per-instance": gpus_per_instance, **(deadline.coordinator_config() if deadline else {})}
        self._config_path = workdir / "coordinator.yaml"
        self._config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self._coordinators = 0
        try:
            self.start_coordinator()
            self.buyer = None if deadline is None else Buyer(self, deadline, self._server.endpoint, self.job)
            if self.buyer is not None:
                self.buyer.start(lambda: self._coordinator.popen.poll() is None)
        except BaseException:
            if self._coordinators:
                self._coordinator.kill()
            self._server.stop()
            raise

    def start_coordinator(self) -> None:
        """Start `parcae coordinator` (again: it goes on from what etcd holds); it writes
        the plans it publishes to coordinator-N.events.jsonl."""
        self._coordinators += 1
        name = f"coordinator-{self._coordinators}"
        self._coordinator = _Process(
            [sys.executable, "-m", "megatron_parcae.cli", "coordinator", "--etcd", self._server.endpoint,
             "--job", self.job, "--config", str(self._config_path),
             "--events", str(self.workdir / f"{name}.events.jsonl")], self.workdir / f"{name}.log", _child_env())

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (it holds nothing that etcd does not)."""
        self._coordinator.preempted = True
        self._coordinator.kill()

    def kill_worker(self, worker: int) -> None:
        """SIGKILL a worker without notice: an instance lost without warning."""
        self._workers[worker].preempted = True
        self._workers[worker].kill()

    def restart_etcd(self) -> None:
        """Stop etcd and start it again on the same data (every client reconnects)."""
        self._server.restart()

    @property
    def endpoint(self) -> str:
        """The job's etcd, HOST:PORT."""
        return self._server.endpoint

    def alive(self) -> list[int]:
        return sorted(w for w, p in self._workers.items() if not p.preempted and p.popen.poll() is None)

    def resize(self, count: int) -> None:
        if self.buyer is not None:  # the spot pool's capacity: its provisioner starts and preempts
            first = not self._next_id
            self.buyer.capacity(count)
            self._initial = self._next_id if first else self._initial
            return
        alive = self.alive()
        if count < len(alive):
            for worker in self._rng.sample(alive, len(alive) - count):
                self._workers[worker].preempt(self.grace_seconds)
                self.preemptions += 1
                self.log.event(f"preempt {'worker' if self.gpus_per_instance == 1 else 'instance'} {worker}", count)
        if self._workers:
            self.arrivals += max(0, count - len(alive))
        for _ in range(count - len(alive)):
            self._start_worker()

    def _start_worker(self, instance: str | None = None) -> int:
        """One instance: a worker with the next id, or a torchrun of G workers whose ids
        etcd hands out; named `instance` where the emulator's provisioner names it. Its index."""
        index, self._next_id = self._next_id, self._next_id + 1
        g = self.gpus_per_instance
        name = f"worker-{index}" if g == 1 else f"instance-{index}"
        self.log.event(f"start {name}", len(self.alive()) + 1)
        events = self.workdir / f"{name}.events.jsonl"
        flags = [*self.args, "--parcae", "--parcae-etcd", self._server.endpoint, "--parcae-job", self.job,
                 "--parcae-grace-seconds", str(self.grace_seconds), "--parcae-lease-seconds", str(LEASE_SECONDS),
                 "--parcae-events", str(events), *(["--parcae-instance", instance] if instance else [])]
        if g == 1:
            cmd = [sys.executable, self.script, *flags, "--parcae-worker-id", str(index)]
        else:  # torchrun must wait out the grace period after forwarding SIGTERM
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                   f"--nproc-per-node={g}", f"--shutdown-timeout={math.ceil(self.grace_seconds) + 5}",
                   "--log-dir", str(self.workdir / TORCHRUN_LOGS),
                   self.script, *flags, *([] if instance else ["--parcae-instance", name])]
        self.log.follow(events)
        self._workers[index] = _Process(cmd, self.workdir / f"{name}.log", _child_env())
        return index

    # provisioning/emulator.py's InstanceHost: instances its provisioner asks for, by name.

    def start_instance(self, name: str) -> None:
        self._instances[name] = self._start_worker(name)

    def stop_instance(self, name: str) -> None:
        index = self._instances.pop(name)
        self._workers[index].preempt(self.grace_seconds)
        self.preemptions += 1
        self.log.event(f"preempt instance {name}", len(self.alive()))

    def check(self) -> bool:
        """Whether training has ended (the coordinator exits then). Fails fast when a process
        dies on its own, not preempted: the replay would mean nothing."""
        self.log.poll()
        if self.buyer is not None:
            self.buyer.poll()
            self.arrivals = self._next_id - self._initial
        for worker, p in self._workers.items():
            code = p.popen.poll()
            if code == FENCED_EXIT and not p.preempted:  # it stalled, and the job went on without it
                p.preempted = True
                self.log.event(f"worker {worker} fenced", len(self.alive()))
            elif code not in (None, 0) and not p.preempted:
                raise ReplayError(f"worker {worker} exited with {code} (log {p.log_file}):\n{p.tail()}")
        code = self._coordinator.popen.poll()
        if code not in (None, 0) and not self._coordinator.preempted:
            raise ReplayError(f"the coordinator exited with {code}:\n{self._coordinator.tail()}")
        return code == 0

    def stop(self) -> None:
        """The replay is over: everything still running is killed at once (its etcd goes
        too, so nothing needs a graceful exit); what was trained counts."""
        if self.buyer is not None:
            self.buyer.close()
        processes = [self._coordinator, *self._workers.values()]
        for p in processes:
            p.signal(signal.SIGKILL)
        for p in processes:
            p.popen.wait()
        self._server.stop()
        self.log.poll()


class Buyer:
    """What the replay does for a job with a deadline (see the module docstring): the
    emulator's provisioner on the trace's clock, the coordinator's on-demand counts
    applied as they are published, dollars by pool.

    Trace hour 0 is when the coordinator started counting dollars (its cost record's
    `started_at`): its deadline's `hours` count from then, so the replay judges the same
    deadline that the coordinator plans for. The trace's first step follows within about
    an interval (the coordinator publishes its first cost record at its first boundary)."""

    def __init__(self, host, setting: DeadlineSetting, endpoint: str, job: str) -> None:
        from megatron_parcae.control.etcd import EtcdClient, JobStore

        self.setting = setting
        self.spot, self.on_demand = setting.market.spot.name, setting.market.on_demand.name
        pools = (setting.market.spot, setting.market.on_demand)
        self.emulator = EmulatorProvisioner(pools, host, self.hours)
        self.ledger = CostLedger({p.name: p for p in pools}, 0.0)  # on the trace's clock, in seconds
        self.started_at: float | None = None  # Unix time of trace hour 0: the coordinator's started_at
        self._started = 0.0  # monotonic, likewise
        self._fleet = False  # whether the spot fleet was asked for (at the first step)
        self._client = EtcdClient(endpoint)
        self._store = JobStore(self._client, job)
        self._decided_at = 0.0  # of the newest record applied
        self.provisioned: list[dict] = []  # each change of the on-demand count, in trace hours

    def start(self, alive: Callable[[], bool], timeout_seconds: float = COORDINATOR_START_SECONDS) -> None:
        """Wait for the coordinator's first cost record and take its clock. ReplayError when
        the coordinator exits or publishes none within `timeout_seconds`."""
        give_up = time.monotonic() + timeout_seconds
        while True:
            try:
                record = self._store.cost()
            except Exception as exc:  # noqa: BLE001 - SchemaError or EtcdError: the replay means nothing then
                raise ReplayError(f"the coordinator's cost record: {exc}") from None
            if record is not None:
                break
            if not alive():
                raise ReplayError("the coordinator exited before it counted any dollars (see its log)")
            if time.monotonic() > give_up:
                raise ReplayError(f"the coordinator published no cost record within {timeout_seconds:g} s")
            time.sleep(0.1)
        self.started_at = record.started_at
        self._started = time.monotonic() - (time.time() - record.started_at)

    def hours(self) -> float:
        """Trace hours since the coordinator started counting (0 before `start`)."""
        if self.started_at is None:
            return 0.0
        return (time.monotonic() - self._started) * self.setting.speedup / 3600

    def trace_hours(self, at: float) -> float:
        """The trace hour of the Unix time `at`."""
        return (at - (self.started_at or at)) * self.setting.speedup / 3600

    def capacity(self, count: int) -> None:
        """A step of the trace: the spot instances the market allows from now on. The fleet
        asks for the spot pool's max count at the first."""
        self._pay()
        self.emulator.set_capacity(self.spot, count)
        if not self._fleet:
            self._fleet = True
            self.emulator.request(self.spot, self.setting.market.spot.max_count)

    def poll(self) -> None:
        """Apply a newly published on-demand count; start the instances whose start-up is over."""
        if self.started_at is None:
            return
        self._pay()
        if self.setting.on_demand:
            try:
                record = self._store.provisioning()
            except Exception as exc:  # noqa: BLE001 - SchemaError or EtcdError: the replay means nothing then
                raise ReplayError(f"the coordinator's provisioning record: {exc}") from None
            if record is not None and record.decided_at != self._decided_at and self.on_demand in record.wanted:
                self._decided_at = record.decided_at
                held, wanted = self.emulator.held(self.on_demand), record.wanted[self.on_demand]
                names = self.emulator.apply({self.on_demand: wanted}).get(self.on_demand, [])
                self.provisioned.append({"trace_hours": round(self.hours(), 4), "pool": self.on_demand,
                                         "held": held, "wanted": wanted, "instances": names,
                                         "reason": record.reason})
        self.emulator.step()

    def _pay(self) -> None:
        """Pay what was held since the last count: spot instances while they run,
        on-demand ones from their request (start-up included) until given back."""
        self.ledger.advance(self.hours() * 3600, {self.spot: len(self.emulator.running(self.spot)),
                                                  self.on_demand: self.emulator.held(self.on_demand)})

    def close(self) -> None:
        self._pay()
        self._client.close()


class CheckpointRestartJob:
    """Reactive checkpoint-restart: restart torchrun from the last checkpoint on every change."""

    def __init__(self, script: str, command_args: list[str], workdir: Path, save_interval: int,
                 grace_seconds: float, gpus_per_instance: int = 1) -> None:
        self.script = script
        self.model = "bert" if "bert" in Path(script).name else "gpt"
        self.args = command_args
        self.checkpoint_dir = workdir / "checkpoints"
        self.workdir = workdir
        self.save_interval = save_interval
        self.grace_seconds = grace_seconds
        self.gpus_per_instance = gpus_per_instance
        self.log = JobLog()
        self.preemptions = self.arrivals = 0
        self._instances = 0
        self._proc: _Process | None = None
        self._restarts = 0

    def resize(self, count: int) -> None:
        self.log.event("restart", count)
        self.preemptions += max(0, self._instances - count)
        self.arrivals += max(0, count - self._instances) if self._instances else 0
        self._instances = count
        self._kill()
        world = largest_world(self.args, self.model, count * self.gpus_per_instance)
        if world == 0:
            return
        resume = ["--load", str(self.checkpoint_dir)] if (self.checkpoint_dir / "latest_checkpointed_iteration.txt").exists() else []
        events = self.workdir / f"torchrun-{self._restarts + 1}.events.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "--log-dir", str(self.workdir / TORCHRUN_LOGS), self.script, *self.args, "--save", str(self.checkpoint_dir),
               "--save-interval", str(self.save_interval), *resume, "--parcae-events", str(events)]
        self.log.follow(events)
        args = parse_args(self.args, prog="replay", model=self.model, world_size=world)
        self.log.changes.append({"at_seconds": self.log.seconds(), "iteration": self.log.saved_iteration,
                                 "generation": self._restarts + 1, "kind": "restart", "layout": [args.tensor_model_parallel_size,
                                                               args.pipeline_model_parallel_size, args.data_parallel_size],
                                 "seconds": None, "lost_steps": 0})
        self._restarts += 1
        self._proc = _Process(cmd, self.workdir / f"torchrun-{self._restarts}.log", _child_env())

    def _kill(self) -> None:
        """Preempt every process of the job: SIGTERM, SIGKILL after the grace period; what
        was trained since the last checkpoint is lost."""
        if self._proc is None:
            return
        self._proc.signal(signal.SIGTERM)
        try:
            self._proc.popen.wait(self.grace_seconds)
        except subprocess.TimeoutExpired:
            pass
        self._proc.kill()
        self._proc = None
        self.log.poll()
        if self.log.changes:
            self.log.changes[-1]["lost_steps"] = self.log.iteration - self.log.saved_iteration
        self.log.rollback_to_checkpoint()

    def check(self) -> bool:
        """Whether training has ended; fails fast when torchrun exits with an error we did not cause."""
        self.log.poll()
        p = self._proc
        if p is not None and p.popen.poll() not in (None, 0):
            raise ReplayError(f"the training command exited with {p.popen.returncode} (log {p.log_file}):\n{p.tail()}")
        return p is not None and p.popen.poll() == 0

    def stop(self) -> None:
        """End of the replay: what the job has trained so far counts."""
        if self._proc is not None:
            self._proc.kill()
        self.log.poll()


def replay(steps: list[ReplayStep], job: Job, duration_seconds: float, progress: Progress | None = None,
           speedup: float = 1.0) -> float:
    """Drive `job` through the steps in wall-clock time, until the trace or the training
    ends; returns the seconds it took. `progress` shows where the replay is."""
    start = time.monotonic()
    if progress is not None:
        progress.status = lambda _: replay_status(steps, job.log, time.monotonic() - start, duration_seconds, speedup)
    try:
        for step in steps:
            if _sleep_checking(job, start + step.at_seconds):
                break
            job.resize(step.count)
        else:
            _sleep_checking(job, start + duration_seconds)
    finally:
        job.stop()
    return time.monotonic() - start


def replay_status(steps: list[ReplayStep], log: JobLog, wall: float, duration_seconds: float, speedup: float) -> str:
    """Where a replay is, `wall` seconds in: trace time, instances, the layout the
    workers last reported, samples trained, layout changes and the time left."""
    instances = next((s.count for s in reversed(steps) if s.at_seconds <= wall), 0)
    changes = log.changes
    layout = "T{}P{}D{}".format(*changes[-1]["layout"]) if changes else "none yet"
    return (f"trace {hms(min(wall, duration_seconds) * speedup)}/{hms(duration_seconds * speedup)}, "
            f"instances {instances}, layout {layout}, samples {log.trained_samples}, changes {len(changes)}, "
            f"{hms(max(0.0, duration_seconds - wall))} left")


def _sleep_checking(job: Job, until: float) -> bool:
    """Sleep until `until`, watching the job; True as soon as its training has ended."""
    while (left := until - time.monotonic()) > 0:
        if job.check():
            return True
        time.sleep(min(0.5, left))
    return job.check()


# -- summary ---------------------------------------------------------------------------


@dataclass
class ReplaySummary:
    """What a replay achieved; `samples` is the figure the comparison is about."""

    mode: str
    trace: str
    hours: list[float]
    speedup: float
    grace_seconds: float
    max_instances: int
    gpus_per_instance: int
    wall_seconds: float
    samples: int
    iterations: int
    final_loss: float | None
    lost_steps: int
    preemptions: int
    arrivals: int
    seconds_per_layout: dict[str, float]
    changes: list[dict]
    events: list[dict]
    progress: list[list[float]]
    losses: dict[int, float]
    # The trace runs `speedup` times faster than the wall clock but restarts and migrations
    # do not: their cost in trace seconds, against a planning interval, says how much the
    # compression favours the cheaper one.
    mean_change_seconds: float | None  # wall seconds: parcae's migrations, the baseline's restarts (a lower bound
    # when one was cut short: no step before the next change)
    mean_change_trace_seconds: float | None
    change_to_interval: float | None  # mean change / INTERVAL_TRACE_SECONDS, both in trace seconds
    samples_per_second: dict[str, float]  # measured per layout, between its first and last steps
    ideal_samples: int | None = None  # see `IdealThroughput`
    live_to_ideal: float | None = None
    profile_scale: float | None = None  # measured / profiled samples/s over the layouts this run trained with
    # By layout the coordinator ran for PREDICTION_INTERVALS intervals: what it then predicted
    # an iteration takes, the median the workers logged, and the relative error.
    predicted_vs_measured: dict[str, dict[str, float]] = field(default_factory=dict)
    # With a deadline (DeadlineSetting), in trace hours from the first step: when the last
    # iteration was logged (None: not reached), dollars by pool, each on-demand change.
    deadline_hours: float | None = None
    finish_hours: float | None = None
    met_deadline: bool | None = None
    dollars: dict[str, float] | None = None
    provisioned: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, mode: str, job: Job, wall_seconds: float, **setting) -> ReplaySummary:
        log = job.log
        stretches = list(zip(log.changes, [*log.changes[1:], None]))
        for change, following in stretches:  # a restart's time: until its first step, or the next change
            if change["seconds"] is None:
                end = wall_seconds if following is None else following["at_seconds"]
                after = [t for t, _ in log.progress if change["at_seconds"] < t <= end]
                change["seconds"] = round((after[0] if after else end) - change["at_seconds"], 3)
                change["cut_short"] = not after
        per_layout: dict[str, float] = {}
        measured: dict[str, tuple[float, float]] = {}  # samples, seconds
        for change, following in stretches:
            end = wall_seconds if following is None else following["at_seconds"]
            key = "T{}P{}D{}".format(*change["layout"])
            per_layout[key] = round(per_layout.get(key, 0.0) + max(0.0, end - change["at_seconds"]), 3)
            steps = [(t, n) for t, n in log.progress if change["at_seconds"] < t <= end]
            if len(steps) >= 2:  # from the first step on: the change itself is not throughput
                samples, seconds = measured.get(key, (0.0, 0.0))
                measured[key] = (samples + steps[-1][1] - steps[0][1], seconds + steps[-1][0] - steps[0][0])
        counted = [c["seconds"] for c in log.changes
                   if c["seconds"] is not None and (c["kind"] != "restart" or mode != "parcae")]
        mean = sum(counted) / len(counted) if counted else None
        speedup = setting["speedup"]
        return cls(mode=mode, wall_seconds=round(wall_seconds, 3), samples=log.trained_samples if log.iteration else 0,
                   iterations=log.iteration, final_loss=log.loss, lost_steps=log.lost_steps,
                   preemptions=job.preemptions, arrivals=job.arrivals, seconds_per_layout=per_layout,
                   changes=log.changes, events=log.events, progress=[list(p) for p in log.progress],
                   losses=dict(sorted(log.losses.items())),
                   mean_change_seconds=None if mean is None else round(mean, 3),
                   mean_change_trace_seconds=None if mean is None else round(mean * speedup, 1),
                   change_to_interval=None if mean is None else round(mean * speedup / INTERVAL_TRACE_SECONDS, 3),
                   samples_per_second={k: round(n / s, 2) for k, (n, s) in measured.items() if s > 0}, **setting)

    def with_predictions(self, workdir: Path, step_seconds: dict[str, list[float]]) -> None:
        """Check the coordinator's learned throughput (its `throughput_learned` events in
        `workdir`) against the step times the workers logged, per layout."""
        predicted: dict[str, float] = {}
        for path in sorted(workdir.glob("coordinator-*.events.jsonl")):
            for event in read_events(path):
                key = f"T{event.tp}P{event.pp}D{event.dp}" if isinstance(event, ThroughputLearned) else None
                if key and event.intervals >= PREDICTION_INTERVALS and key not in predicted:
                    predicted[key] = event.predicted_seconds
        for key, seconds in sorted(predicted.items()):
            if step_seconds.get(key):
                median = statistics.median(step_seconds[key])
                self.predicted_vs_measured[key] = {"predicted_seconds": round(seconds, 4),
                                                   "measured_median_seconds": round(median, 4),
                                                   "error": round(seconds / median - 1, 3)}

    def with_deadline(self, buyer: Buyer, log: JobLog) -> None:
        """Whether the run trained its iterations by the deadline, and what it paid by pool."""
        setting = buyer.setting
        done = [t for (iteration, _), (t, _) in zip(log.trained, log.progress) if iteration >= setting.iterations]
        self.deadline_hours = setting.hours
        self.finish_hours = round(buyer.trace_hours(log.started + done[0]), 4) if done else None
        self.met_deadline = self.finish_hours is not None and self.finish_hours <= setting.hours
        self.dollars = {pool: round(dollars, 2) for pool, dollars in buyer.ledger.dollars.items()}
        self.provisioned = list(buyer.provisioned)

    def deadline_line(self) -> str:
        """'parcae: $12.34 (spot $5.00, on-demand $7.34); deadline 1.5 h met: finished at 1.32 h'."""
        pools = ", ".join(f"{pool} ${dollars:,.2f}" for pool, dollars in self.dollars.items())
        finish = "not finished" if self.finish_hours is None else f"finished at {self.finish_hours:.2f} h"
        asked = sum(p["wanted"] > p["held"] for p in self.provisioned)
        return (f"{self.mode}: ${sum(self.dollars.values()):,.2f} ({pools}); deadline {self.deadline_hours:g} h "
                f"{'met' if self.met_deadline else 'missed'}: {finish}; on-demand counts changed "
                f"{len(self.provisioned)} times ({asked} up, {len(self.provisioned) - asked} down)")

    def with_ideal(self, ideal: IdealThroughput, steps: list[ReplayStep], duration_seconds: float) -> None:
        """The simulator's `ideal` policy on this replay's exact steps: every change free,
        always the best layout for the instances available, at this run's throughput (`best`)."""
        scale = ideal.scale(self)
        end = min(self.wall_seconds, duration_seconds)
        samples = 0.0
        for step, following in zip(steps, [*steps[1:], None]):
            until = end if following is None else min(end, following.at_seconds)
            best = ideal.best(step.count * self.gpus_per_instance, self.samples_per_second, scale)
            samples += best * max(0.0, until - step.at_seconds)
        self.profile_scale = round(scale, 4)
        self.ideal_samples = round(samples)
        self.live_to_ideal = round(self.samples / samples, 3) if samples else None

    def table_rows(self) -> list[tuple[str, str]]:
        return [
            ("samples trained", f"{self.samples}"),
            ("ideal samples", "-" if self.ideal_samples is None else f"{self.ideal_samples}"),
            ("live / ideal", "-" if self.live_to_ideal is None else f"{self.live_to_ideal:.2f}"),
            ("iterations", f"{self.iterations}"),
            ("final loss", "-" if self.final_loss is None else f"{self.final_loss:.4f}"),
            ("preemptions / arrivals", f"{self.preemptions} / {self.arrivals}"),
            ("layout changes", f"{len(self.changes)}"),
            ("mean change s (wall)", _number(self.mean_change_seconds, 2)),
            ("mean change s (trace)", _number(self.mean_change_trace_seconds, 1)),
            ("change / interval", _number(self.change_to_interval, 2)),
            ("lost steps", f"{self.lost_steps}"),
            ("wall seconds", f"{self.wall_seconds:.0f}"),
            (f"predicted/measured step ({PREDICTION_INTERVALS} int.)",
             ", ".join(f"{k} {v['error']:+.0%}" for k, v in self.predicted_vs_measured.items()) or "-"),
            *(() if self.dollars is None else (
                ("dollars", f"{sum(self.dollars.values()):,.2f}"),
                *((f"dollars {pool}", f"{dollars:,.2f}") for pool, dollars in self.dollars.items()),
                ("finish h (trace)", _number(self.finish_hours, 2)),
                (f"deadline {self.deadline_hours:g} h", "met" if self.met_deadline else "missed"))),
        ]


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


class IdealThroughput:
    """The coordinator's throughput model (its profile, on instances of G GPUs), to be
    scaled per run so that, over the layouts the run trained with, it predicts the samples
    the run measured: a run's ideal then differs from it by the changes alone, not by a
    profile of another machine or by the load the run met."""

    def __init__(self, profile: Path, max_workers: int, gpus_per_instance: int):
        from megatron_parcae.liveput import CostConstants, build_liveput
        from megatron_parcae.liveput.cost import DEFAULT_CONSTANTS

        self.model = build_liveput(profile, CostConstants.load(DEFAULT_CONSTANTS), lookahead=1,
                                   distributed_optimizer=False, max_workers=max_workers,
                                   gpus_per_instance=gpus_per_instance).throughput
        self.profiled = {_layout_key(p): self.model.samples_per_second(p)
                         for p in self.model.layouts()}

    def scale(self, summary: ReplaySummary) -> float:
        """Measured over profiled samples, over the seconds each layout of `summary` ran."""
        ran = [k for k in summary.samples_per_second if self.profiled.get(k)]
        profiled = sum(self.profiled[k] * summary.seconds_per_layout[k] for k in ran)
        measured = sum(summary.samples_per_second[k] * summary.seconds_per_layout[k] for k in ran)
        return measured / profiled if profiled else 0.0

    def best(self, workers: int, measured: dict[str, float], scale: float) -> float:
        """The samples/s of the best layout on `workers` workers: what the run measured of
        each layout it ran, the profile's figure times `scale` for the others. A profile's
        ranking can be wrong for this machine (the analytic prior's is on 2 cores, where 4
        processes train slower than 2): the run's own figures decide where it has them."""
        keys = (_layout_key(p) for p in self.model.fitting(workers))
        return max((measured.get(k) or self.profiled[k] * scale for k in keys), default=0.0)


def _layout_key(p) -> str:
    """How the summary names a layout: 'T1P2D4'."""
    return f"T{p.tp}P{p.pp}D{p.dp}"


def side_by_side(summaries: list[ReplaySummary]) -> str:
    rows = [s.table_rows() for s in summaries]
    width = max(len(name) for name, _ in rows[0])
    lines = [f"{'':{width}}  " + "  ".join(f"{s.mode:>20}" for s in summaries)]
    for i, (name, _) in enumerate(rows[0]):
        lines.append(f"{name:{width}}  " + "  ".join(f"{r[i][1]:>20}" for r in rows))
    return "\n".join(lines)


def plot(summaries: list[ReplaySummary], steps: list[ReplayStep], path: Path) -> None:
    """Timeline: instances available, and samples trained by each job, over wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    end = max(s.wall_seconds for s in summaries)
    xs = [s.at_seconds for s in steps] + [end]
    top.step(xs, [s.count for s in steps] + [steps[-1].count], where="post", color="black")
    top.set_ylabel("instances")
    for s in summaries:
        line, = bottom.plot([p[0] for p in s.progress], [p[1] for p in s.progress], label=s.mode)
        for change in s.changes:
            bottom.axvline(change["at_seconds"], color=line.get_color(), alpha=0.25, linewidth=1)
    bottom.set_xlabel("wall seconds")
    bottom.set_ylabel("samples trained")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- command line ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="availability trace (any format of predictor.traces)")
    parser.add_argument("--start-hour", type=float, default=0.0, help="replay from this hour of the trace")
    parser.add_argument("--end-hour", type=float, default=None, help="default: the end of the trace")
    parser.add_argument("--max-instances", type=int, required=True,
                        help="scale the trace so that its peak is this many instances")
    parser.add_argument("--gpus-per-instance", type=int, default=1,
                        help="processes (GPUs) per instance: each instance is then one torchrun of that many, "
                             "preempted whole (default 1: one process, no torchrun)")
    parser.add_argument("--speedup", type=float, default=1.0, help="trace seconds per wall-clock second")
    parser.add_argument("--grace-seconds", type=float, default=10.0,
                        help="wall-clock seconds between SIGTERM and SIGKILL of a preempted instance")
    parser.add_argument("--profile", type=Path, default=None,
                        help="the coordinator's prior: the model's layer profile (parcae profile) or throughput CSV; "
                             "default: `parcae profile --analytic` of the training command, corrected online")
    parser.add_argument("--baseline", choices=BASELINES, default=None,
                        help="then replay the same trace with this baseline and compare: checkpoint-restart "
                             "(torchrun restarted from its last checkpoint on every change) or spot-only (with "
                             "--deadline-hours: the same job, no on-demand instances); default: none")
    parser.add_argument("--save-interval", type=int, default=20, help="the baseline's checkpoint interval (iterations)")
    parser.add_argument("--seed", type=int, default=0, help="which instances the preemptions hit")
    parser.add_argument("--workdir", type=Path, default=Path("replay"), help="logs, checkpoints, configs")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument("--plot", type=Path, default=None, help="write a timeline PNG here")
    deadline = parser.add_argument_group("a deadline, bought from a spot and an on-demand pool")
    deadline.add_argument("--deadline-hours", type=float, default=None, metavar="H",
                          help="trace hours from the coordinator's start of counting (the trace's first step "
                               "follows at once) by which the training command's --train-iters must be done: the "
                               "job then runs a spot fleet of --max-instances and the on-demand instances the "
                               "coordinator's deadline policy asks for, and the summary gives dollars by pool and "
                               "whether it met the deadline (default: none, no pools)")
    deadline.add_argument("--spot-price", type=float, default=0.918, metavar="DOLLARS",
                          help="dollars per spot instance and trace hour (default 0.918)")
    deadline.add_argument("--on-demand-price", type=float, default=3.06, metavar="DOLLARS",
                          help="dollars per on-demand instance and trace hour (default 3.06)")
    deadline.add_argument("--startup-hours", type=float, default=0.1, metavar="H",
                          help="trace hours from an on-demand instance's request until its workers start, "
                               "paid (default 0.1)")
    deadline.add_argument("--on-demand-max", type=int, default=None, metavar="N",
                          help="most on-demand instances at once (default: --max-instances)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the training script and its flags (without --parcae)")


def _deadline(args: argparse.Namespace, iterations: int) -> DeadlineSetting | None:
    """The replay's deadline and pools (None without --deadline-hours)."""
    if args.deadline_hours is None:
        if args.baseline == "spot-only":
            raise ValueError("--baseline spot-only needs --deadline-hours")
        return None
    if not (math.isfinite(args.deadline_hours) and args.deadline_hours > 0):
        raise ValueError(f"--deadline-hours must be positive, got {args.deadline_hours}")
    on_demand_max = args.max_instances if args.on_demand_max is None else args.on_demand_max
    g = args.gpus_per_instance
    market = Market(Pool("spot", "spot", g, args.spot_price, args.max_instances),
                    Pool("on-demand", "on-demand", g, args.on_demand_price, on_demand_max, args.startup_hours))
    return DeadlineSetting(market, args.deadline_hours, iterations, args.speedup)


def _training_command(args: argparse.Namespace) -> tuple[str, list[str], str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not command[0].endswith(".py"):
        raise ValueError("give the training command after --, e.g. -- scripts/pretrain_gpt.py --config configs/gpt-tiny.yaml")
    script, flags = command[0], command[1:]
    if not Path(script).is_file():
        raise ValueError(f"training script {script} does not exist")
    if any(f == "--parcae" or f.startswith("--parcae-") for f in flags):
        raise ValueError("leave --parcae and --parcae-* out of the training command: the emulator adds them")
    model = "bert" if "bert" in Path(script).name else "gpt"
    try:
        parse_args(flags, prog=script, model=model, world_size=1)
    except ArgumentError as exc:
        raise ValueError(f"training command: {exc}") from None
    return script, flags, model


_MARKER = ".parcae-replay"


def fresh_workdir(path: Path) -> None:
    """Empty `path` for a new replay (a baseline must not resume an earlier replay's
    checkpoints); only a folder an earlier replay made is emptied."""
    if path.exists():
        if not (path / _MARKER).is_file() and any(path.iterdir()):
            raise ValueError(f"--workdir: {path} exists and was not made by parcae replay; choose another --workdir")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / _MARKER).write_text("made by parcae replay; emptied by the next replay\n")


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM or SIGHUP ends the program as Ctrl-C does: the job's processes are stopped.
    Further signals are ignored while that happens, so the clean-up is not cut short."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def interrupt_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt, so that a program driving jobs
    (replay, the chaos benchmark) stops the processes it started on any of them."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


@contextmanager
def children_temporary_folder(prefix: str) -> Iterator[Path]:
    """Give the processes started inside (through os.environ) a temporary folder of their
    own, removed on the way out: a killed process cannot remove the folders it made
    (wandb's and multiprocessing's, which every training process makes), and a program
    that kills its processes on purpose would otherwise leave them in /tmp."""
    before = os.environ.get("TMPDIR")
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as folder:
        os.environ["TMPDIR"] = folder
        try:
            yield Path(folder)
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before


def run(args: argparse.Namespace) -> int:
    prog = "parcae replay"
    interrupt_on_signals()
    try:
        with children_temporary_folder("parcae-replay-"):
            return _replay_and_compare(args, prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every process it started is stopped", file=sys.stderr, flush=True)
        return 130


def _replay_and_compare(args: argparse.Namespace, prog: str) -> int:
    from predictor.traces import AvailabilityTrace, TraceFormatError

    try:
        if args.max_instances < 1:
            raise ValueError("--max-instances must be at least 1")
        if not 1 <= args.gpus_per_instance <= MAX_GPUS_PER_INSTANCE:
            raise ValueError(f"--gpus-per-instance must be from 1 to {MAX_GPUS_PER_INSTANCE}")
        if not args.grace_seconds >= 0:
            raise ValueError("--grace-seconds must be >= 0")
        script, flags, model = _training_command(args)
        if args.profile is not None and not args.profile.is_file():
            raise ValueError(f"--profile: no file {args.profile} (make one with `parcae profile`, or leave it out)")
        trace = AvailabilityTrace.load(args.trace)
        end = args.end_hour if args.end_hour is not None else trace.duration_seconds / 3600.0
        segment = trace.cut(args.start_hour, end).scale(args.max_instances)
        steps = replay_steps(segment, args.speedup)
        deadline = _deadline(args, parse_args(flags, prog=script, model=model, world_size=1).train_iters)
    except (ValueError, TraceFormatError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    duration = segment.duration_seconds / args.speedup
    setting = dict(trace=str(args.trace), hours=[args.start_hour, end], speedup=args.speedup,
                   grace_seconds=args.grace_seconds, max_instances=args.max_instances,
                   gpus_per_instance=args.gpus_per_instance)

    def parcae_job(on_demand: bool) -> Callable[[Path], Job]:
        return lambda d: ParcaeJob(
            script, flags, d, args.profile or analytic_prior(flags, model, d), args.grace_seconds, 60.0 / args.speedup,
            args.max_instances, args.seed, args.gpus_per_instance,
            None if deadline is None else dataclasses.replace(deadline, on_demand=on_demand))

    runs: list[tuple[str, Callable[[Path], Job]]] = [("parcae", parcae_job(True))]
    if args.baseline == "spot-only":
        runs.append(("spot-only", parcae_job(False)))
    if args.baseline == "checkpoint-restart":
        runs.append(("checkpoint-restart", lambda d: CheckpointRestartJob(
            script, flags, d, args.save_interval, args.grace_seconds, args.gpus_per_instance)))
    summaries = []
    for mode, make_job in runs:
        workdir = args.workdir / mode
        try:
            fresh_workdir(workdir)
        except ValueError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        print(f"{prog}: {mode}: {len(steps)} availability changes over {duration:.0f} s (logs in {workdir})", flush=True)
        try:
            with Progress(f"{prog}: {mode}") as progress:
                progress.update("starting the job")
                job = make_job(workdir)
                wall = replay(steps, job, duration, progress, args.speedup)
        except ReplayError as exc:
            print(f"{prog}: error: {mode}: {exc}", file=sys.stderr)
            return 1
        summaries.append(ReplaySummary.of(mode, job, wall, **setting))
        if isinstance(job, ParcaeJob):
            summaries[-1].with_predictions(workdir, job.log.step_seconds)
            if job.buyer is not None:
                summaries[-1].with_deadline(job.buyer, job.log)
    coordinator_profile = Path(json.loads((args.workdir / "parcae" / "coordinator.yaml").read_text())["profile"])
    ideal = IdealThroughput(coordinator_profile, args.max_instances * args.gpus_per_instance, args.gpus_per_instance)
    for summary in summaries:
        summary.with_ideal(ideal, steps, duration)
    print(side_by_side(summaries), flush=True)
    measured = "; ".join(f"{s.mode} " + ", ".join(f"{k} {v:.1f} (profile {ideal.profiled.get(k, 0.0):.1f})"
                                                   for k, v in sorted(s.samples_per_second.items()))
                         for s in summaries)
    print(f"ideal: every change free, always the best layout for the instances available, at the samples/s "
          f"each run measured of the layouts it ran, the profile's scaled to them for the others ({measured}); "
          f"trace seconds are wall x {args.speedup:g}, "
          f"an interval is {INTERVAL_TRACE_SECONDS:g} trace s", flush=True)
    for summary in summaries:
        if summary.dollars is not None:
            print(summary.deadline_line(), flush=True)
    result: dict = {s.mode: asdict(s) for s in summaries}
    if args.baseline == "checkpoint-restart":
        result["restart_to_interval"] = summaries[1].change_to_interval
        print(f"{summaries[1].mode}: a restart is {_number(summaries[1].change_to_interval, 2)} of an interval "
              f"(Parcae measured 29-43 s restarts against 60 s intervals: 0.48-0.72)", flush=True)
    if args.baseline == "checkpoint-restart" and summaries[1].samples:
        result["ratio"] = round(summaries[0].samples / summaries[1].samples, 3)
        print(f"parcae / {summaries[1].mode} samples: {result['ratio']:.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(summaries, steps, args.plot)
    return 0
