"""The elastic mode on a real SLURM 22.05 cluster (tests/slurm_cluster.py): `parcae slurm
submit` trains GPT-tiny on four one-node elements of `spot`, with etcd and the coordinator
in a control job on `control`. A two-node `prio` job preempts two elements: the job moves
in place to the other two within the grace time; once the prio job has ended, the
requeued elements rejoin and the layout grows back. Training then ends normally, every
sample consumed once, with the parameters of an uninterrupted run. Then `parcae slurm
cancel` on a second job, and a job of two elements that a `prio` job preempts together:
its workers save a checkpoint within the grace time and exit, and the requeued elements
resume from it without losing a step."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from helpers import REPO, SMALL_GPT, assert_same_state, child_env, hooks_env, processes_mentioning, wait_for
from megatron_parcae.events import Event, Iteration, LayoutChange, Load, PlanPublished, Save, read_events
from slurm_cluster import GRACE_S, NODES, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ITERS = 400
TRAIN = [*SMALL_GPT, "--train-iters", str(ITERS), "--lr", "3e-4", "--min-lr", "3e-5"]
GLOBAL_BATCH = 8
# The job's steps are paced (tests/hooks/paced.py) until the layout grew back (at
# most REJOIN_TIMEOUT_S), so that training outlasts SLURM's fixed delays on any machine:
# the grace time ends on a timer, a requeued element is held 11 s, then its workers import
# torch. On 2 cores beside the other SLURM test the rejoin took 21-34 s, and once 87 s:
# longer than 200 steps at 0.4 s, where training had ended before it. A step takes
# STEP_SECONDS over the layout's world size: 0.4 s on four workers, 0.8 s on two.
STEP_SECONDS = 1.6
REJOIN_TIMEOUT_S = 300
PRIO_NODES = 2
START_ITERATIONS = 5  # trained by four workers before the prio job comes
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")

# A layer profile of SMALL_GPT's shape (the workers refuse another) on which more workers
# train faster: the coordinator uses every worker it has (as tests/test_coordinator.py's).
UNIT = {"forward_ms": 20.0, "backward_ms": 40.0, "optimizer_ms": 0.5, "activation_bytes": 1e6, "output_bytes": 1e5}
PROFILE = {"format": "megatron-parcae-layer-profile", "version": 1, "model": "small", "device": "test",
           "micro_batch_size": 2, "global_batch_size": GLOBAL_BATCH, "gpu_memory_bytes": 1e9,
           "link_bytes_per_second": 1.25e9, "tensor_parallel_bytes_per_second": 1e11, "max_tensor_parallel": 1,
           "memory_bytes_per_param": 16, "gradient_bytes_per_param": 2,
           "model_shape": {"kind": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                           "ffn_hidden_size": 256, "vocab_size": 384, "max_position_embeddings": 32},
           "embedding": UNIT, "layers": [UNIT] * 4, "head": UNIT}


def parcae_slurm(cluster: SlurmCluster, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_parcae.cli", "slurm", *args], cwd=REPO,
                          env={**cluster.env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env},
                          capture_output=True, text=True, timeout=timeout)


def submit(cluster: SlurmCluster, folder: Path, name: str, instances: int, *train: str, grace: int = GRACE_S,
           **env: str) -> tuple[str, str, str]:
    """`parcae slurm submit` of a job on spot (whose GraceTime is `grace`); (control job id,
    array id, its output)."""
    (folder / "profile.json").write_text(json.dumps(PROFILE))
    config = folder / "coordinator.yaml"
    # A minute's lookahead, as a real job's intervals give. Over 8 s, growing back did not
    # pay for its change once the layout of four had been priced by its first seconds,
    # slowed by the other SLURM test's start (0.91 s a step, 0.4 s paced, against 1.0 s
    # on two), and the job never grew back; over 60 s it grows back while four are priced
    # at least 2% faster than two.
    config.write_text(f"profile: {folder / 'profile.json'}\ninterval-seconds: 2\nlookahead: 30\n"
                      f"grace-seconds: {grace}\nlease-seconds: 2\nmax-workers: {NODES}\n"
                      f"min-workers: {instances}\n")
    result = parcae_slurm(cluster, "submit", "--partition", "spot", "--control-partition", "control",
                          "--instances", str(instances), "--gres", "none", "--job-name", name,
                          "--coordinator-config", str(config), "--run-dir", str(folder / "run"), "--", *train, **env)
    assert result.returncode == 0, result.stderr
    control, array = (re.search(rf"{what} (\d+)", result.stdout).group(1) for what in ("control job", "worker array"))
    return control, array, result.stdout


def cancel_leftovers(cluster: SlurmCluster, name: str) -> None:
    if cluster.run("squeue", "-h", "-n", name, "-o", "%i").strip():
        result = parcae_slurm(cluster, "cancel", "--job-name", name, timeout=400)
        print(result.stdout, result.stderr)


def logs(run_dir: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(run_dir.glob("*.out")))


def clock(stamp: str) -> float:
    """An scontrol time (local, whole seconds) as Unix seconds."""
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S").timestamp()


def world(event: LayoutChange | PlanPublished) -> int:
    return event.tp * event.pp * event.dp


def worker_events(run_dir: Path) -> list[Event]:
    """What the workers wrote, one file per element run, in time order."""
    return sorted((e for path in (run_dir / "events").glob("element-*.jsonl") for e in read_events(path)),
                  key=lambda e: e.time)


def plans(run_dir: Path) -> list[PlanPublished]:
    path = run_dir / "events" / "coordinator.jsonl"
    return [e for e in read_events(path) if isinstance(e, PlanPublished)] if path.exists() else []


def grown_back(run_dir: Path, instances: int) -> bool:
    """Whether a plan on every instance followed a smaller one that followed a whole one."""
    published = plans(run_dir)
    whole = [p.generation for p in published if world(p) == instances]
    smaller = [p.generation for p in published if whole and p.generation > whole[0] and world(p) < instances]
    return bool(smaller) and any(g > smaller[0] for g in whole)


@dataclass
class ElasticJob:
    name: str
    run_dir: Path
    control: str
    array: str
    submit_output: str
    prio_submitted: float = 0.0
    prio: dict[str, str] = field(default_factory=dict)  # the prio job's scontrol record, completed
    elements: dict[str, dict[str, str]] = field(default_factory=dict)  # by array task id, all ended
    control_record: dict[str, str] = field(default_factory=dict)
    slurm_log: str = ""  # slurmctld's lines on the job, the prio job and the nodes, once all ended

    def of(self, kind: type) -> list:
        return [e for e in worker_events(self.run_dir) if isinstance(e, kind)]

    def changes(self) -> tuple[PlanPublished, list[PlanPublished], PlanPublished]:
        """The coordinator's plans: the first on all instances, the shrinks after it, the
        growth back. One shrink, or two where the preempted elements' notices came further
        apart than the coordinator waits for the rest of a batch (a loaded machine)."""
        published = plans(self.run_dir)
        full = next(p for p in published if world(p) == NODES)
        grow = next((p for p in published if p.generation > full.generation and world(p) == NODES), None)
        assert grow is not None, \
            f"the layout did not grow back: {[(p.generation, p.workers, p.reason) for p in published]}\n" \
            f"{self.timeline()}\n{logs(self.run_dir)}"
        shrinks = [p for p in published if full.generation < p.generation < grow.generation]
        assert 1 <= len(shrinks) <= PRIO_NODES, [(p.generation, p.workers, p.reason) for p in published]
        return full, shrinks, grow

    def timeline(self) -> str:
        """When SLURM ran the prio job and each element, and when the coordinator planned."""
        lines = [f"prio submitted {datetime.fromtimestamp(self.prio_submitted):%H:%M:%S}, ran "
                 f"{self.prio.get('StartTime')} to {self.prio.get('EndTime')}"]
        lines += [f"element {task}: {r.get('JobState')}, restarts {r.get('Restarts')}, ran {r.get('StartTime')} to "
                  f"{r.get('EndTime')}" for task, r in sorted(self.elements.items())]
        lines += [f"plan {p.generation} at {datetime.fromtimestamp(p.time):%H:%M:%S}: {p.workers}, {p.reason}"
                  for p in plans(self.run_dir)]
        return "\n".join([*lines, "slurmctld:", self.slurm_log])

    def preempted(self) -> list[str]:
        """The array tasks slurmctld requeued for a preemption, one entry per requeue."""
        return re.findall(rf"preempted JobId={self.array}_(\d+)\(\d+\) has been requeued", self.slurm_log)

    def change_of(self, plan: PlanPublished) -> LayoutChange:
        [change] = [c for c in self.of(LayoutChange) if c.generation == plan.generation]
        return change


def run_preempted(cluster: SlurmCluster, folder: Path, name: str, instances: int, pace: str, prio_nodes: int,
                  prio_timeout: float, grace: int = GRACE_S, until_grown_back: bool = False) -> ElasticJob:
    """Submit a paced job of `instances` elements; once all of them train, a `prio` job of
    `prio_nodes` nodes preempts elements; returns the job once every part of it ended.
    With `until_grown_back`, steps are paced only until the layout is whole again."""
    pacing = folder / "pacing"
    if until_grown_back:
        pacing.touch()
    control, array, output = submit(cluster, folder, name, instances, *TRAIN, "--save-interval", str(ITERS),
                                    grace=grace, **hooks_env("paced"),
                                    PARCAE_TEST_STEP_SECONDS=pace,
                                    **({"PARCAE_TEST_PACE_WHILE": str(pacing)} if until_grown_back else {}))
    job = ElasticJob(name, folder / "run", control, array, output)

    def running_on_all() -> bool:
        full = [c for c in job.of(LayoutChange) if world(c) == instances]
        return bool(full) and any(e.iteration >= full[0].iteration + START_ITERATIONS for e in job.of(Iteration))

    try:
        wait_for(running_on_all, 300, f"{instances} workers to train {START_ITERATIONS} iterations")
    except AssertionError as exc:
        pytest.fail(f"{exc}\n{logs(job.run_dir)}")
    script = folder / "prio.sbatch"
    script.write_text("#!/bin/bash\nsleep 1\n")
    job.prio_submitted = time.time()
    prio = cluster.submit(script, "--partition=prio", f"--nodes={prio_nodes}", "--exclusive",
                          f"--output={folder}/prio.out", "--job-name=prio")
    [job.prio] = cluster.wait_state(prio, "COMPLETED", timeout=prio_timeout)
    if until_grown_back:
        try:
            wait_for(lambda: grown_back(job.run_dir, instances), REJOIN_TIMEOUT_S, "the layout to grow back")
        except AssertionError:
            pass  # the checks say what happened, with the logs
        finally:
            pacing.unlink()

    def ended(records: list[dict[str, str]]) -> bool:
        return bool(records) and all(r.get("JobState") in ENDED for r in records)

    try:
        records = cluster.wait(array, ended, 400, "ended")
        [job.control_record] = cluster.wait(control, ended, 150, "ended")
    except BaseException:
        print(logs(job.run_dir))
        raise
    job.elements = {r["ArrayTaskId"]: r for r in records}
    ids = {job.array, job.control, job.prio.get("JobId", "-")} | {r["JobId"] for r in records}
    job.slurm_log = cluster.log_lines(
        lambda line: f"JobId={job.array}_" in line or any(f"JobId={i} " in line for i in ids)
        or any(w in line.lower() for w in ("preempt", "requeue", "not responding", "down", "drain")))
    return job


class Reference:
    """The uninterrupted run, one process, in the background from the start of the module:
    the paced job leaves the CPU idle most of the time."""

    def __init__(self, folder: Path) -> None:
        self.save, self.log = folder / "checkpoints", folder / "reference.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
             str(REPO / "scripts" / "pretrain_gpt.py"), *TRAIN, "--save", str(self.save)],
            cwd=REPO, env=child_env(), stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def result(self) -> Path:
        assert self.process.wait(timeout=600) == 0, self.log.read_text()[-3000:]
        return self.save


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("reference"))
    yield ref
    if ref.process.poll() is None:
        ref.process.kill()
        ref.process.wait()


@pytest.fixture(scope="module")
def elastic_job(slurm_cluster, reference, tmp_path_factory):
    """The job of the module docstring, run to its end; cancelled if it does not get there."""
    folder = tmp_path_factory.mktemp("elastic")
    try:
        yield run_preempted(slurm_cluster, folder, "elastic", NODES, str(STEP_SECONDS), PRIO_NODES, 120,
                            until_grown_back=True)
    finally:
        cancel_leftovers(slurm_cluster, "elastic")


def test_elastic_job_moves_in_place_when_preempted_and_grows_back(elastic_job, reference, record_property):
    """One test, so that pytest-xdist runs the job once: each check below names what failed."""
    print(elastic_job.timeline())
    check_one_element_per_node(elastic_job)
    check_moved_in_place_within_the_grace_time(elastic_job, record_property)
    check_rejoined_and_grown_back(elastic_job, record_property)
    check_normal_end_every_sample_once_like_an_uninterrupted_run(elastic_job, reference.result())
    check_nothing_outlives_the_job(elastic_job)


def check_one_element_per_node(job: ElasticJob) -> None:
    assert f"parcae status --etcd $(cat {job.run_dir}/control-{job.control}/etcd-endpoint) --job {job.name}" \
        in job.submit_output
    assert job.control_record["Partition"] == "control" and job.control_record["JobName"] == job.name
    assert sorted(job.elements) == [str(t) for t in range(NODES)]
    assert all(r["Partition"] == "spot" and r["JobName"] == job.name for r in job.elements.values())
    # Just two elements were preempted, once, and came back. (SLURM may requeue an element
    # for reasons of its own, a failed launch on a loaded machine: the job takes it in stride.)
    preempted = job.preempted()
    assert len(preempted) == len(set(preempted)) == PRIO_NODES, job.timeline()
    assert all(job.elements[task]["Restarts"] != "0" for task in preempted), job.timeline()


def check_moved_in_place_within_the_grace_time(job: ElasticJob, record_property) -> None:
    full, shrinks, _ = job.changes()
    moves = [job.change_of(shrink) for shrink in shrinks]
    for shrink, moved in zip(shrinks, moves):
        assert world(shrink) == NODES - PRIO_NODES and "notice" in shrink.reason, shrink
        assert moved.kind not in ("restart", "save-and-exit") and world(moved) == NODES - PRIO_NODES, moved
        assert moved.time - shrink.time < GRACE_S, (shrink, moved)
    assert not job.of(Load)  # no checkpoint was read, ever
    # The two workers kept are two that SLURM did not preempt.
    assert set(shrinks[-1].workers) < set(full.workers), (full, shrinks)
    first, last = shrinks[0], moves[-1]
    notice_s, move_s = first.time - job.prio_submitted, last.time - first.time
    record_property("notice_after_prio_submit_s", round(notice_s, 2))
    record_property("move_in_place_s", round(move_s, 2))
    print(f"notice {notice_s:.2f} s after the prio submit; moved in place {move_s:.2f} s later "
          f"({len(shrinks)} change(s), the last {last.kind} of {last.seconds:.2f} s), GraceTime {GRACE_S} s")
    assert notice_s < 15
    # The preempted elements' workers handed over and left; the elements waited for SLURM
    # to end them at the end of the grace time.
    for task in job.preempted():
        log = (job.run_dir / f"element-{task}.out").read_text()
        assert log.index("the workers exited (status 0)") < log.index("SIGTERM: ending"), log


def check_rejoined_and_grown_back(job: ElasticJob, record_property) -> None:
    _, shrinks, grow = job.changes()
    joined = set(grow.workers) - set(shrinks[-1].workers)
    assert len(joined) == PRIO_NODES and "join" in grow.reason, grow
    assert min(joined) > max(w for p in plans(job.run_dir) if p.generation < grow.generation for w in p.workers)
    grown = job.change_of(grow)
    assert grown.kind not in ("restart", "save-and-exit") and world(grown) == NODES
    restarted = max(clock(job.elements[task]["StartTime"]) for task in job.preempted())
    prio_end = clock(job.prio["EndTime"])
    record_property("rejoin_after_prio_end_s", round(grown.time - prio_end, 1))
    record_property("rejoin_after_element_restart_s", round(grown.time - restarted, 1))
    print(f"grown back {grown.time - prio_end:.1f} s after the prio job ended, {grown.time - restarted:.1f} s after "
          f"the requeued elements started again, at iteration {grown.iteration} of {ITERS}")


def check_normal_end_every_sample_once_like_an_uninterrupted_run(job: ElasticJob, reference: Path) -> None:
    for record in [job.control_record, *job.elements.values()]:
        assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", record
    assert (job.run_dir / f"control-{job.control}" / "done").exists()
    logged = job.of(Iteration)
    assert sorted(e.iteration for e in logged) == list(range(1, ITERS + 1)), "an iteration was skipped or repeated"
    assert all(e.consumed_samples == e.trained_samples == e.iteration * GLOBAL_BATCH for e in logged)
    assert_same_state(job.run_dir / "checkpoints", reference, TRAIN)


def check_nothing_outlives_the_job(job: ElasticJob) -> None:
    assert processes_mentioning(str(job.run_dir)) == []
    assert not (job.run_dir / f"control-{job.control}" / "etcd-endpoint").exists()
    assert not etcd_data(job.run_dir, job.control).exists()


def etcd_data(run_dir: Path, control: str) -> Path:
    """The data directory of the etcd the control job started, as its log names it."""
    log = (run_dir / f"control-{control}.out").read_text()
    return Path(re.search(r"etcd serves at \S+ \(data (\S+),", log).group(1))


def test_cancel_ends_a_running_job_and_a_second_submit_of_its_name_is_refused(slurm_cluster, tmp_path):
    name = "to-cancel"
    dry = parcae_slurm(slurm_cluster, "submit", "--partition", "spot", "--control-partition", "control",
                       "--instances", "8", "--job-name", name, "--dry-run", "--", *SMALL_GPT)
    assert dry.returncode == 0, dry.stderr
    exports, control_sbatch, array_sbatch = dry.stdout.splitlines()
    assert exports.startswith("export ") and f"PARCAE_JOB={name}" in exports
    assert control_sbatch.startswith("sbatch --parsable") and control_sbatch.endswith("control.sbatch")
    assert "--array=0-7 --ntasks-per-node=1 --gres=gpu:1 --signal=TERM@5 --dependency=after:CONTROL_JOB_ID" \
        in array_sbatch
    assert slurm_cluster.run("squeue", "-h", "-n", name, "-o", "%i").strip() == ""  # nothing submitted
    control, array, _ = submit(slurm_cluster, tmp_path, name, 2, *TRAIN)
    try:
        slurm_cluster.wait_state(array, "RUNNING", count=2, timeout=60)
        wait_for((tmp_path / "run" / f"control-{control}" / "etcd-endpoint").exists, 60, "the control job's etcd")
        again = parcae_slurm(slurm_cluster, "submit", "--partition", "spot", "--control-partition", "control",
                             "--instances", "2", "--gres", "none", "--job-name", name,
                             "--coordinator-config", str(tmp_path / "coordinator.yaml"), "--", *TRAIN)
        assert again.returncode == 2 and f"jobs named {name} are queued already" in again.stderr, again.stderr
        result = parcae_slurm(slurm_cluster, "cancel", "--job-name", name, timeout=400)
        assert result.returncode == 0, result.stderr
        assert f"cancelled job {name}: worker array {array}, job {control}" in result.stdout
        assert slurm_cluster.run("squeue", "-h", "-n", name, "-o", "%i").strip() == ""
        assert processes_mentioning(str(tmp_path / "run")) == []
        assert not etcd_data(tmp_path / "run", control).exists()
        gone = parcae_slurm(slurm_cluster, "cancel", "--job-name", name)
        assert gone.returncode == 2 and f"no queued job named {name}" in gone.stderr
    finally:
        cancel_leftovers(slurm_cluster, name)


# The whole job preempted at once: two one-node elements (the fewest that make a layout
# of several instances), both taken by a `prio` job that needs every node. Paced until
# then, at full speed once requeued: nothing after the preemption waits on the steps.
# A test of its own after the others: pytest-xdist (-n 2, tests dealt in pairs) runs it
# in the other process, beside the job above.
WHOLE_INSTANCES = 2
WHOLE_PACE = f"{STEP_SECONDS / 4},0"  # 0.2 s a step on two workers
# spot's GraceTime while this job runs. GRACE_S is shorter than the notice, the plan and
# the first checkpoint a process writes take on 2 busy cores (5-8 s; megatron-core imports
# torch.distributed.checkpoint on the first save); the grace then ends 15-45 s after the notice.
WHOLE_GRACE_S = 15


@pytest.fixture(scope="module")
def whole_job(slurm_cluster, reference, tmp_path_factory):
    """A job of WHOLE_INSTANCES elements, every one preempted at once once it trains,
    run to its end; cancelled if it does not get there."""
    folder = tmp_path_factory.mktemp("whole")
    slurm_cluster.run("scontrol", "update", "PartitionName=spot", f"GraceTime={WHOLE_GRACE_S}")
    try:
        return run_preempted(slurm_cluster, folder, "whole", WHOLE_INSTANCES, WHOLE_PACE, NODES, WHOLE_GRACE_S + 90,
                             grace=WHOLE_GRACE_S)
    finally:
        cancel_leftovers(slurm_cluster, "whole")
        slurm_cluster.run("scontrol", "update", "PartitionName=spot", f"GraceTime={GRACE_S}")


def test_whole_job_preempted_at_once_saves_in_the_grace_time_and_resumes_losing_no_step(whole_job, reference,
                                                                                      record_property):
    """Issue 15, point 2: every element preempted at once: the workers save a checkpoint of
    the iteration they are at within the grace time and exit; the requeued elements come
    back as new workers, which resume from it: no step lost, none trained twice, and the
    parameters of an uninterrupted run."""
    job = whole_job
    assert sorted(job.elements) == [str(t) for t in range(WHOLE_INSTANCES)]
    assert all(r["Restarts"] == "1" for r in job.elements.values()), job.timeline()  # all preempted, once

    # The coordinator's plans: a start (it may start on one instance, the other joining in
    # place), save-and-exit of the layout on both instances once both were noticed, then a
    # restart on the requeued elements' new workers (which may join in place again).
    published = plans(job.run_dir)
    kinds = [p.kind for p in published]
    stops = [k for k in kinds if k in ("start", "save-and-exit", "restart")]  # the others move in place
    shown = [(p.generation, p.kind, p.workers, p.reason) for p in published]
    assert kinds[0] == "start" and stops == ["start", "save-and-exit", "restart"], shown
    stop = kinds.index("save-and-exit")
    assert kinds[stop + 1] == "restart", shown
    running, saving, resumed = published[stop - 1:stop + 2]
    assert world(running) == WHOLE_INSTANCES and saving.workers == running.workers, (running, saving)
    assert "notice from workers" in saving.reason and "save a checkpoint and exit" in saving.reason, saving
    assert "resume from the checkpoint" in resumed.reason, resumed
    new_workers = {w for p in published[stop + 1:] for w in p.workers}
    assert min(new_workers) > max(w for p in published[:stop] for w in p.workers), shown

    # The workers saved the iteration they had got to, within the grace time (the
    # preemption came after the prio submit), and exited before SLURM ended the elements at
    # its end (slurmstepd's line in the element's log): so they were requeued.
    def run_of(restart: int) -> list:
        return sorted((e for path in (job.run_dir / "events").glob(f"element-*.{restart}.jsonl")
                       for e in read_events(path)), key=lambda e: e.time)

    before, after = run_of(0), run_of(1)
    reached = max(e.iteration for e in before if isinstance(e, Iteration))
    [saved] = [e for e in before if isinstance(e, Save)]
    assert saved.iteration == reached and saved.directory == str(job.run_dir / "checkpoints"), saved
    assert saving.time < saved.time < job.prio_submitted + WHOLE_GRACE_S, (job.prio_submitted, saving, saved)
    for task in job.elements:
        log = (job.run_dir / f"element-{task}.out").read_text()
        first_run = log[:log.index("(requeue 1)")]
        assert "DUE TO PREEMPTION" in first_run, log
        assert first_run.index("the workers exited (status 0)") < first_run.index("DUE TO PREEMPTION"), log

    # The new workers resumed from that checkpoint, losing no step.
    [change] = [e for e in after if isinstance(e, LayoutChange) and e.generation == resumed.generation]
    assert (change.kind, change.iteration, change.lost_steps, change.source) == \
        ("restart", reached, 0, saved.directory), change
    save_s, restart_s = saved.time - job.prio_submitted, change.time - clock(job.prio["EndTime"])
    record_property("save_after_prio_submit_s", round(save_s, 2))
    record_property("resume_after_prio_end_s", round(restart_s, 1))
    print(f"saved iteration {reached} of {ITERS} {save_s:.2f} s after the prio submit, "
          f"{saved.time - saving.time:.2f} s after the save-and-exit plan; resumed {restart_s:.1f} s after the prio "
          f"job ended, {change.seconds:.2f} s of restart")

    check_normal_end_every_sample_once_like_an_uninterrupted_run(job, reference.result())
    check_nothing_outlives_the_job(job)
