"""What `--parcae` costs per iteration when nothing is preempted (issue 6, acceptance 4:
at most 2% on CPU).

The same GPT-tiny training (configs/gpt-tiny.yaml, real data) runs in two ways:
- plain: torchrun with N processes and the fixed layout T=1, P=1, D=N;
- parcae: a local etcd, `parcae coordinator` and N workers started on their own with
  `--parcae --parcae-etcd` (agent thread, lease, rank 0's progress record up to once a second, the
  plan agreement about every half second, step reports). The coordinator's throughput
  table lists only T=1, P=1, D=N, so it places the workers in the layout of the plain run.

Each round starts a plain and a parcae run together and lets them train by turns: one
trains for SLICE_S (3 s) while every process of the other (etcd and the coordinator
too) is paused with SIGSTOP, then they swap, until the first ends. A shared 2-core
machine's speed drifts by 20-30% over tens of seconds, so runs one after the other
cannot resolve 2% (their median ratios moved from 0.60 to 1.27 in one sitting); turns
of 3 s keep both runs in the same stretch of that drift. The run that goes first
alternates with the round.

Two figures per iteration, both over the counted iterations (all but the first WARMUP
after the last layout change, up to the end of the turns; the first plan comes at
iteration 0):
- wall: the "elapsed time per iteration (ms)" the training script reports (--log-interval 1,
  in its --parcae-events file), of the counted iterations no pause fell in. A window
  starts after the previous iteration was reported, so it holds the iteration
  boundary's parcae work. Reported pooled over all rounds (median, mean) and paired (below).
- CPU: user + system time (every thread) the run's processes spent per counted
  iteration, read from /proc as each iteration is reported, summed over all rounds:
  the training processes (parcae: main loop, agent thread, etcd client threads), and
  the run's other processes (plain: torchrun's agent; parcae: etcd and the coordinator,
  which on a cluster run off the training hosts). This figure says where an overhead
  comes from.
The bar is judged on wall time, paired: within each round, parcae's figure over plain's,
and the median of those ratios over the rounds (only a round's two runs share a stretch
of the machine's drift). The figure within a round is the median without snapshots
(--copy-interval 0; bar 2%) and the mean with them (bar 3%; issue 18: every K steps each
worker snapshots its state and sends a copy to its buddy, one iteration in K pays it).
Exits 1 if a run fails or the bar is missed. `--control` puts a second plain run where
the parcae one was (A/A): its ratios are the machine's noise floor for the bar.

    nice python -m benchmarks.parcae_overhead [--iterations 30] [--rounds 3] [--copy-interval K] [--control]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from benchmarks import provenance
from megatron_parcae.control.etcd import EtcdServer
from megatron_parcae.events import Event, EventFollower, Iteration, LayoutChange
from megatron_parcae.tools.replay import interrupt_on_signals

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/gpt-tiny.yaml"
SHAPE_SOURCE = REPO / "configs/profiles/gpt-tiny-cpu.json"  # its model_shape describes configs/gpt-tiny.yaml
BASE = ["--config", CONFIG, "--log-interval", "1"]
PROCESSES = (1, 2)
MODES = ("plain", "parcae")
WARMUP = 5
BAR_PERCENT = 2.0  # without snapshots (--copy-interval 0), on the median
COPIES_BAR_PERCENT = 3.0  # with them, on the mean: a snapshot lands in one iteration of K
COPIES = ["--parcae-copy-interval", "10"]  # the workers' snapshots (--copy-interval)
CONTROL = [False]  # --control: the "parcae" run is a second plain one
RUN_LIMIT_S = 300.0  # per run; runs taking turns share the sum
SLICE_S = 3.0  # a turn: how long one run trains while the other is paused
PAUSE_MARGIN_S = 0.05  # an iteration this close to a pause counts as paused in


class RunFailed(RuntimeError):
    """A run exited badly, timed out or trained another layout; carries its output."""


@dataclass(frozen=True)
class RunFigures:
    """One run's counted iterations."""

    iteration_ms: list[float]  # as reported, of the counted iterations not paused in
    counted: int  # iterations counted, paused in or not
    training_cpu_s: float  # CPU time of the training processes over the counted iterations
    side_cpu_s: float  # CPU time of the run's other processes over the same iterations


