"""In-place migration vs checkpoint-restart on GPT-tiny, 4 CPU processes (issue 3, acceptance 4).

Each migration kind is timed from the decision (the iteration boundary it happens at) to
the first completed step after it, and set beside checkpoint-restart of the same job: a
dist checkpoint saved at that boundary, every process killed, a new torchrun that loads
it into the new layout and completes one step. All figures come from one run of this
script; the ratios are restart / migration. Bars: intra-stage at least 10x, pipeline at
least 3x; planning for 1,024 ranks under 1 s. Exits 1 if a run fails or a bar is missed.

How it is measured:
- migration: the "elapsed time per iteration" the training script reports for the first
  iteration after the change. Its window starts right after the previous iteration was
  reported, so it covers the whole change (plan, groups, state transfer, rebuild) plus
  that first step. The change's own figure (change alone) and the step before are shown too.
- checkpoint-restart: save (from the iteration event before the save to the save event)
  + kill (SIGKILL to torchrun and its workers until all are gone) + start (launching the
  new torchrun to its first iteration event, loading included). The checkpoint is saved
  once by the initial layout (1,2,2); each restart loads it into the layout its migration
  went to. Every figure comes from the jobs' events (--parcae-events), time-stamped by
  the training process.

    nice python -m benchmarks.reconfig
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from megatron_parcae.events import Event, EventFollower, Iteration, LayoutChange, Save

REPO = Path(__file__).resolve().parents[1]

BASE = ["--config", "configs/gpt-tiny.yaml", "--log-interval", "1"]
INITIAL = (1, 2, 2)  # T, P, D of every job this script starts (4 processes)
DECISION = 3  # iterations done before the first change and before the save
RUN_LIMIT_S = 300.0
BARS = {"intra-stage": 10.0, "pipeline": 3.0}
PLAN_LIMIT_S = 1.0
POLL_S = 0.02  # how often a running job's events file is read


@dataclass(frozen=True)
class MigrationRun:
    """One job with a layout schedule; `names` label its changes in order."""

    schedule: str
    train_iters: int
    names: tuple[str, ...]


MIGRATION_RUNS = (
    MigrationRun(f"{DECISION}:1,2,1:leave=1,3", DECISION + 2, ("intra-stage: a replica of each stage leaves",)),
    MigrationRun(f"{DECISION}:1,2,1:leave=2,3", DECISION + 2, ("grace period: stage 1 loses both replicas",)),
    MigrationRun(f"{DECISION}:1,4,1;{DECISION + 2}:1,2,2;{DECISION + 4}:2,2,1", DECISION + 5,
                 ("pipeline: P 2 -> 4", "pipeline: P 4 -> 2", "tensor: T 1 -> 2 (P 2, D 2 -> 1)")),
)


@dataclass
class Job:
    """A torchrun job's events, and its log for error messages."""

    events: list[Event]
    log: Path
    returncode: int | None

    def all(self, kind: type[Event]) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@dataclass(frozen=True)
class Migration:
    name: str
    kind: str
    layout: tuple[int, int, int]
    planned_bytes: int
    change_ms: float
    step_before_ms: float
    total_ms: float  # decision to first completed step after it


class RunFailed(RuntimeError):
    """A job exited badly or did not log what it should; carries its output."""


def launch(nproc: int, args: list[str], files: Path) -> subprocess.Popen:
    """Start torchrun; its output goes to `files`.log, its events to `files`.events.jsonl."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "scripts" / "pretrain_gpt.py"), *args, "--parcae-events", f"{files}.events.jsonl"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(f"{files}.log", "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers, as a preemption would, and wait until all are gone."""
    if proc.poll() is not None:
        return  # ended (and reaped): its pid may belong to another process by now
    try:
        torchrun = psutil.Process(proc.pid)
        workers = torchrun.children()
    except psutil.NoSuchProcess:
        torchrun, workers = None, []
    for p in [torchrun, *workers]:
        try:
            if p is not None:
                p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    while any(_alive(w) for w in workers):
        time.sleep(0.005)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def follow(proc: subprocess.Popen, files: Path, stop: Callable[[Event], bool] | None = None) -> Job:
    """Read the job's events until it ends, or until one is `stop` (the job is then left running)."""
    watchdog = threading.Timer(RUN_LIMIT_S, kill_job, [proc])
    watchdog.start()
    follower = EventFollower(f"{files}.events.jsonl")
    events: list[Event] = []
    try:
        while True:
            ended = proc.poll() is not None
            events += follower.read()
            if stop is not None and any(stop(e) for e in events):
                return Job(events, Path(f"{files}.log"), None)
            if ended:
                return Job(events, Path(f"{files}.log"), proc.returncode)
            time.sleep(POLL_S)
    finally:
        watchdog.cancel()


def run_migrations(run: MigrationRun, files: Path) -> list[Migration]:
    tp, pp, _ = INITIAL
    proc = launch(4, BASE + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                             "--train-iters", str(run.train_iters), "--parcae", "--parcae-layout-schedule",
                             run.schedule], files)
    job = follow(proc, files)
    step_ms = {e.iteration: e.ms_per_iteration for e in job.all(Iteration)}
    changes: list[LayoutChange] = job.all(LayoutChange)
    if job.returncode != 0 or len(changes) != len(run.names):
        raise RunFailed(f"schedule {run.schedule!r}: exit {job.returncode}, {len(changes)} of {len(run.names)} "
                        f"changes reported:\n{job.tail()}")
    out = []
    for name, c in zip(run.names, changes):
        if c.iteration not in step_ms or c.iteration + 1 not in step_ms:
            raise RunFailed(f"schedule {run.schedule!r}: iterations {c.iteration}, {c.iteration + 1} not both "
                            f"reported:\n{job.tail()}")
        out.append(Migration(name, c.kind, (c.tp, c.pp, c.dp), c.bytes_planned, c.seconds * 1000.0,
                             step_ms[c.iteration], step_ms[c.iteration + 1]))
    return out


