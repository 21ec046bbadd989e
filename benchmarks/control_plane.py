"""The control plane at scale: etcd, `parcae coordinator` and N agents, without training
(issue 18, acceptance 3: at 1,024 instances on 2 cores, notice to plan under 2 s p99,
and every agent acknowledging a plan within 5 s p99).

    python -m benchmarks.control_plane --instances 128 --json control_plane_128.json
    python -m benchmarks.control_plane --instances 1024 --json control_plane_1024.json

It starts a real etcd (`EtcdServer`), the `parcae coordinator` process (a GPT-1.5B layer
profile, one GPU per instance, the workers' default grace period; interval 60 s), and N
instances: real `ParcaeAgent`s, `--agents-per-process` of them to a process sharing one
etcd client, with no torch and no training. Each agent does what a worker's does
(registration, lease keep-alive, the plan watch, acknowledgements; step reports from the
layout's workers, a progress record from its rank 0, sent when due) and acknowledges a plan
at its next tick, as a worker does at its next iteration boundary. Once every instance
has acknowledged the first plan, rounds of:
- notice: `--batch` instances of the layout get a preemption notice (`ParcaeAgent.notify`,
  the path of a cloud's metadata watcher); they acknowledge the plan that drops them,
  hand over for a second and leave;
- kill: a process of `--batch` agents of the layout is SIGKILLed; their leases lapse;
- arrival: a process of `--batch` new agents starts;
each followed by the plans it brings, until every agent still registered acknowledged
them and no plan came for a while.

Measured from the typed records in etcd, ordered by revision (a watch on the members,
notices and plans): `notice_to_plan_ms`, from a notice's `received_at` to the
`created_at` of the first plan without that worker; `plan_to_ack_ms`, from a plan's
`created_at` to the member record of each agent registered then showing it (an agent
that leaves first counts as gone, not as acknowledged); `plan_to_all_acked_ms`, per plan.
The coordinator's CPU time (psutil, over the rounds) and peak RSS (VmHWM), etcd's
requests per second (RPCs started, from its /metrics) and database size. Exits 1 when
an agent failed to acknowledge a plan or the run failed; timings against the targets
are printed, not enforced.

The agents stand for a thousand machines on two cores: the leases of an agent process
are kept alive on its client's one keep-alive stream (etcd/keepalive.py), a request per
lease every third of its TTL, so the workers' default 10 s lease holds at 1,024.

`python -m benchmarks.control_plane host ...` is one agent process: JSON-lines commands
on stdin, JSON-lines events on stdout (started by the benchmark, not by hand).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import math
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from benchmarks import provenance

if TYPE_CHECKING:
    from megatron_parcae.control.etcd import EtcdClient, EtcdServer, JobKeys

REPO = Path(__file__).resolve().parents[1]
TICK_S = 0.1  # an agent process looks for new plans this often (a worker: at every iteration)
# Hundreds of agent threads share an agent process's GIL; each thread waiting for it wakes
# every switch interval (5 ms by default), which on 2 cores costs more than the agents' work.
SWITCH_INTERVAL_S = 0.05
HANDOVER_S = 1.0  # a noticed agent leaves this long after acknowledging the plan that drops it
QUIET_S = 1.5  # a round ends once its plans are acknowledged and none came for this long
PLAN_WAIT_S = 30.0  # beyond a lease period, how long a notice or a kill may wait for its plan
ACK_WAIT_S = 60.0  # how long the agents may take to acknowledge a plan before the run fails
SAMPLES_PER_STEP = 1024  # the profile's global batch: what the progress records count
INTERVAL_S = 60  # the coordinator's interval (a minute, as the cost constants')
TARGETS_MS = {"notice_to_plan_p99": 2000.0, "plan_to_ack_p99": 5000.0}
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None)  # loaded before fork: a child only calls prctl before exec


class BenchmarkError(RuntimeError):
    """The run cannot go on; the message says why."""


def _die_with_parent(signum: int) -> None:
    """Ask Linux to send `signum` to this process when the thread that started it exits."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signum)


# -- agent processes -----------------------------------------------------------------