@dataclass
class Comparison:
    """Plain and parcae runs of one process count, every round pooled."""

    processes: int
    runs: dict[str, list[RunFigures]] = field(default_factory=lambda: {mode: [] for mode in MODES})

    def median_ms(self, mode: str) -> float:
        return statistics.median(ms for run in self.runs[mode] for ms in run.iteration_ms)

    def mean_ms(self, mode: str) -> float:
        return statistics.fmean(ms for run in self.runs[mode] for ms in run.iteration_ms)

    @property
    def mean_wall_ratio(self) -> float:
        return self.mean_ms("parcae") / self.mean_ms("plain")

    def cpu_ms(self, mode: str, part: str) -> float:
        """CPU time per counted iteration of the "training" or the "side" processes, all rounds together."""
        runs = self.runs[mode]
        seconds = sum(r.training_cpu_s if part == "training" else r.side_cpu_s for r in runs)
        return seconds * 1000.0 / sum(r.counted for r in runs)

    @property
    def wall_ratio(self) -> float:
        return self.median_ms("parcae") / self.median_ms("plain")

    @property
    def training_cpu_ratio(self) -> float:
        return self.cpu_ms("parcae", "training") / self.cpu_ms("plain", "training")

    @property
    def all_cpu_ratio(self) -> float:
        return sum(self.cpu_ms("parcae", part) for part in ("training", "side")) / \
            sum(self.cpu_ms("plain", part) for part in ("training", "side"))

    def round_ratios(self, within: Callable[[list[float]], float] = statistics.median) -> list[float]:
        """parcae / plain within each round (`within`: the median or the mean of its iterations)."""
        return [within(b.iteration_ms) / within(a.iteration_ms) for a, b in zip(self.runs["plain"], self.runs["parcae"])]

    def paired_ratio(self, within: Callable[[list[float]], float]) -> float:
        """The median over rounds of the ratio within each round: the figure the bar is judged on.

        Only a round's two runs share a stretch of the machine's drift. Pooling every
        round's iterations mixes stretches and weights each by its iterations not paused
        in, which differ between the two runs (the one that ends first ends the count).
        """
        return statistics.median(self.round_ratios(within))

    def to_dict(self) -> dict:
        modes = {mode: {"median_iteration_ms": self.median_ms(mode), "mean_iteration_ms": self.mean_ms(mode),
                        "training_cpu_ms_per_iteration": self.cpu_ms(mode, "training"),
                        "side_cpu_ms_per_iteration": self.cpu_ms(mode, "side"),
                        "runs": [asdict(r) for r in self.runs[mode]]} for mode in MODES}
        return {"processes": self.processes, "layout": [1, 1, self.processes], **modes,
                "wall_ratio": self.wall_ratio, "wall_overhead_percent": (self.wall_ratio - 1.0) * 100.0,
                "mean_wall_overhead_percent": (self.mean_wall_ratio - 1.0) * 100.0,
                "round_wall_ratios": self.round_ratios(),
                "round_mean_wall_ratios": self.round_ratios(statistics.fmean),
                "paired_overhead_percent": (self.paired_ratio(statistics.median) - 1.0) * 100.0,
                "paired_mean_overhead_percent": (self.paired_ratio(statistics.fmean) - 1.0) * 100.0,
                "training_cpu_overhead_percent": (self.training_cpu_ratio - 1.0) * 100.0,
                "all_cpu_overhead_percent": (self.all_cpu_ratio - 1.0) * 100.0}


# -- processes -----------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}


def _start(cmd: list[str], log: Path | None = None) -> subprocess.Popen:
    """Start in a session of its own; output to `log`, or to a pipe this script follows."""
    if log is None:
        return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL a process this script started, with everything in its session, and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes (every thread)."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            raise RunFailed(f"process {pid} ended while its run was being measured") from None
        total += times.user + times.system
    return total


def _children(pid: int) -> list[int]:
    return [child.pid for child in psutil.Process(pid).children()]


def _failed(proc: subprocess.Popen) -> bool:
    """Whether `proc` ended other than with exit status 0; it is not reaped, so its CPU
    times stay readable until the run is waited for."""
    if proc.returncode is not None:
        return proc.returncode != 0
    ended = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return ended is not None and (ended.si_code != os.CLD_EXITED or ended.si_status != 0)


