"""What the elastic mode relies on, checked on a real SLURM 22.05 cluster on this machine
(tests/slurm_cluster.py): a job array on `spot` spreads over the nodes; a `prio` job
preempts just as many elements as it needs; their job steps get SIGTERM at once, are
killed a grace time later and requeued; they run again with SLURM_RESTART_COUNT=1."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import wait_for
from slurm_cluster import GRACE_S, GRACE_TIMER_S, KILL_WAIT_S, NODES, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TASKS = [str(t) for t in range(NODES)]
PRIO_NODES = 2
PRIO_SECONDS = 3

# One array element: records who it is, marks every SIGTERM with its time and goes on (a
# worker handing its state over in the grace time); touches `alive` until it is killed.
ELEMENT = """
import json, os, signal, sys, time
from pathlib import Path

out = Path(sys.argv[1])
task, restart = os.environ["SLURM_ARRAY_TASK_ID"], os.environ.get("SLURM_RESTART_COUNT")
run = out / f"task{task}.run{restart or 0}"

def on_term(signum, frame):
    with open(f"{run}.term", "a") as f:
        f.write(f"{time.time()}\\n")

signal.signal(signal.SIGTERM, on_term)
Path(f"{run}.json").write_text(json.dumps({"task": task, "restart": restart, "node": os.environ["SLURMD_NODENAME"],
                                           "job": os.environ["SLURM_JOB_ID"], "start": time.time()}))
alive = Path(f"{run}.alive")
while True:
    alive.touch()
    time.sleep(0.2)