def host(argv: list[str]) -> int:
    """One process of agents: commands on stdin, events on stdout (JSON lines).

    {"op": "start", "workers": [...]} registers agents (-> {"event": "started", ...});
    {"op": "notice", "workers": [...]} gives them a notice. Noticed agents leave once
    a plan drops them (-> "left"); an agent whose lease was lost stops (-> "fenced").
    The end of stdin ends the process at once: its leases lapse, as on a lost instance.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.control_plane host")
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--lease-seconds", type=float, required=True)
    parser.add_argument("--grace-seconds", type=float, required=True)
    parser.add_argument("--step-seconds", type=float, required=True)
    parser.add_argument("--parent", type=int, required=True, help="the benchmark's pid")
    args = parser.parse_args(argv)
    _die_with_parent(signal.SIGKILL)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if os.getppid() != args.parent:  # the benchmark died before the line above
        return 1
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    from megatron_parcae.control.agent import ParcaeAgent
    from megatron_parcae.control.etcd import EtcdClient

    commands: queue.SimpleQueue[dict | None] = queue.SimpleQueue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(json.loads(line))
        commands.put(None)

    def emit(event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)

    threading.Thread(target=read_commands, daemon=True).start()
    client = EtcdClient(args.etcd, timeout=10)
    agents: dict[int, ParcaeAgent] = {}
    noticed: set[int] = set()
    leave_at: dict[int, float] = {}
    # the newest plan acknowledged: its generation, its slots (slots[0] is rank 0) and their workers
    layout_of, slots, placed = 0, [], frozenset()
    iteration, next_step = 0, time.monotonic()
    while True:
        while not commands.empty():
            command = commands.get()
            if command is None:
                os._exit(0)
            if command["op"] == "start":
                for worker in command["workers"]:
                    agent = ParcaeAgent(client, args.job, worker, args.grace_seconds, args.lease_seconds,
                                        instance=f"bench-{worker}")
                    agent.start()
                    agents[worker] = agent
                signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # each start() took SIGTERM
                emit("started", workers=command["workers"])
            elif command["op"] == "notice":
                for worker in command["workers"]:
                    agents[worker].notify("benchmark", time.time() + args.grace_seconds)
                    noticed.add(worker)
                    if worker not in placed:  # on standby: nothing to hand over
                        leave_at[worker] = time.monotonic()
        now = time.monotonic()
        step = now >= next_step
        if step:
            iteration += 1
            next_step = max(next_step + args.step_seconds, now)
        for worker, agent in list(agents.items()):
            if agent.fenced:
                agents.pop(worker).stop()
                emit("fenced", worker=worker)
                continue
            plan = agent.pending_plan()
            if plan is not None:
                agent.acknowledge(plan.generation)
                if plan.generation > layout_of:
                    layout_of, slots, placed = plan.generation, plan.layout["slots"], frozenset(plan.layout["slots"])
                if worker in noticed and worker not in placed:
                    leave_at.setdefault(worker, now + HANDOVER_S)
            if step and worker in placed:  # standby workers do not train
                agent.report_step(iteration, args.step_seconds, iteration * SAMPLES_PER_STEP)
        if step and slots and slots[0] in agents:
            agents[slots[0]].record_progress(iteration, iteration * SAMPLES_PER_STEP)
        for worker in [w for w, at in leave_at.items() if at <= now]:
            del leave_at[worker]
            if worker in agents:
                agents.pop(worker).stop()
                emit("left", worker=worker)
        time.sleep(TICK_S)


# -- what etcd shows ------------------------------------------------------------------


@dataclass
class PlanSeen:
    generation: int
    revision: int
    created_at: float
    seen_at: float
    slots: tuple[int, ...]


class Observer:
    """The job's plans, notices and member records as watches deliver them, with their
    revisions: acknowledgements are placed against plans by revision, not by arrival."""

    def __init__(self, client: EtcdClient, keys: JobKeys) -> None:
        self._raw: list[tuple[str, Any, float]] = []
        self._lock = threading.Lock()
        self._created: list[threading.Event] = []
        self.reconnected = False
        self.members: dict[int, list[tuple[int, float, int | None]]] = {}  # (revision, seen_at, generation or gone)
        self.notices: dict[int, tuple[int, float]] = {}  # (revision, received_at)
        self.plans: dict[int, PlanSeen] = {}
        self.last_change = time.time()
        self._watches = [client.watch(prefix, self._deliver(kind), prefix=True)
                         for kind, prefix in (("member", keys.members), ("notice", keys.notices), ("plan", keys.plans))]
        for created in self._created:
            if not created.wait(30):
                raise BenchmarkError("a watch on etcd was not created within 30 s")

    def _deliver(self, kind: str):
        created = threading.Event()
        self._created.append(created)

        def on_change(events: list) -> None:
            seen_at = time.time()
            if not events:  # (re-)established: a second time means events may have been missed
                self.reconnected = created.is_set()
                created.set()
            with self._lock:
                self._raw.extend((kind, event, seen_at) for event in events)
        return on_change

    def stop(self) -> None:
        for watch in self._watches:
            watch.stop()

    def update(self) -> None:
        """Decode what the watches delivered since the last call."""
        from megatron_parcae.control.etcd.keys import MemberRecord, NoticeRecord, PlanEnvelope

        if self.reconnected:
            raise BenchmarkError("a watch on etcd reconnected: events may be missing")
        with self._lock:
            raw, self._raw = self._raw, []
        for kind, event, seen_at in raw:
            number = int(event.key.rsplit("/", 1)[1])
            if kind == "member":
                generation = None if event.value is None else MemberRecord.decode(event.value, event.key).generation
                self.members.setdefault(number, []).append((event.revision, seen_at, generation))
            elif kind == "notice" and event.value is not None:
                self.notices[number] = (event.revision, NoticeRecord.decode(event.value, event.key).received_at)
            elif kind == "plan" and event.value is not None:
                plan = PlanEnvelope.decode(event.value, event.key)
                self.plans[number] = PlanSeen(number, event.revision, plan.created_at, seen_at,
                                              tuple(plan.layout["slots"]))
            self.last_change = max(self.last_change, seen_at)

    @property
    def generation(self) -> int:
        return max(self.plans, default=0)

    def audience(self, plan: PlanSeen) -> list[int]:
        """The agents registered when `plan` was published."""
        out = []
        for worker, history in self.members.items():
            before = [generation for revision, _, generation in history if revision < plan.revision]
            if before and before[-1] is not None:
                out.append(worker)
        return out

    def answer(self, worker: int, plan: PlanSeen) -> tuple[str, float] | None:
        """("acked", when) once the worker's member record shows the plan (or a newer
        one), ("gone", when) if its key went first; None while neither."""
        for revision, seen_at, generation in self.members.get(worker, ()):
            if revision > plan.revision and (generation is None or generation >= plan.generation):
                return ("gone" if generation is None else "acked"), seen_at
        return None

    def unanswered(self, plan: PlanSeen) -> list[int]:
        return [w for w in self.audience(plan) if self.answer(w, plan) is None]


def etcd_metrics(port: int) -> dict[str, Any]:
    """RPCs started (by method), the revision and the database size, from etcd's /metrics."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    by_method: dict[str, float] = {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_started_total{"):
            labels, value = line[len("grpc_server_started_total{"):].rsplit("} ", 1)
            method = dict(part.split("=", 1) for part in labels.split(","))["grpc_method"].strip('"')
            by_method[method] = by_method.get(method, 0.0) + float(value)
        elif line.startswith(("etcd_mvcc_db_total_size_in_bytes ", "etcd_mvcc_db_total_size_in_use_in_bytes ",
                              "etcd_debugging_mvcc_current_revision ", "etcd_debugging_mvcc_keys_total ")):
            name, value = line.split(" ", 1)
            values[name] = float(value)
    return {"rpcs": by_method, **values}


def cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise BenchmarkError(f"no VmHWM in /proc/{pid}/status")


def summary(values: list[float]) -> dict[str, Any]:
    """count, p50, p99 and max of milliseconds (None without values)."""
    import numpy as np

    if not values:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    ms = np.array(values)
    return {"count": len(values), "p50": round(float(np.percentile(ms, 50)), 1),
            "p99": round(float(np.percentile(ms, 99)), 1), "max": round(float(ms.max()), 1)}


# -- the run --------------------------------------------------------------------------


@dataclass
class AgentProcess:
    """A child process of agents, and the events its stdout brought."""

    name: str
    popen: subprocess.Popen
    workers: list[int]
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    started: bool = False
    killed: bool = False
    left: list[int] = field(default_factory=list)
    fenced: list[int] = field(default_factory=list)

    def send(self, command: dict) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(command) + "\n")
        self.popen.stdin.flush()


@dataclass
class Round:
    kind: str  # notice, kill or arrival
    at: float  # wall-clock time it was done
    workers: list[int]
    in_layout: int  # of `workers`, how many the layout held
    plans: list[int] = field(default_factory=list)  # generations published during the round


class ControlPlaneRun:
    """One run: set up, the rounds, the figures (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.job = f"bench-{os.getpid()}"
        self.server: EtcdServer | None = None
        self.coordinator: subprocess.Popen | None = None
        self.processes: list[AgentProcess] = []
        self.victims: list[AgentProcess] = []
        self.observer: Observer | None = None
        self.client: EtcdClient | None = None
        self.rounds: list[Round] = []
        self.next_worker = args.instances
        self.setup: dict[str, float] = {}

    # -- processes ---------------------------------------------------------------------

    def start_services(self) -> None:
        """etcd and the coordinator, started before this process has threads (their
        parent-death signal is set between fork and exec)."""
        from benchmarks.decision_time import gpt_1_5b_layer_profile
        from megatron_parcae.control.etcd import EtcdServer
        from megatron_parcae.liveput.cost import CostConstants

        args = self.args
        profile = self.workdir / "gpt-1.5b-layers.json"
        profile.write_text(json.dumps(gpt_1_5b_layer_profile(CostConstants.load()), indent=1))
        config = {"profile": str(profile), "interval-seconds": INTERVAL_S, "grace-seconds": args.grace_seconds,
                  "max-workers": args.instances + args.arrivals * args.batch, "min-workers": args.instances}
        (self.workdir / "coordinator.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.server = EtcdServer().start()
        with (self.workdir / "coordinator.log").open("w") as log:
            self.coordinator = subprocess.Popen(
                [sys.executable, "-m", "megatron_parcae.cli", "coordinator", "--etcd", self.server.endpoint,
                 "--job", self.job, "--config", str(self.workdir / "coordinator.yaml"),
                 "--events", str(self.workdir / "coordinator.events.jsonl")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_child_env(),
                preexec_fn=lambda: _die_with_parent(signal.SIGTERM))

    def start_agents(self, name: str, workers: list[int]) -> AgentProcess:
        args = self.args
        with (self.workdir / f"{name}.log").open("w") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.control_plane", "host", "--etcd", self.server.endpoint,
                 "--job", self.job, "--lease-seconds", str(args.lease_seconds), "--grace-seconds",
                 str(args.grace_seconds), "--step-seconds", str(args.step_seconds), "--parent", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env=_child_env())
        process = AgentProcess(name, popen, workers)
        threading.Thread(target=_read_events, args=(popen.stdout, process.events), daemon=True).start()
        self.processes.append(process)
        process.send({"op": "start", "workers": workers})
        return process

    def wait_started(self, processes: list[AgentProcess]) -> None:
        deadline = time.monotonic() + 60 + 0.05 * sum(len(p.workers) for p in processes)
        while waiting := [p for p in processes if not p.started]:
            self.check_processes()
            if time.monotonic() > deadline:
                raise BenchmarkError(f"agent processes {[p.name for p in waiting]} did not register in time "
                                     f"(logs in {self.workdir})")
            time.sleep(0.05)

    @staticmethod
    def _take(process: AgentProcess, event: dict) -> None:
        if event["event"] == "started":
            process.started = True
        elif event["event"] == "left":
            process.left.append(event["worker"])
        elif event["event"] == "fenced":
            process.fenced.append(event["worker"])

    def check_processes(self) -> None:
        """Fail at once when a process dies on its own: the figures would mean nothing."""
        for process in self.processes:
            while not process.events.empty():
                self._take(process, process.events.get())
            if not process.killed and process.popen.poll() is not None:
                raise BenchmarkError(f"agent process {process.name} exited with {process.popen.returncode}: "
                                     f"{_tail(self.workdir / f'{process.name}.log')}")
        if self.coordinator is not None and self.coordinator.poll() is not None:
            raise BenchmarkError(f"the coordinator exited with {self.coordinator.returncode}: "
                                 f"{_tail(self.workdir / 'coordinator.log')}")

    def stop(self) -> None:
        """Stop everything this run started: the coordinator first (it would react to
        the agents going), then the agents, then etcd."""
        if self.observer is not None:
            self.observer.stop()
        if self.client is not None:
            self.client.close()
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.terminate()
            try:
                self.coordinator.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
                self.coordinator.wait()
        for process in self.processes:
            if process.popen.poll() is None:
                process.popen.kill()
            process.popen.wait()
            if process.popen.stdin is not None:
                try:
                    process.popen.stdin.close()
                except OSError:
                    pass  # its reader is gone
        if self.server is not None:
            self.server.stop()

    # -- rounds ------------------------------------------------------------------------

    def settle(self, round_: Round | None, expect_plan: bool, plan_wait: float) -> None:
        """Wait for the plans a round brings, until every agent registered when each was
        published acknowledged it (or left) and no plan came for QUIET_S."""
        assert self.observer is not None
        observer = self.observer
        before = observer.generation
        started = time.monotonic()
        what = "the first plan" if round_ is None else f"the {round_.kind} of workers {round_.workers[:8]}"
        while True:
            self.check_processes()
            observer.update()
            newest = observer.generation
            now = time.monotonic()
            if expect_plan and newest == before:
                if now - started > plan_wait:
                    raise BenchmarkError(f"no plan within {plan_wait:g} s of {what} "
                                         f"(coordinator log in {self.workdir})")
            elif newest:
                plan = observer.plans[newest]
                unanswered = observer.unanswered(plan)
                if unanswered:
                    if time.time() - plan.seen_at > ACK_WAIT_S:
                        raise BenchmarkError(f"{len(unanswered)} agents did not acknowledge generation {newest} "
                                             f"within {ACK_WAIT_S:g} s: {unanswered[:8]}")
                elif time.time() - observer.last_change >= QUIET_S and now - started >= QUIET_S:
                    if round_ is not None:
                        round_.plans = [g for g in sorted(observer.plans) if g > before]
                    return
            time.sleep(0.05)

    def layout(self) -> tuple[int, ...]:
        assert self.observer is not None
        return self.observer.plans[self.observer.generation].slots

    def notice(self) -> Round:
        """Notices to `batch` workers of the layout that live in the long-lived processes."""
        owner = {w: p for p in self.processes if not p.killed and p not in self.victims for w in p.workers}
        gone = {w for p in self.processes for w in p.left}
        noticed = {w for r in self.rounds if r.kind == "notice" for w in r.workers}
        candidates = sorted(w for w in self.layout() if w in owner and w not in gone | noticed)
        if len(candidates) < self.args.batch:
            raise BenchmarkError(f"only {len(candidates)} workers of the layout are left to notice")
        workers = sorted(self.rng.sample(candidates, self.args.batch))
        round_ = Round("notice", time.time(), workers, len(workers))
        for process in {id(owner[w]): owner[w] for w in workers}.values():
            process.send({"op": "notice", "workers": [w for w in workers if owner[w] is process]})
        self.settle(round_, True, PLAN_WAIT_S)
        return round_

    def kill(self) -> Round:
        """SIGKILL the next process of victims: its agents' leases lapse."""
        process = self.victims.pop(0)
        in_layout = len(set(process.workers) & set(self.layout()))
        round_ = Round("kill", time.time(), process.workers, in_layout)
        process.killed = True
        process.popen.kill()
        process.popen.wait()
        self.settle(round_, in_layout > 0, self.args.lease_seconds + PLAN_WAIT_S)
        return round_

    def arrive(self) -> Round:
        workers = list(range(self.next_worker, self.next_worker + self.args.batch))
        self.next_worker += self.args.batch
        round_ = Round("arrival", time.time(), workers, 0)
        self.wait_started([self.start_agents(f"arrival-{workers[0]}", workers)])
        self.settle(round_, False, 0.0)
        return round_

    # -- the whole run -----------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from megatron_parcae.control.etcd import EtcdClient, JobStore

        args = self.args
        self.start_services()
        assert self.coordinator is not None
        began = time.time()
        self.client = EtcdClient(self.server.endpoint, timeout=10)
        self.observer = Observer(self.client, JobStore(self.client, self.job).keys)
        victims = args.kills * args.batch  # the lowest ids: the first layout places them
        for index in range(args.kills):
            workers = list(range(index * args.batch, (index + 1) * args.batch))
            self.victims.append(self.start_agents(f"victims-{index}", workers))
        rest = list(range(victims, args.instances))
        for index, first in enumerate(range(0, len(rest), args.agents_per_process)):
            # one process at a time: a thousand agents starting at once would starve the
            # keep-alives of those already registered on this machine
            self.wait_started([self.start_agents(f"agents-{index}", rest[first:first + args.agents_per_process])])
        self.wait_started(list(self.processes))
        registered = time.time()
        self.settle(None, True, 300.0)
        first_acked = time.time()
        self.setup = {"register_seconds": round(registered - began, 1),
                      "first_plan_acknowledged_seconds": round(first_acked - registered, 1)}
        print(f"{args.instances} agents registered in {registered - began:.1f} s; the first plan was acknowledged "
              f"by all {first_acked - registered:.1f} s later", flush=True)
        long_lived = [p for p in self.processes if p not in self.victims]
        metrics_before = etcd_metrics(self.server.client_port)
        cpu_before = {name: cpu_seconds(pid) for name, pid in self._pids(long_lived).items()}
        for kind in self.schedule():
            round_ = {"notice": self.notice, "kill": self.kill, "arrival": self.arrive}[kind]()
            self.rounds.append(round_)
            print(f"  {kind:7s} of {len(round_.workers)} ({round_.in_layout} in the layout): "
                  f"plans {round_.plans or 'none'}", flush=True)
        wall = time.time() - first_acked
        metrics_after = etcd_metrics(self.server.client_port)
        cpu_after = {name: cpu_seconds(pid) for name, pid in self._pids(long_lived).items()}
        peaks = {name: peak_rss_bytes(pid) for name, pid in self._pids(long_lived).items()}
        self.observer.update()
        return self.report(wall, metrics_before, metrics_after, cpu_before, cpu_after, peaks)

    def _pids(self, agent_processes: list[AgentProcess]) -> dict[str, int]:
        assert self.coordinator is not None
        return {"coordinator": self.coordinator.pid, "etcd": self.server.pid,
                **{p.name: p.popen.pid for p in agent_processes}}

    def schedule(self) -> list[str]:
        """The rounds, notices interleaved with kills and arrivals."""
        left = {"notice": self.args.notices, "kill": self.args.kills, "arrival": self.args.arrivals}
        out = []
        while any(left.values()):
            for kind in ("notice", "kill", "notice", "arrival"):
                if left[kind]:
                    out.append(kind)
                    left[kind] -= 1
        return out

    def report(self, wall: float, metrics_before: dict, metrics_after: dict, cpu_before: dict, cpu_after: dict,
               peaks: dict) -> dict[str, Any]:
        from megatron_parcae.events import PlanPublished, read_events

        assert self.observer is not None
        observer = self.observer
        published = {e.generation: e for e in read_events(self.workdir / "coordinator.events.jsonl")
                     if isinstance(e, PlanPublished)}
        plans, plan_to_ack, all_acked = [], [], []
        totals = {"expected": 0, "acked": 0, "gone": 0, "missing": 0}
        for generation in sorted(observer.plans):
            plan = observer.plans[generation]
            answers = {w: observer.answer(w, plan) for w in observer.audience(plan)}
            acked = [a[1] - plan.created_at for a in answers.values() if a is not None and a[0] == "acked"]
            missing = sorted(w for w, a in answers.items() if a is None)
            gone = sum(1 for a in answers.values() if a is not None and a[0] == "gone")
            plan_to_ack += [1000 * s for s in acked]
            if acked:
                all_acked.append(1000 * max(acked))
            totals["expected"] += len(answers)
            totals["acked"] += len(acked)
            totals["gone"] += gone
            totals["missing"] += len(missing)
            event = published.get(generation)
            plans.append({"generation": generation, "kind": event.kind if event else None,
                          "reason": event.reason if event else None, "layout_workers": len(plan.slots),
                          "registered": len(answers), "acked": len(acked), "gone": gone, "missing": missing,
                          "all_acked_ms": round(1000 * max(acked), 1) if acked else None})
        notice_to_plan = []
        for round_ in self.rounds:
            if round_.kind != "notice":
                continue
            for worker in round_.workers:
                revision, received_at = observer.notices[worker]
                answer = min((p for p in observer.plans.values() if p.revision > revision and worker not in p.slots),
                             key=lambda p: p.revision, default=None)
                if answer is None:
                    raise BenchmarkError(f"no plan dropped noticed worker {worker}")
                notice_to_plan.append(1000 * (answer.created_at - received_at))

        def first_plan_after(round_: Round) -> float | None:
            return 1000 * (observer.plans[round_.plans[0]].created_at - round_.at) if round_.plans else None

        kill_to_plan = [ms for r in self.rounds if r.kind == "kill" and (ms := first_plan_after(r)) is not None]
        arrival_to_plan = [ms for r in self.rounds if r.kind == "arrival" and (ms := first_plan_after(r)) is not None]
        fenced = sorted(w for p in self.processes for w in p.fenced)
        requests = {m: metrics_after["rpcs"].get(m, 0) - metrics_before["rpcs"].get(m, 0)
                    for m in metrics_after["rpcs"]}
        cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_after}
        agent_names = [name for name in cpu if name not in ("coordinator", "etcd")]
        agent_cpu = sum(cpu[n] for n in agent_names)
        args = self.args
        result = {
            "instances": args.instances,
            "job": self.job,
            "settings": {"batch": args.batch, "notices": args.notices, "kills": args.kills, "arrivals": args.arrivals,
                         "agents_per_process": args.agents_per_process, "lease_seconds": args.lease_seconds,
                         "grace_seconds": args.grace_seconds, "step_seconds": args.step_seconds, "seed": args.seed,
                         "profile": "GPT-1.5B layers (benchmarks/decision_time.py), one GPU per instance",
                         "interval_seconds": INTERVAL_S},
            "cpu_cores": os.cpu_count(),
            "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
            "setup": self.setup,
            "rounds_wall_seconds": round(wall, 1),
            "notice_to_plan_ms": summary(notice_to_plan),
            "plan_to_ack_ms": summary(plan_to_ack),
            "plan_to_all_acked_ms": summary(all_acked),
            "kill_to_plan_ms": summary(kill_to_plan),
            "arrival_to_plan_ms": summary(arrival_to_plan),
            "acknowledgements": {**totals, "fenced": fenced},
            "coordinator": {"cpu_seconds": round(cpu["coordinator"], 2),
                            "cpu_percent": round(100 * cpu["coordinator"] / wall, 1),
                            "cpu_seconds_before_rounds": round(cpu_before["coordinator"], 2),
                            "peak_rss_bytes": peaks["coordinator"]},
            "etcd": {"version": self.client.server_version,
                     "requests_per_second": round(sum(requests.values()) / wall, 1),
                     "requests": {m: int(n) for m, n in sorted(requests.items()) if n},
                     "writes_per_second": round((metrics_after["etcd_debugging_mvcc_current_revision"]
                                                 - metrics_before["etcd_debugging_mvcc_current_revision"]) / wall, 1),
                     "db_size_bytes": int(metrics_after["etcd_mvcc_db_total_size_in_bytes"]),
                     "db_size_bytes_before_rounds": int(metrics_before["etcd_mvcc_db_total_size_in_bytes"]),
                     "db_size_in_use_bytes": int(metrics_after["etcd_mvcc_db_total_size_in_use_in_bytes"]),
                     "keys": int(metrics_after["etcd_debugging_mvcc_keys_total"]),
                     "cpu_seconds": round(cpu["etcd"], 2),
                     "cpu_percent": round(100 * cpu["etcd"] / wall, 1),
                     "peak_rss_bytes": peaks["etcd"]},
            "agent_processes": {"count": len(agent_names), "cpu_seconds": round(agent_cpu, 2),
                                "cpu_percent": round(100 * agent_cpu / wall, 1),
                                "peak_rss_bytes": max(peaks[n] for n in agent_names)},
            "rounds": [{"kind": r.kind, "workers": r.workers, "in_layout": r.in_layout, "plans": r.plans,
                        "first_plan_ms": None if (ms := first_plan_after(r)) is None else round(ms, 1),
                        "noticed_ms": [round(1000 * (observer.notices[w][1] - r.at), 1) for w in r.workers
                                       if r.kind == "notice"]}
                       for r in self.rounds],
            "plans": plans,
        }
        p99 = {"notice_to_plan_p99": result["notice_to_plan_ms"]["p99"],
               "plan_to_ack_p99": result["plan_to_ack_ms"]["p99"]}
        result["targets_ms"] = TARGETS_MS
        result["targets_met"] = all(p99[k] is not None and p99[k] < v for k, v in TARGETS_MS.items())
        result["passed"] = totals["missing"] == 0 and not fenced
        return result


