"""Chaos: GPT-tiny trained by 4 to 6 `--parcae` workers while its processes are killed.

    python -m benchmarks.chaos --runs 20 --json chaos.json

Each run starts etcd, `parcae coordinator` and 4 to 6 workers (parcae replay's
`ParcaeJob`, so the processes are the emulator's), with asynchronous dist checkpoints
every --save-interval iterations. While it trains:
- workers of the layout are SIGKILLed without notice at random moments, some right after
  a plan is published (while it is being applied) and some right after a checkpoint
  iteration is logged (while it is being saved); a new worker replaces each a few seconds
  later (a new instance). With --first-kill-at N the first kill comes as soon as iteration
  N is logged, whatever the clock: a run whose steps are much faster or slower than CPU
  ones still loses a worker with a snapshot behind it;
- the coordinator is SIGKILLed once and started again, and etcd is restarted once, each
  at a random moment, at the latest a quarter (the coordinator) or half (etcd) of the way
  through training: a run that trains fast still sees both.

Runs alternate between Adam's state whole on every worker and the distributed optimizer's
(`--use-distributed-optimizer`: each worker holds only its shard of the moments), unless
--optimizer picks one. Workers keep snapshots with buddy copies every --copy-interval steps
(reconfig/copies.py).

Then it checks what acceptance 1 of issue 7 asks:
- every run finishes, having had its coordinator and etcd restarts;
- the consumed-sample log: each logged iteration consumed exactly its own samples, none
  is skipped, and the iterations logged twice are exactly the lost steps the restarts
  reported;
- the final parameters equal an uninterrupted run's within 1e-5 relative (in norm, over
  the whole model: `parcae compare`); Adam's moments and the worst single tensor are
  reported beside them, with the same figures for two uninterrupted runs on 1 and 2
  processes (the float noise any layout change brings).
The JSON has, per run and in total, the kills, kills during migrations and at
checkpoints, recoveries (in place, from the survivors' state or from snapshots and their
buddy copies; or from the checkpoint) and lost steps. Exits 1 when a run fails a check.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_parcae.events import PlanPublished, read_events
from megatron_parcae.tools.compare import TOLERANCE, StateDifference, load_state
from megatron_parcae.tools.progress import Progress, counted
from megatron_parcae.tools.replay import (JobLog, ParcaeJob, ReplayError, children_temporary_folder, fresh_workdir,
                                          interrupt_on_signals)
from megatron_parcae.control.etcd import EtcdClient, EtcdError, JobStore

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "scripts/pretrain_gpt.py"
PROFILE = REPO / "configs/profiles/gpt-tiny-cpu.json"
RUN_LIMIT_S = 900.0
REPLACE_AFTER_S = 3.0  # a killed instance's replacement arrives this much later
TRIGGER_WAIT_S = 30.0  # a kill waiting for a migration or a checkpoint gives up after this


@dataclass
class RunReport:
    """One chaos run: what was done to it, how it recovered, and the checks."""

    run: int
    workers: int
    distributed_optimizer: bool = False
    finished: bool = False
    error: str | None = None
    wall_seconds: float = 0.0
    kills: int = 0
    kills_during_migration: int = 0
    kills_at_checkpoint: int = 0
    coordinator_restarts: int = 0
    etcd_restarts: int = 0
    recoveries_in_place: int = 0  # from replicas or copies
    recoveries_from_replicas: int = 0  # the survivors held the lost state
    recoveries_from_copies: int = 0  # rolled back to snapshots, the lost state from buddies
    checkpoint_fallbacks: int = 0
    restarts_before_training: int = 0  # the first layout lost a worker before its first step: nothing lost
    lost_steps: int = 0
    trained_samples: int = 0  # consumed less fp16's skipped steps
    repeated_iterations: int = 0
    sample_problems: list[str] = field(default_factory=list)
    difference: StateDifference | None = None  # final state against the uninterrupted run's

    @property
    def passed(self) -> bool:
        return (self.finished and self.error is None and not self.sample_problems
                and self.difference is not None and self.difference.params <= TOLERANCE)


def check_samples(trained: list[tuple[int, int]], global_batch: int, iterations: int,
                  lost_steps: int) -> tuple[list[str], int]:
    """Problems in the consumed-sample log, and how many iterations it repeats."""
    problems, repeated, expected = [], 0, 1
    for iteration, consumed in trained:
        if consumed != iteration * global_batch:
            problems.append(f"iteration {iteration} logged {consumed} consumed samples, not {iteration * global_batch}")
        if iteration < expected:
            repeated += 1
        elif iteration > expected:
            problems.append(f"iterations {expected} to {iteration - 1} were never logged")
            expected = iteration + 1
        else:
            expected += 1
    if expected != iterations + 1:
        problems.append(f"training stopped at iteration {expected - 1} of {iterations}")
    if repeated != lost_steps:
        problems.append(f"{repeated} iterations were trained twice, the restarts reported {lost_steps} lost steps")
    return problems, repeated


class Chaos:
    """The disruptions of one run, driven from the benchmark's loop (see the module docstring)."""

    def __init__(self, job: ParcaeJob, store: JobStore, rng: random.Random, report: RunReport,
                 iterations: int, save_interval: int, max_kills: int, first_kill_at: int | None = None) -> None:
        self.job, self.store, self.rng, self.report = job, store, rng, report
        self.save_interval, self.max_kills, self.first_kill_at = save_interval, max_kills, first_kill_at
        self.started = time.monotonic()
        self.next_kill = rng.uniform(8, 16)
        self.kill_trigger: str | None = None
        self.trigger_since = 0.0
        self.trigger_mark = 0
        self.replace_at: float | None = None
        self.coordinator_down_at = rng.uniform(12, 40)
        self.coordinator_down_by = max(1, iterations // 4)  # the iteration it happens at, at the latest
        self.coordinator_up_at: float | None = None
        self.etcd_restart_at = rng.uniform(15, 50)
        self.etcd_restart_by = max(1, iterations // 2)

    def tick(self) -> None:
        now = time.monotonic() - self.started
        iteration = self.job.log.iteration
        if self.replace_at is not None and now >= self.replace_at:
            self.job.resize(self.report.workers)
            self.replace_at = None
        if self.coordinator_down_at is not None and (now >= self.coordinator_down_at
                                                     or iteration >= self.coordinator_down_by):
            self.job.kill_coordinator()
            self.coordinator_down_at, self.coordinator_up_at = None, now + self.rng.uniform(2, 6)
        if self.coordinator_up_at is not None and now >= self.coordinator_up_at:
            self.job.start_coordinator()
            self.coordinator_up_at = None
            self.report.coordinator_restarts += 1
        if self.etcd_restart_at is not None and (now >= self.etcd_restart_at or iteration >= self.etcd_restart_by):
            self.job.restart_etcd()
            self.etcd_restart_at = None
            self.report.etcd_restarts += 1
        if self.first_kill_at is not None and self.report.kills == 0 < self.max_kills:
            if iteration >= self.first_kill_at and self._kill_a_layout_worker():
                self._killed(now)
        elif self.report.kills < self.max_kills and now >= self.next_kill:
            self._kill_when_due(now)

    def _kill_when_due(self, now: float) -> None:
        if self.kill_trigger is None:
            self.kill_trigger = self.rng.choice(["anytime", "migration", "checkpoint"])
            self.trigger_since = now
            self.trigger_mark = (self._generation() if self.kill_trigger == "migration"
                                 else self.job.log.iteration)
        due = self.kill_trigger == "anytime" or now - self.trigger_since > TRIGGER_WAIT_S
        if self.kill_trigger == "migration":
            due = due or self._generation() > self.trigger_mark
        elif self.kill_trigger == "checkpoint":
            iteration = self.job.log.iteration
            due = due or (iteration > self.trigger_mark and iteration % self.save_interval == 0)
        if due and self._kill_a_layout_worker():
            self._killed(now)

    def _killed(self, now: float) -> None:
        self.kill_trigger = None
        self.next_kill = now + self.rng.uniform(8, 20)
        self.replace_at = now + REPLACE_AFTER_S

    def _generation(self) -> int:
        try:
            return self.store.current_generation()
        except EtcdError:  # etcd is restarting
            return self.trigger_mark

    def _kill_a_layout_worker(self) -> bool:
        try:
            plan = self.store.latest_plan()
            members = self.store.members()
        except EtcdError:
            return False
        if plan is None:
            return False
        victims = sorted(set(plan.layout["slots"]) & set(self.job.alive()))
        if not victims:
            return False
        applying = any(m.generation < plan.generation for w, m in members.items() if w in plan.layout["slots"])
        at_checkpoint = self.job.log.iteration % self.save_interval == 0 and self.job.log.iteration > 0
        self.job.kill_worker(self.rng.choice(victims))
        self.report.kills += 1
        self.report.kills_during_migration += int(applying)
        self.report.kills_at_checkpoint += int(at_checkpoint and not applying)
        return True


def recoveries(workdir: Path, log: JobLog) -> dict[str, int]:
    """The applied plans the coordinators published for lost workers, by where their state
    came from (PlanPublished.RECOVERIES), and "before_training": restarts of a job that had
    not trained a step (a kill while the first layout was built), which lose nothing."""
    applied = {c["generation"]: c for c in log.changes}
    found = dict.fromkeys((*PlanPublished.RECOVERIES, "before_training"), 0)
    for path in workdir.glob("coordinator-*.events.jsonl"):
        for plan in read_events(path):
            if isinstance(plan, PlanPublished) and plan.generation in applied and plan.recovery:
                change = applied[plan.generation]
                idle = plan.recovery == "checkpoint" and change["iteration"] == 0 and not change["lost_steps"]
                found["before_training" if idle else plan.recovery] += 1
    return found


def chaos_run(index: int, rng: random.Random, workdir: Path, flags: list[str], iterations: int,
              global_batch: int, save_interval: int, max_kills: int, reference: dict[str, dict],
              first_kill_at: int | None = None) -> RunReport:
    report = RunReport(index, rng.randint(4, 6), "--use-distributed-optimizer" in flags)
    fresh_workdir(workdir)
    save = workdir / "checkpoints"
    job = ParcaeJob(SCRIPT, [*flags, "--save", str(save), "--save-interval", str(save_interval), "--async-save"], workdir,
                    PROFILE, grace_seconds=10.0, interval_seconds=2.0, max_instances=6, seed=rng.randrange(2**31))
    started = time.monotonic()
    try:
        with EtcdClient(job.endpoint, timeout=5) as client:
            chaos = Chaos(job, JobStore(client, job.job), rng, report, iterations, save_interval, max_kills,
                          first_kill_at)
            job.resize(report.workers)
            while not job.check():
                if time.monotonic() - started > RUN_LIMIT_S:
                    raise ReplayError(f"training did not end within {RUN_LIMIT_S:g} s (logs in {workdir})")
                chaos.tick()
                time.sleep(0.05)
        report.finished = True
        if (report.coordinator_restarts, report.etcd_restarts) != (1, 1):
            report.error = (f"training ended after {report.coordinator_restarts} coordinator restarts and "
                            f"{report.etcd_restarts} etcd restarts, not one of each")
    except (ReplayError, EtcdError) as exc:
        report.error = str(exc)[-2000:]
    finally:
        job.stop()
        report.wall_seconds = round(time.monotonic() - started, 1)
    report.lost_steps = job.log.lost_steps
    report.trained_samples = job.log.trained_samples
    found = recoveries(workdir, job.log)
    report.recoveries_from_replicas, report.recoveries_from_copies = found["replicas"], found["copies"]
    report.recoveries_in_place = found["replicas"] + found["copies"]
    report.checkpoint_fallbacks = found["checkpoint"]
    report.restarts_before_training = found["before_training"]
    report.sample_problems, report.repeated_iterations = check_samples(job.log.trained, global_batch, iterations,
                                                                       report.lost_steps)
    if report.finished:
        try:
            report.difference = StateDifference.of(load_state(save, flags, "gpt"), reference)
        except Exception as exc:  # an unreadable final checkpoint fails this run, not the benchmark
            report.error = f"the final checkpoint under {save} does not load: {str(exc)[-1000:]}"
    return report


def uninterrupted_state(workdir: Path, flags: list[str], processes: int) -> dict[str, dict]:
    """An uninterrupted run of the same flags on `processes` (data parallel), saved at the end."""
    fresh_workdir(workdir)
    save = workdir / "checkpoints"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), SCRIPT, *flags,
           "--save", str(save)]
    with (workdir / "reference.log").open("w") as out:
        subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=RUN_LIMIT_S)
    return load_state(save, flags, "gpt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=40, help="training iterations of each run")
    parser.add_argument("--save-interval", type=int, default=10, help="checkpoint interval (iterations)")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs of workers in each run")
    parser.add_argument("--optimizer", choices=("alternate", "plain", "distributed"), default="alternate",
                        help="Adam's state whole on every worker (plain), sharded over data parallelism "
                             "(--use-distributed-optimizer), or the two in turn (default)")
    parser.add_argument("--copy-interval", type=int, default=10,
                        help="the workers' --parcae-copy-interval (0: no snapshots)")
    parser.add_argument("--first-kill-at", type=int, metavar="ITERATION",
                        help="the first kill as soon as this iteration is logged (default: at a random moment)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("chaos"))
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    interrupt_on_signals()  # SIGTERM stops the run's processes as Ctrl-C does
    if args.runs < 1 or args.iterations < 1 or args.save_interval < 1 or args.kills < 0 or args.copy_interval < 0:
        parser.error("--runs, --iterations and --save-interval must be positive, --kills and --copy-interval at "
                     "least 0")
    if args.first_kill_at is not None and not 0 < args.first_kill_at < args.iterations:
        parser.error(f"--first-kill-at must be an iteration from 1 to {args.iterations - 1}")
    flags = ["--config", "configs/gpt-tiny.yaml", "--train-iters", str(args.iterations), "--lr", "3e-4",
             "--min-lr", "3e-5", "--log-interval", "1"]
    global_batch = 32  # configs/gpt-tiny.yaml
    args.workdir.mkdir(parents=True, exist_ok=True)
    # The children's temporary folder: the workers it kills leave theirs there.
    with children_temporary_folder("parcae-chaos-"), Progress("chaos") as progress:
        progress.update("uninterrupted runs on 1 and 2 processes")
        reference = uninterrupted_state(args.workdir / "reference", flags, 1)
        noise_floor = StateDifference.of(uninterrupted_state(args.workdir / "reference-2", flags, 2), reference)
        progress.print(f"uninterrupted, 2 processes against 1: {noise_floor}")
        reports = []
        runs_from = progress.elapsed
        progress.status = lambda elapsed: counted(len(reports), args.runs, "runs", elapsed - runs_from)
        for index in range(args.runs):
            rng = random.Random(args.seed * 1_000_003 + index)
            distributed = args.optimizer == "distributed" or (args.optimizer == "alternate" and index % 2 == 1)
            run_flags = [*flags, "--parcae-copy-interval", str(args.copy_interval),
                         *(["--use-distributed-optimizer"] if distributed else [])]
            report = chaos_run(index, rng, args.workdir / f"run-{index:02d}", run_flags, args.iterations, global_batch,
                               args.save_interval, args.kills, reference, args.first_kill_at)
            reports.append(report)
            progress.print(f"run {index:2d}: {'ok  ' if report.passed else 'FAIL'} {report.workers} workers"
                           f"{', distributed optimizer' if distributed else ''}, {report.kills} kills "
                           f"({report.kills_during_migration} in migrations, "
                           f"{report.kills_at_checkpoint} at checkpoints), "
                           f"{report.recoveries_in_place} in place ({report.recoveries_from_replicas} from replicas, "
                           f"{report.recoveries_from_copies} from copies), "
                           f"{report.checkpoint_fallbacks} from checkpoints"
                           + (f" (and {report.restarts_before_training} before training)"
                              if report.restarts_before_training else "")
                           + f", {report.lost_steps} lost steps, {report.difference}, {report.wall_seconds:.0f} s"
                           + (f"; {report.error or ''} {' '.join(report.sample_problems)}"
                              if not report.passed else ""))
    totals = {key: sum(getattr(r, key) for r in reports) for key in (
        "kills", "kills_during_migration", "kills_at_checkpoint", "coordinator_restarts", "etcd_restarts",
        "recoveries_in_place", "recoveries_from_replicas", "recoveries_from_copies", "checkpoint_fallbacks",
        "restarts_before_training", "lost_steps", "repeated_iterations")}
    differences = [r.difference for r in reports if r.difference is not None]
    summary = {"runs": len(reports), "passed": sum(r.passed for r in reports),
               "finished": sum(r.finished for r in reports), **totals,
               "in_place_share": round(totals["recoveries_in_place"]
                                       / max(1, totals["recoveries_in_place"] + totals["checkpoint_fallbacks"]), 3),
               "distributed_optimizer_runs": sum(r.distributed_optimizer for r in reports),
               "copy_interval": args.copy_interval,
               "max_params_rel_diff": max((d.params for d in differences), default=None),
               "max_moments_rel_diff": max((d.moments for d in differences), default=None),
               "max_tensor_rel_diff": max((d.worst_tensor_diff for d in differences), default=None),
               "tolerance": TOLERANCE, "noise_floor_2_vs_1_processes": asdict(noise_floor)}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "command": " ".join(sys.argv),
                                         "runs": [asdict(r) for r in reports]}, indent=1))
    return 0 if summary["passed"] == len(reports) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("chaos: interrupted; every process it started is stopped", file=sys.stderr, flush=True)
        sys.exit(130)