def save_and_kill(directory: str, workdir: Path) -> tuple[float, float]:
    """The initial job saves after DECISION iterations and is killed at once: (save s, kill s)."""
    tp, pp, _ = INITIAL
    files = workdir / "save"
    proc = launch(4, BASE + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                             "--train-iters", str(DECISION + 100), "--save", directory,
                             "--save-interval", str(DECISION)], files)
    try:
        job = follow(proc, files, stop=lambda e: isinstance(e, Save))
        killed = time.perf_counter()
    finally:
        kill_job(proc)
    kill_s = time.perf_counter() - killed
    saved = next(iter(job.all(Save)), None)
    before = next((e for e in job.all(Iteration) if e.iteration == DECISION), None)
    if saved is None or before is None:
        raise RunFailed(f"checkpoint job: no save reported after iteration {DECISION}:\n{job.tail()}")
    return saved.time - before.time, kill_s


def restart(directory: str, layout: tuple[int, int, int], workdir: Path) -> float:
    """Seconds from launching torchrun on the checkpoint to its first iteration event (then it is killed)."""
    tp, pp, dp = layout
    files = workdir / f"restart-{tp}-{pp}-{dp}"
    started = time.time()  # the clock of the events' time stamps
    proc = launch(tp * pp * dp, BASE + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                                        str(pp), "--train-iters", str(DECISION + 100), "--load", directory], files)
    try:
        job = follow(proc, files, stop=lambda e: isinstance(e, Iteration))
    finally:
        kill_job(proc)
    first = next(iter(job.all(Iteration)), None)
    if first is None or first.iteration != DECISION + 1:
        raise RunFailed(f"restart into {layout}: exit {job.returncode}, no iteration {DECISION + 1}:\n{job.tail()}")
    return first.time - started


def plan_times() -> list[tuple[str, str, int, float]]:
    """benchmarks/plan_time.py's 1,024-rank GPT-1.5B scenarios, each planned once: (name, kind, ranks, s)."""
    from benchmarks import plan_time

    out = []
    for name, request, target in plan_time.scenarios():
        started = time.perf_counter()
        plan = plan_time.plan_migration(request, target, plan_time.GPT_1_5B)
        out.append((name, plan.kind, request.old.parallelism.world_size, time.perf_counter() - started))
    return out


def main() -> int:
    ok = True
    migrations: list[Migration] = []
    restart_s: dict[tuple[int, int, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="parcae-bench-") as tmp:
        workdir = Path(tmp)
        for number, run in enumerate(MIGRATION_RUNS):
            try:
                migrations += run_migrations(run, workdir / f"migrations-{number}")
            except RunFailed as exc:
                ok = False
                print(f"MIGRATION FAILED: {exc}", flush=True)
        directory = str(workdir / "checkpoints")
        try:
            save_s, kill_s = save_and_kill(directory, workdir)
            for layout in dict.fromkeys(m.layout for m in migrations):
                restart_s[layout] = restart(directory, layout, workdir)
        except RunFailed as exc:
            ok = False
            print(f"CHECKPOINT-RESTART FAILED: {exc}", flush=True)

    print(f"\nGPT-tiny, 4 CPU processes from T,P,D = {INITIAL}; change / save after iteration {DECISION} "
          f"(later changes of the same job two iterations apart)")
    print(f"{'migration':45} {'kind':12} {'to T,P,D':9} {'MB planned':>10} {'change ms':>9} {'step ms':>8} "
          f"{'migr. s':>8} {'restart s':>9} {'ratio':>7}")
    ratios: dict[str, float] = {}
    for m in migrations:
        restart_total = save_s + kill_s + restart_s[m.layout] if m.layout in restart_s else None
        ratio = restart_total / (m.total_ms / 1000.0) if restart_total is not None else None
        if ratio is not None:
            ratios.setdefault(m.kind, ratio)  # the first change of a kind is the one its bar is judged on
        print(f"{m.name:45} {m.kind:12} {','.join(map(str, m.layout)):9} {m.planned_bytes / 1e6:10.3f} "
              f"{m.change_ms:9.1f} {m.step_before_ms:8.1f} {m.total_ms / 1000.0:8.3f} "
              f"{restart_total if restart_total is not None else float('nan'):9.2f} "
              f"{ratio if ratio is not None else float('nan'):6.1f}x")
    if restart_s:
        print(f"checkpoint-restart = save {save_s:.2f} s + kill {kill_s:.2f} s + start to first step "
              + ", ".join(f"{','.join(map(str, k))}: {v:.2f} s" for k, v in restart_s.items()))
    print("change ms: the change's own figure; step ms: the step before it; migr. s: decision to first "
          "completed step (the first step's reported elapsed time)")
    for kind, bar in BARS.items():
        met = kind in ratios and ratios[kind] >= bar
        ok &= met
        shown = f"{ratios[kind]:.1f}x" if kind in ratios else "not measured"
        print(f"{kind} at least {bar:.0f}x faster than checkpoint-restart: {'yes' if met else 'NO'} ({shown})")

    times = plan_times()
    slowest = max(times, key=lambda t: t[3])
    ok &= slowest[3] < PLAN_LIMIT_S
    print(f"\nplanning, GPT-1.5B shape, {len(times)} scenarios of up to {max(t[2] for t in times)} ranks "
          f"(benchmarks/plan_time.py): slowest {slowest[3]:.3f} s ({slowest[0]}); under {PLAN_LIMIT_S:.0f} s: "
          f"{'yes' if slowest[3] < PLAN_LIMIT_S else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