@dataclass
class Run:
    """One started run: its processes, and what `follow` has read of it."""

    mode: str  # "plain" or "parcae"
    what: str
    processes: int
    events: Path  # its workers' --parcae-events file
    piped: list[subprocess.Popen]  # whose output is read; each must exit 0
    roots: list[int]  # the run's processes: paused and resumed with their descendants
    training: Callable[[], list[int]]  # the training processes' pids, once they exist
    side: list[int]  # its other processes, whose CPU time is counted apart
    serving: tuple[subprocess.Popen, ...] = ()  # must not fail while it trains (the coordinator)
    output: list[str] = field(default_factory=list)
    seen: list[Event] = field(default_factory=list)
    cpu_at: dict[int, tuple[float, float]] = field(default_factory=dict)  # iteration: (training, side) CPU s
    paused: list[tuple[float, float]] = field(default_factory=list)  # (SIGSTOP, SIGCONT) Unix times
    _paused_at: float | None = None

    def __post_init__(self) -> None:
        self.follower = EventFollower(self.events)

    def _signal(self, signum: int) -> None:
        for root in self.roots:
            try:
                tree = [psutil.Process(root)]
                tree += tree[0].children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for proc in tree:
                try:
                    proc.send_signal(signum)
                except psutil.NoSuchProcess:
                    pass

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = time.time()  # first: an interrupted pause is still resumed
            self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._paused_at is not None:
            self._signal(signal.SIGCONT)
            self.paused.append((self._paused_at, time.time()))
            self._paused_at = None

    def take(self, data: bytes) -> None:
        """Output arrived: keep it, and read the events written before it."""
        self.output.append(data.decode(errors="replace"))
        for event in self.follower.read():
            self.seen.append(event)
            if isinstance(event, Iteration):
                self.cpu_at[event.iteration] = (_cpu_seconds(self.training()), _cpu_seconds(self.side))

    def check(self) -> None:
        failed = [proc.args[:4] for proc in self.serving if _failed(proc)]
        if failed:
            raise RunFailed(f"{self.what}: {' '.join(map(str, failed[0]))} failed before training ended")

    def finish(self, deadline: float) -> None:
        """Wait for the piped processes; RunFailed unless each exited 0."""
        self.seen += self.follower.read()
        try:
            for proc in self.piped:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        codes = [proc.poll() for proc in self.piped]
        if any(code != 0 for code in codes):
            raise RunFailed(f"{self.what}: exit codes {codes} (None: still running after the time limit):\n"
                            f"{''.join(self.output)[-3000:]}")


def follow(runs: list[Run]) -> float:
    """Let the runs train by turns, SLICE_S each, the others paused, until the first
    ends; then the rest run on to their ends. Returns when the turns ended (Unix time).

    Turns make slow drifts in the machine's speed hit every run alike: one run's
    iterations are never more than a slice or two away from the other's.
    """
    deadline = time.monotonic() + RUN_LIMIT_S * len(runs)
    selector = selectors.DefaultSelector()
    for run in runs:
        for proc in run.piped:
            selector.register(proc.stdout.fileno(), selectors.EVENT_READ, run)
    for run in runs[1:]:
        run.pause()
    turn, switch_at, turns_ended = 0, time.monotonic() + SLICE_S, None
    while selector.get_map() and time.monotonic() < deadline:
        for run in runs:
            run.check()
        if turns_ended is None and time.monotonic() >= switch_at:
            runs[turn].pause()
            turn = (turn + 1) % len(runs)
            runs[turn].resume()
            switch_at = time.monotonic() + SLICE_S
        wait = 1.0 if turns_ended is not None else min(1.0, max(0.0, switch_at - time.monotonic()))
        for key, _ in selector.select(timeout=wait):
            data = os.read(key.fd, 1 << 16)
            if data:
                key.data.take(data)
                continue
            selector.unregister(key.fileobj)
            if turns_ended is None and not any(k.data is key.data for k in selector.get_map().values()):
                turns_ended = time.time()
                for run in runs:
                    run.resume()
    for run in runs:
        run.resume()
        run.finish(deadline)
    return turns_ended if turns_ended is not None else time.time()


