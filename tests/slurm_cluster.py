"""A real SLURM cluster on this machine for a test session (scripts/slurm/local-cluster.sh):
the `slurm_cluster` fixture and the handle it yields. conftest.py registers the fixture, so
a test process starts one cluster at most, which every SLURM test module shares; without
root, apt-get or the packages, their tests are skipped."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import REPO

SCRIPT = REPO / "scripts" / "slurm" / "local-cluster.sh"
UNAVAILABLE = 3  # the script's exit status where SLURM cannot be had
NODES = 4  # of spot and prio
CONTROL_NODES = 1  # of control: never preempted, for the elastic mode's control job
ONDEMAND_NODES = 2  # of ondemand: never preempts, never preempted, for on-demand instances
GRACE_S = 5  # GraceTime of the spot partition
KILL_WAIT_S = 5  # KillWait in the script's slurm.conf
GRACE_TIMER_S = 30  # slurmctld looks for ended grace times on this fixed timer (22.05)
START_TIMEOUT_S = 180  # the first start may install the packages


def parse_record(line: str) -> dict[str, str]:
    """One line of `scontrol show job -o` as a dict; a value with spaces (Reason=...) keeps them."""
    record: dict[str, str] = {}
    key = None
    for word in line.split():
        name, eq, value = word.partition("=")
        if eq and name[:1].isalpha() and all(c.isalnum() or c in "/:_" for c in name):
            key = name
            record[key] = value
        elif key is not None:
            record[key] += " " + word
    return record


@dataclass
class SlurmCluster:
    base: Path
    env: dict[str, str]  # SLURM_CONF and the script's settings; no SLURM_* of a job around the tests

    def run(self, *command: str, timeout: float = 30) -> str:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, f"{' '.join(command)} -> {result.returncode}: {result.stderr}"
        return result.stdout

    def submit(self, script: Path, *options: str) -> str:
        """sbatch OPTIONS SCRIPT; the job id."""
        return self.run("sbatch", "--parsable", *options, str(script)).strip().split(";")[0]

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job -o JOB`: one record per job, per array element (pending ones
        may share one record). Empty once SLURM has forgotten the job."""
        result = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env, capture_output=True,
                                text=True, timeout=30)
        if result.returncode != 0 and "Invalid job id" in result.stderr:
            return []
        assert result.returncode == 0, result.stderr
        return [parse_record(line) for line in result.stdout.splitlines() if line.strip()]

    def wait(self, job_id: str, done: Callable[[list[dict[str, str]]], bool], timeout: float,
             what: str) -> list[dict[str, str]]:
        """Poll the job's records until done(records); fail after timeout seconds, with the
        records and the end of slurmctld's log."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.jobs(job_id)
            if done(records):
                return records
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id}: not {what} after {timeout:.0f}s: {records}\n{self.log_tail()}")
            time.sleep(0.5)

    def wait_state(self, job_id: str, *states: str, count: int = 1, timeout: float = 60) -> list[dict[str, str]]:
        """Wait until at least `count` records of the job are in one of `states`."""
        return self.wait(job_id, lambda records: sum(r.get("JobState") in states for r in records) >= count,
                         timeout, f"{count} x {'/'.join(states)}")

    def cancel(self, job_id: str, timeout: float = 60) -> None:
        """scancel the job (all its elements) and wait until none of it is left running."""
        self.run("scancel", "--full", job_id)
        active = {"PENDING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED", "CONFIGURING"}
        self.wait(job_id, lambda records: not any(r.get("JobState") in active for r in records), timeout, "ended")

    def log_lines(self, keep: Callable[[str], bool]) -> str:
        """slurmctld's log lines for which keep(line) holds."""
        return "".join(line for line in self._log() if keep(line))

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self._log()[-lines:])

    def _log(self) -> list[str]:
        """slurmctld's log, line by line (none before it starts)."""
        log = self.base / "log" / "slurmctld.log"
        return log.read_text(errors="replace").splitlines(keepends=True) if log.exists() else []


def _free_port_block(first: int, size: int) -> int:
    """The first port P >= first with P..P+size-1 free on all interfaces (slurmctld, then slurmd's)."""
    for port in range(first, 60000, size):
        try:
            for p in range(port, port + size):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port block")


@pytest.fixture(scope="session")
def slurm_cluster():
    """A cluster of NODES nodes (partitions spot and prio), CONTROL_NODES (partition
    control) and ONDEMAND_NODES (partition ondemand) in its own directory and ports: a
    user's cluster or another pytest worker's is left alone. Stopped at the end."""
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root")
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and there is no apt-get to install it")
    # Not under pytest's tmp_path: munged wants every directory to its socket searchable by all.
    base = Path(tempfile.mkdtemp(prefix="parcae-slurm-"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PARCAE_SLURM_DIR=str(base), PARCAE_SLURM_NODES=str(NODES), PARCAE_SLURM_GRACE=str(GRACE_S),
               PARCAE_SLURM_CONTROL_NODES=str(CONTROL_NODES), PARCAE_SLURM_ONDEMAND_NODES=str(ONDEMAND_NODES),
               PARCAE_SLURM_PORT=str(_free_port_block(17817 + 50 * worker,
                                                      NODES + CONTROL_NODES + ONDEMAND_NODES + 1)),
               SLURM_CONF=str(base / "slurm.conf"))
    try:
        start = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True,
                               timeout=START_TIMEOUT_S)
        if start.returncode == UNAVAILABLE:
            pytest.skip(start.stderr.strip().splitlines()[-1])
        assert start.returncode == 0, f"local-cluster.sh start -> {start.returncode}: {start.stdout}{start.stderr}"
        yield SlurmCluster(base, env)
    finally:
        stop = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
        if stop.returncode == 0:
            shutil.rmtree(base, ignore_errors=True)
        else:  # keep the logs
            print(f"local-cluster.sh stop -> {stop.returncode}: {stop.stderr} (logs in {base})")