"""


@dataclass
class SpotArray:
    cluster: SlurmCluster
    job: str
    out: Path

    def run(self, task: str, restart: int) -> dict | None:
        path = self.out / f"task{task}.run{restart}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def terms(self, task: str, restart: int = 0) -> list[float]:
        path = self.out / f"task{task}.run{restart}.term"
        return [float(t) for t in path.read_text().split()] if path.exists() else []

    def last_alive(self, task: str, restart: int = 0) -> float:
        return (self.out / f"task{task}.run{restart}.alive").stat().st_mtime

    def elements(self) -> dict[str, dict[str, str]]:
        return {r["ArrayTaskId"]: r for r in self.cluster.jobs(self.job)}


@pytest.fixture(scope="module")
def spot_array(slurm_cluster, tmp_path_factory):
    """A 1-node array of NODES elements on spot, one node each, all running."""
    out = tmp_path_factory.mktemp("spot")
    (out / "element.py").write_text(ELEMENT)
    # 22.05 sends the preemption's first SIGTERM to job steps only: the element is a step.
    batch = out / "element.sbatch"
    batch.write_text(f"#!/bin/bash\nexec srun --ntasks=1 {sys.executable} {out / 'element.py'} {out}\n")
    job = slurm_cluster.submit(batch, "--partition=spot", f"--array=0-{NODES - 1}", "--nodes=1", "--exclusive",
                               "--requeue", f"--chdir={out}", f"--output={out}/array-%a.out", "--job-name=spot")
    array = SpotArray(slurm_cluster, job, out)
    try:
        slurm_cluster.wait_state(job, "RUNNING", count=NODES, timeout=60)
        wait_for(lambda: all(array.run(t, 0) for t in TASKS), 30, "every element to start its step")
        yield array
    finally:
        slurm_cluster.cancel(job)


@dataclass
class Preemption:
    submitted: float  # when the prio job was submitted
    prio: dict[str, str]  # its scontrol record, once completed
    prio_nodes: set[str]
    prio_start: float
    requeued: set[str]  # array task ids with Restarts=1


@pytest.fixture(scope="module")
def preemption(slurm_cluster, spot_array):
    """A 2-node prio job submitted while the array fills every node, run to its end; then
    the requeued elements running again."""
    script = spot_array.out / "prio.sbatch"
    script.write_text(f"#!/bin/bash\necho \"$(date +%s.%N)\" >{spot_array.out}/prio.start\nsleep {PRIO_SECONDS}\n")
    submitted = time.time()
    job = slurm_cluster.submit(script, "--partition=prio", f"--nodes={PRIO_NODES}", "--exclusive",
                               f"--output={spot_array.out}/prio.out", "--job-name=prio")
    # Grace time, slurmctld's grace timer, KillWait, the job itself and scheduling.
    [prio] = slurm_cluster.wait_state(job, "COMPLETED", timeout=GRACE_S + GRACE_TIMER_S + KILL_WAIT_S + 30)
    # Requeued elements are held cred_expire + 1 = 11 s, then run on the freed nodes.
    def rerun(record: dict[str, str]) -> bool:
        return record.get("Restarts", "0") != "0"

    slurm_cluster.wait(spot_array.job, lambda records: sum(rerun(r) and r.get("JobState") == "RUNNING"
                                                          for r in records) >= PRIO_NODES, 60, "requeued and running")
    requeued = {t for t, r in spot_array.elements().items() if rerun(r)}
    wait_for(lambda: all(spot_array.run(t, 1) for t in requeued), 30, "the requeued elements' steps to start")
    prio_nodes = set(slurm_cluster.run("scontrol", "show", "hostnames", prio["NodeList"]).split())
    return Preemption(submitted, prio, prio_nodes, float((spot_array.out / "prio.start").read_text()), requeued)


def test_array_elements_run_on_different_nodes(spot_array):
    runs = {t: spot_array.run(t, 0) for t in TASKS}
    assert {t: r["task"] for t, r in runs.items()} == {t: t for t in TASKS}
    assert len({r["node"] for r in runs.values()}) == NODES, runs
    elements = spot_array.elements()
    assert {t: elements[t]["NodeList"] for t in TASKS} == {t: r["node"] for t, r in runs.items()}
    # The first run has no restart count (unset, not 0).
    assert all(r["restart"] in (None, "0") for r in runs.values()), runs


def test_prio_job_preempts_just_enough_elements_which_run_again(spot_array, preemption):
    first = {t: spot_array.run(t, 0) for t in TASKS}
    assert len(preemption.requeued) == PRIO_NODES, spot_array.elements()
    # Those elements' steps were told (SIGTERM), the others were left alone.
    assert {t for t in TASKS if spot_array.terms(t)} == preemption.requeued
    # The prio job got exactly the nodes the preempted elements had, after they were killed.
    assert preemption.prio_nodes == {first[t]["node"] for t in preemption.requeued}
    assert all(preemption.prio_start >= spot_array.last_alive(t) for t in preemption.requeued)
    elements = spot_array.elements()
    for t in TASKS:
        if t in preemption.requeued:
            again = spot_array.run(t, 1)
            assert again["restart"] == "1" and again["job"] == first[t]["job"] and elements[t]["Restarts"] == "1"
        else:
            assert elements[t]["JobState"] == "RUNNING" and elements[t]["Restarts"] == "0", elements[t]
            assert spot_array.run(t, 1) is None


def test_sigterm_comes_at_once_and_the_kill_a_grace_time_later(spot_array, preemption, record_property):
    for t in sorted(preemption.requeued):
        terms = spot_array.terms(t)
        notice = terms[0] - preemption.submitted
        kill = spot_array.last_alive(t) - terms[0]
        record_property(f"task{t}_notice_s", round(notice, 2))
        record_property(f"task{t}_kill_after_sigterm_s", round(kill, 2))
        print(f"task {t}: SIGTERM {notice:.2f}s after the prio submit, killed {kill:.2f}s after it "
              f"(GraceTime {GRACE_S}s); SIGTERMs at +{[round(x - terms[0], 2) for x in terms]}")
        assert 0 <= notice < 15
        # The grace end is found by a 30 s timer, then KillWait before SIGKILL.
        assert GRACE_S <= kill <= GRACE_S + GRACE_TIMER_S + KILL_WAIT_S + 5