def figures(run: Run, turns_ended: float) -> RunFigures:
    """The counted iterations of a run that must have trained T=1, P=1, D=processes only:
    after WARMUP past its last layout change, ended while the runs took turns, and (for
    wall time) not paused while they ran."""
    output = "".join(run.output)
    changes = [e for e in run.seen if isinstance(e, LayoutChange)]
    layouts = {(c.tp, c.pp, c.dp) for c in changes}
    if layouts - {(1, 1, run.processes)}:
        raise RunFailed(f"{run.what}: trained layout(s) {sorted(layouts)}, not T=1 P=1 D={run.processes}:\n"
                        f"{output[-3000:]}")
    before = max((c.iteration for c in changes), default=0) + WARMUP  # the last iteration not counted
    reported = {e.iteration: e for e in run.seen if isinstance(e, Iteration)}
    counted = sorted(i for i, e in reported.items() if i > before and e.time <= turns_ended)
    if not counted or before not in run.cpu_at or counted != list(range(before + 1, counted[-1] + 1)):
        raise RunFailed(f"{run.what}: iterations {before} to the end of the turns not all reported:\n{output[-3000:]}")

    def unpaused(event: Iteration) -> bool:
        start = event.time - event.ms_per_iteration / 1000.0 - PAUSE_MARGIN_S
        return not any(start < resumed and paused < event.time + PAUSE_MARGIN_S for paused, resumed in run.paused)

    kept = [reported[i].ms_per_iteration for i in counted if unpaused(reported[i])]
    if not kept:
        raise RunFailed(f"{run.what}: every counted iteration was paused in")
    last = counted[-1]
    return RunFigures(kept, len(counted), run.cpu_at[last][0] - run.cpu_at[before][0],
                      run.cpu_at[last][1] - run.cpu_at[before][1])


# -- the two ways to run -------------------------------------------------------------


def start_plain(processes: int, iterations: int, events: Path, started: list[subprocess.Popen]) -> Run:
    torchrun = _start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={processes}", "--log-dir", str(events.parent / "torchrun-logs"),
                       "scripts/pretrain_gpt.py", *BASE,
                       "--train-iters", str(iterations), "--tensor-model-parallel-size", "1",
                       "--pipeline-model-parallel-size", "1", "--parcae-events", str(events)])
    started.append(torchrun)
    workers: list[int] = []

    def training() -> list[int]:
        if len(workers) < processes:
            workers[:] = _children(torchrun.pid)
        return workers

    return Run("plain", f"plain torchrun, {processes} processes", processes, events, [torchrun], [torchrun.pid],
               training, [torchrun.pid])


def write_coordinator_config(processes: int, workdir: Path) -> Path:
    """A config whose throughput table holds T=1, P=1, D=`processes` alone.

    The cost constants are the shipped ones plus the shape of GPT-tiny, which a table
    does not describe (the coordinator looks it up there by the table's model name).
    """
    from megatron_parcae.liveput.cost import DEFAULT_CONSTANTS

    constants = json.loads(DEFAULT_CONSTANTS.read_text(encoding="utf-8"))
    constants["models"]["gpt-tiny"] = json.loads(SHAPE_SOURCE.read_text(encoding="utf-8"))["model_shape"]
    (workdir / "constants.json").write_text(json.dumps(constants, indent=1), encoding="utf-8")
    (workdir / f"profile-{processes}.csv").write_text(
        "# model=gpt-tiny micro_batch_size=4 global_batch_size=32 (the only layout the coordinator may choose)\n"
        "data_parallel,pipeline_stages,iteration_ms,samples_per_s,tensor_parallel\n"
        f"{processes},1,400.0,80.0,1\n", encoding="utf-8")
    config = {"profile": f"profile-{processes}.csv", "model": "gpt-tiny", "cost-constants": "constants.json",
              "min-workers": processes, "max-workers": processes}
    path = workdir / f"coordinator-{processes}.yaml"
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")  # JSON is YAML
    return path


def start_parcae(processes: int, iterations: int, config: Path, events: Path, server: EtcdServer,
                 started: list[subprocess.Popen]) -> Run:
    job = f"overhead-{processes}-{os.getpid()}-{time.monotonic_ns()}"
    coordinator = _start([sys.executable, "-m", "megatron_parcae.cli", "coordinator", "--etcd", server.endpoint,
                          "--job", job, "--config", str(config)], config.with_suffix(".log"))
    started.append(coordinator)
    workers = []
    for worker in range(processes):
        workers.append(_start([sys.executable, "scripts/pretrain_gpt.py", *BASE, "--train-iters", str(iterations),
                               "--parcae", "--parcae-etcd", server.endpoint, "--parcae-job", job,
                               "--parcae-worker-id", str(worker), "--parcae-events", str(events), *COPIES]))
        started.append(workers[-1])
    pids = [w.pid for w in workers]
    return Run("parcae", f"--parcae, {processes} workers", processes, events, workers,
               [server.pid, coordinator.pid, *pids], lambda: pids, [server.pid, coordinator.pid], serving=(coordinator,))