def _child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}


def _read_events(stream: IO[str], events: queue.SimpleQueue) -> None:
    for line in stream:
        events.put(json.loads(line))


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _interrupt(signum: int, frame: object) -> None:
    """SIGINT, SIGTERM or SIGHUP ends the run; further signals wait for the clean-up."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.control_plane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, required=True, help="instances (one agent each) at the start")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report here")
    parser.add_argument("--batch", type=int, default=None,
                        help="instances each notice, kill and arrival concerns (default: instances / 128, at least 1)")
    parser.add_argument("--notices", type=int, default=10, help="rounds of notices (default 10)")
    parser.add_argument("--kills", type=int, default=2, help="rounds of kills (default 2)")
    parser.add_argument("--arrivals", type=int, default=2, help="rounds of arrivals (default 2)")
    parser.add_argument("--agents-per-process", type=int, default=256)
    parser.add_argument("--lease-seconds", type=float, default=10.0, help="the agents' lease (a worker's default: 10)")
    parser.add_argument("--grace-seconds", type=float, default=30.0, help="notice to kill (a worker's default: 30)")
    parser.add_argument("--step-seconds", type=float, default=1.0, help="a training step, for the step reports")
    parser.add_argument("--seed", type=int, default=0, help="which workers get the notices")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the logs and the coordinator's events here (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = max(1, args.instances // 128)
    if args.instances < 2:
        parser.error(f"--instances must be at least 2, got {args.instances}")
    if args.batch < 1 or args.agents_per_process < 1:
        parser.error("--batch and --agents-per-process must be at least 1")
    if min(args.notices, args.kills, args.arrivals) < 0:
        parser.error("--notices, --kills and --arrivals must be at least 0")
    if (args.notices + args.kills) * args.batch > args.instances // 2:
        parser.error(f"{args.notices} notices and {args.kills} kills of {args.batch} instances would take more "
                     f"than half of the {args.instances} instances away")
    for name in ("lease_seconds", "grace_seconds", "step_seconds"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    if args.lease_seconds < 2:
        parser.error(f"--lease-seconds must be at least 2 (etcd's shortest lease), got {args.lease_seconds}")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: no folder {args.json.parent}")
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        parser.error(f"--workdir: {args.workdir} is not empty")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["host"]:
        return host(argv[1:])
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="parcae-control-plane-"))
    workdir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m benchmarks.control_plane", *argv])
    head = {"command": command, "commit": provenance.commit()}
    run = ControlPlaneRun(args, workdir)
    try:
        result = {**head, **run.run()}
    except KeyboardInterrupt:
        print("control_plane: interrupted; every process it started is stopped", file=sys.stderr, flush=True)
        return 130
    except BenchmarkError as exc:
        result = {**head, "error": str(exc), "passed": False}
        print(f"control_plane: error: {exc}", file=sys.stderr, flush=True)
    finally:
        run.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if "error" not in result:
        print(render(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["passed"] else 1


def render(result: dict[str, Any]) -> str:
    """The report for people."""
    def line(name: str) -> str:
        s = result[name]
        if not s["count"]:
            return f"{name:22s} (none)"
        return f"{name:22s} p50 {s['p50']:8.1f}  p99 {s['p99']:8.1f}  max {s['max']:8.1f}  ({s['count']} samples)"

    c, e, a, k = result["coordinator"], result["etcd"], result["agent_processes"], result["acknowledgements"]
    met = "met" if result["targets_met"] else "NOT met"
    return "\n".join([
        f"{result['instances']} instances, {len(result['rounds'])} rounds in {result['rounds_wall_seconds']} s, "
        f"{len(result['plans'])} plans; load average at the end {result['load_average_at_end']} on "
        f"{result['cpu_cores']} CPUs",
        line("notice_to_plan_ms"), line("plan_to_ack_ms"), line("plan_to_all_acked_ms"), line("kill_to_plan_ms"),
        line("arrival_to_plan_ms"),
        f"targets (p99): notice to plan < {TARGETS_MS['notice_to_plan_p99']:g} ms, plan to ack < "
        f"{TARGETS_MS['plan_to_ack_p99']:g} ms: {met}",
        f"acknowledgements: {k['acked']} of {k['expected']} expected, {k['gone']} left first, "
        f"{k['missing']} missing, {len(k['fenced'])} agents fenced",
        f"coordinator: {c['cpu_seconds']} s CPU over the rounds ({c['cpu_percent']}% of a core), "
        f"peak RSS {c['peak_rss_bytes'] / 2**20:.0f} MiB",
        f"etcd {e['version']}: {e['requests_per_second']} requests/s ({e['writes_per_second']} writes/s), db "
        f"{e['db_size_bytes'] / 2**20:.1f} MiB ({e['db_size_in_use_bytes'] / 2**20:.1f} MiB in use), {e['keys']} keys, "
        f"{e['cpu_percent']}% of a core; by method {e['requests']}",
        f"agent processes: {a['count']}, {a['cpu_percent']}% of a core in all, peak RSS "
        f"{a['peak_rss_bytes'] / 2**20:.0f} MiB",
    ])


if __name__ == "__main__":
    sys.exit(main())
