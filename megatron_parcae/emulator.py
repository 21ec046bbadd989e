"""The spot emulator: replay a real availability trace on one machine with real processes.

A trace segment (predictor.AvailabilityTrace, cut and scaled to this machine) becomes a
list of `ReplayStep`s in wall-clock time (`--speedup` trace seconds per second). Each
step tells the job under test how many instances it has from then on; instances that
go away are preempted as a cloud does it: SIGTERM, then SIGKILL after the grace period.

Jobs under test implement `resize(count)` and `stop()`:
- `CheckpointRestartJob` is the reactive baseline (what users run today): a torchrun job
  with periodic dist checkpoints that is killed and restarted from its last checkpoint on
  every change of the instance count.
A `JobLog` follows what rank 0 logs (iterations, consumed samples, loss, checkpoints),
which is all a summary needs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_parcae.arguments import ArgumentError, parse_args

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) .*?\| lm loss: ([0-9.E+-]+) \|")
_SAVED = re.compile(r"saved checkpoint at iteration (\d+)")
_LOADED = re.compile(r"loaded checkpoint .* at iteration (\d+)")


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
    """What rank 0 of a pretraining script has logged so far."""

    iteration: int = 0
    consumed_samples: int = 0
    loss: float | None = None
    saved_iteration: int = 0
    lost_steps: int = 0
    losses: dict[int, float] = field(default_factory=dict)

    def feed(self, line: str) -> None:
        if m := _ITERATION.search(line):
            self.iteration, self.consumed_samples = int(m.group(1)), int(m.group(2))
            self.loss = float(m.group(3))
            self.losses[self.iteration] = self.loss
        elif m := _SAVED.search(line):
            self.saved_iteration = int(m.group(1))
        elif m := _LOADED.search(line):
            self.iteration = int(m.group(1))


def largest_world(command_args: list[str], model: str, available: int) -> int:
    """The most processes (<= available) the command's layout flags accept, or 0."""
    for world in range(available, 0, -1):
        try:
            parse_args(command_args, prog="replay", model=model, world_size=world)
            return world
        except ArgumentError:
            continue
    return 0


class CheckpointRestartJob:
    """Reactive checkpoint-restart: restart torchrun from the last checkpoint on every change."""

    def __init__(self, script: str, command_args: list[str], checkpoint_dir: Path, save_interval: int,
                 grace_seconds: float, log_file: Path) -> None:
        self.script = script
        self.model = "bert" if "bert" in Path(script).name else "gpt"
        self.args = command_args
        self.checkpoint_dir = checkpoint_dir
        self.save_interval = save_interval
        self.grace_seconds = grace_seconds
        self.log = JobLog()
        self.restarts: list[dict] = []
        self._log_file = log_file.open("a")
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._log_file.write(line)
            self.log.feed(line)
        self._log_file.flush()

    def resize(self, count: int) -> None:
        started = time.monotonic()
        self._kill(keep_progress=False)
        world = largest_world(self.args, self.model, count)
        self.restarts.append({"at": started, "instances": count, "processes": world,
                              "from_iteration": self.log.saved_iteration})
        if world == 0:
            return
        resume = ["--load", str(self.checkpoint_dir)] if (self.checkpoint_dir / "latest_checkpointed_iteration.txt").exists() else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               self.script, *self.args, "--save", str(self.checkpoint_dir), "--save-interval",
               str(self.save_interval), *resume]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, args=(self._proc,), daemon=True)
        self._reader.start()

    def _kill(self, keep_progress: bool) -> None:
        """Preempt every process of the job: SIGTERM, SIGKILL after the grace period.

        Unless `keep_progress` (the end of the replay), what was trained since the last
        checkpoint is lost.
        """
        if self._proc is None:
            return
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(self.grace_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._reader.join()
        self._proc = None
        if not keep_progress:
            self.log.lost_steps += self.log.iteration - self.log.saved_iteration
            self.log.iteration = self.log.saved_iteration

    def stop(self) -> None:
        """End of the replay: what the job has trained so far counts."""
        self._kill(keep_progress=True)
        self._log_file.close()


def replay(steps: list[ReplayStep], job, duration_seconds: float) -> float:
    """Drive `job` through the steps in wall-clock time; returns the seconds it took."""
    start = time.monotonic()
    for step in steps:
        time.sleep(max(0.0, start + step.at_seconds - time.monotonic()))
        job.resize(step.count)
    time.sleep(max(0.0, start + duration_seconds - time.monotonic()))
    job.stop()
    return time.monotonic() - start