def measure_round(processes: int, iterations: int, config: Path, workdir: Path, number: int) -> dict[str, RunFigures]:
    """One plain and one --parcae run, started together and trained by turns; the run
    that goes first alternates with the round's number."""
    server = EtcdServer().start()
    started: list[subprocess.Popen] = []
    runs: list[Run] = []
    try:
        for mode in MODES if number % 2 == 0 else reversed(MODES):
            events = workdir / f"{mode}-{processes}-{number}.events.jsonl"  # the workers of a run share it
            if mode == "plain" or CONTROL[0]:
                runs.append(start_plain(processes, iterations, events, started))
                runs[-1].mode = mode
            else:
                runs.append(start_parcae(processes, iterations, config, events, server, started))
        try:
            turns_ended = follow(runs)
        except RunFailed as exc:
            log = config.with_suffix(".log")
            raise RunFailed(f"{exc}\ncoordinator:\n{log.read_text(errors='replace')[-2000:]}") from None
        return {run.mode: figures(run, turns_ended) for run in runs}
    finally:
        for run in runs:
            run.resume()  # a paused process would not act on SIGTERM
        for proc in started:
            _stop(proc)
        server.stop()


def measure(processes: int, iterations: int, rounds: int, workdir: Path) -> Comparison:
    config = write_coordinator_config(processes, workdir)
    result = Comparison(processes)
    for number in range(rounds):
        measured = measure_round(processes, iterations, config, workdir, number)
        for mode in MODES:
            run = measured[mode]
            result.runs[mode].append(run)
            print(f"  N={processes} round {number + 1}/{rounds} {mode:6}: median {statistics.median(run.iteration_ms):7.1f}"
                  f" ms ({len(run.iteration_ms)} of {run.counted} counted iterations not paused in), CPU "
                  f"{(run.training_cpu_s + run.side_cpu_s) * 1000.0 / run.counted:7.1f} ms per iteration", flush=True)
    return result


# -- report --------------------------------------------------------------------------


def report(comparisons: list[Comparison]) -> bool:
    """Print the table; True if every wall overhead is within the bar."""
    print(f"\n{'':2} {'wall ms per iteration (median)':^36}   {'CPU ms per iteration: training processes':^40}   "
          f"{'other processes':^17}   {'all CPU':>8}")
    print(f"{'N':>2} {'plain':>8} {'parcae':>8} {'ratio':>7} {'overhead':>9}   {'plain':>9} {'parcae':>9} {'ratio':>7} "
          f"{'overhead':>9}   {'plain':>8} {'parcae':>8}   {'overhead':>8}   round wall ratios")
    for c in comparisons:
        print(f"{c.processes:>2} {c.median_ms('plain'):8.1f} {c.median_ms('parcae'):8.1f} {c.wall_ratio:7.3f} "
              f"{(c.wall_ratio - 1) * 100:+8.2f}%   {c.cpu_ms('plain', 'training'):9.1f} "
              f"{c.cpu_ms('parcae', 'training'):9.1f} {c.training_cpu_ratio:7.3f} "
              f"{(c.training_cpu_ratio - 1) * 100:+8.2f}%   {c.cpu_ms('plain', 'side'):8.1f} "
              f"{c.cpu_ms('parcae', 'side'):8.1f}   {(c.all_cpu_ratio - 1) * 100:+7.2f}%   "
              f"{' '.join(f'{r:.3f}' for r in c.round_ratios())}")
    for c in comparisons:
        print(f"{c.processes:>2} mean wall ms per iteration: plain {c.mean_ms('plain'):.1f}, parcae "
              f"{c.mean_ms('parcae'):.1f}, overhead {(c.mean_wall_ratio - 1) * 100:+.2f}%; paired (median over rounds "
              f"of each round's ratio): {(c.paired_ratio(statistics.median) - 1) * 100:+.2f}% on medians, "
              f"{(c.paired_ratio(statistics.fmean) - 1) * 100:+.2f}% on means")
    copies = int(COPIES[1])
    bar = COPIES_BAR_PERCENT if copies else BAR_PERCENT
    within = statistics.fmean if copies else statistics.median
    worst = max((c.paired_ratio(within) - 1.0) * 100.0 for c in comparisons)
    print(f"--parcae{f' with snapshots every {copies} steps' if copies else ' without snapshots'} costs at most "
          f"{bar:.0f}% per iteration (wall, paired on each round's {'mean' if copies else 'median'}): "
          f"{'yes' if worst <= bar else 'NO'} (worst {worst:+.2f}%)")
    print("wall: median (and mean) over all rounds of the reported per-iteration time; paired: the median over rounds "
          "of parcae / plain within each round, which the bar is judged on. CPU: user + system time per counted "
          "iteration, all rounds together, of the training processes and of the run's other processes "
          "(plain: torchrun's agent; parcae: etcd + coordinator). round wall ratios: parcae / plain medians "
          "within each round (how far machine noise moves them).")
    return worst <= bar


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parcae_overhead",
                                     description="--parcae's cost per iteration without preemptions, against plain "
                                                 "torchrun (see the module docstring)")
    parser.add_argument("--iterations", type=int, default=30,
                        help=f"training iterations per run, the first {WARMUP} not counted (default 30)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="plain / parcae pairs per process count (default 3)")
    parser.add_argument("--processes", type=int, nargs="+", default=list(PROCESSES), metavar="N",
                        help="process counts to compare (default 1 2; one GPU takes only 1)")
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (both runs)")
    parser.add_argument("--copy-interval", type=int, default=10, metavar="K",
                        help="the parcae workers' snapshots with buddy copies every K steps (default 10, as "
                             "--parcae-copy-interval; 0: none). The bar is 2%% on the median without them, 3%% on "
                             "the mean with them")
    parser.add_argument("--control", action="store_true",
                        help="an A/A control: the run in the parcae slot is plain torchrun too, so the ratios "
                             "show what the machine's noise alone makes of them")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.bf16:
        BASE.append("--bf16")
    if args.iterations <= WARMUP + 1 or args.rounds < 1 or min(args.processes) < 1 or args.copy_interval < 0:
        parser.error(f"--iterations must exceed {WARMUP + 1}, --rounds and --processes be at least 1, "
                     "--copy-interval at least 0")
    COPIES[1] = str(args.copy_interval)
    CONTROL[0] = args.control

    from megatron_parcae.training.data.corpus import prepare_tiny_datasets

    prepare_tiny_datasets(REPO / "data")
    print(f"GPT-tiny ({CONFIG}), T=1 P=1 D=N, {args.iterations} iterations per run (first {WARMUP} after the plan "
          f"not counted), {args.rounds} rounds of plain torchrun and "
          f"{'plain torchrun again (--control)' if args.control else '--parcae (etcd + coordinator + N workers)'} "
          f"taking turns of {SLICE_S:g} s; {os.cpu_count()} CPU cores", flush=True)
    comparisons: list[Comparison] = []
    interrupt_on_signals()  # SIGTERM stops the run's etcd, coordinator and workers as Ctrl-C does
    try:
        with tempfile.TemporaryDirectory(prefix="parcae-overhead-") as tmp:
            for processes in args.processes:
                comparisons.append(measure(processes, args.iterations, args.rounds, Path(tmp)))
    except RunFailed as exc:
        print(f"RUN FAILED: {exc}", flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted; every process it started is stopped", file=sys.stderr, flush=True)
        return 130
    met = report(comparisons)
    if args.json is not None:
        figures_out = {
            "command": " ".join(["python -m benchmarks.parcae_overhead", *argv]), "commit": provenance.commit(),
            "config": CONFIG, "iterations": args.iterations, "warmup_iterations": WARMUP, "rounds": args.rounds,
            "cpu_cores": os.cpu_count(), "load_average_at_end": os.getloadavg(), "turn_seconds": SLICE_S,
            "copy_interval": args.copy_interval, "control": args.control,
            "bar_percent": COPIES_BAR_PERCENT if args.copy_interval else BAR_PERCENT,
            "met": met, "results": [c.to_dict() for c in comparisons],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures_out, indent=1) + "\n", encoding="utf-8")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
