"""The SLURM provisioner (megatron_parcae/provisioning/slurm.py) on a real SLURM 22.05
cluster (tests/slurm_cluster.py): on-demand elements are submitted on `ondemand`, run
there, and are released pending first, then newest; `running` and `pool_of` read the real
queue; the elements get the control job's settings, not its SLURM_* variables; a `prio`
job preempts spot elements and leaves the on-demand ones alone. Then the coordinator of
an elastic job with a deadline buys on-demand elements when preempted spot elements leave
it behind, and gives them back once they are back and it is ahead."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from helpers import SMALL_GPT, hooks_env, wait_for
from megatron_parcae.control.etcd import EtcdClient, JobStore
from megatron_parcae.events import Provisioned, read_events
from megatron_parcae.provisioning.pools import Pool
from megatron_parcae.provisioning.provisioner import Instance, ProvisionerConfig, create_provisioner
from megatron_parcae.provisioning.slurm import SlurmProvisioner
from slurm_cluster import GRACE_S, GRACE_TIMER_S, KILL_WAIT_S, NODES, ONDEMAND_NODES, SlurmCluster
from test_slurm_elastic import ENDED, PROFILE, cancel_leftovers, clock, logs, parcae_slurm, plans, world

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB = "deadline"
CONTROL_JOB = "999"  # what the control job's SLURM_JOB_ID would be
SPOT = Pool("spot", "spot", 1, 0.918, NODES)
ON_DEMAND = Pool("on-demand", "on-demand", 1, 3.06, ONDEMAND_NODES + 1)  # one more than the nodes: one pends
FLAGS = ["--train-iters", "10", "--note", "two words"]

# An element: records its arguments and environment, ignores SIGTERM (workers handing over
# in the grace time) and runs until it is cancelled or preempted.
ELEMENT = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --requeue
trap '' TERM
out=$PARCAE_RUN_DIR/${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}.${SLURM_RESTART_COUNT:-0}
PYTHON -c 'import json, os, sys; json.dump({"args": sys.argv[1:], "env": dict(os.environ)}, sys.stdout)' \\
    "$@" >"$out.new"
mv "$out.new" "$out.json"
srun --ntasks=1 bash -c "trap '' TERM; sleep 600"
"""


@pytest.fixture
def provisioner(slurm_cluster: SlurmCluster, tmp_path):
    """The backend as the coordinator in a control job creates it (the control job's
    environment, with what `parcae slurm submit` sets); every element cancelled at the end."""
    script = tmp_path / "element.sbatch"
    script.write_text(ELEMENT.replace("PYTHON", sys.executable))
    config = ProvisionerConfig.from_dict({"backend": "slurm", "partitions": {"spot": "spot", "on-demand": "ondemand"},
                                          "script": str(script), "gres": "none"})
    environ = {**slurm_cluster.env, "SLURM_JOB_ID": CONTROL_JOB, "SLURM_CPUS_PER_TASK": "2",
               "SLURM_JOB_NAME": JOB, "PARCAE_JOB": JOB, "PARCAE_RUN_DIR": str(tmp_path),
               "PARCAE_GRACE_SECONDS": str(GRACE_S), "PARCAE_TRAINING_FLAGS": json.dumps(FLAGS)}
    slurm = create_provisioner(config, JOB, (SPOT, ON_DEMAND), environ=environ)
    assert isinstance(slurm, SlurmProvisioner)
    try:
        yield slurm
    finally:
        arrays = set(slurm_cluster.run("squeue", "-h", "-n", JOB, "-o", "%F").split())
        for array in arrays:
            slurm_cluster.cancel(array)


def records(cluster: SlurmCluster, element: str) -> dict[str, str]:
    [record] = cluster.jobs(element)
    return record


def states(cluster: SlurmCluster, elements: list[str]) -> dict[str, str]:
    return {e: records(cluster, e)["JobState"] for e in elements}


def test_on_demand_elements_run_on_their_partition_and_are_released_pending_first(slurm_cluster, provisioner,
                                                                                  tmp_path):
    first = provisioner.request("on-demand", ONDEMAND_NODES)
    array = first[0].split("_")[0]
    assert first == [f"{array}_{t}" for t in range(ONDEMAND_NODES)]
    slurm_cluster.wait_state(array, "RUNNING", count=ONDEMAND_NODES, timeout=60)
    wait_for(lambda: provisioner.running("on-demand") == [Instance(e, "on-demand") for e in first], 30,
             "the provisioner to see the elements running")
    assert provisioner.running("spot") == []
    nodes = set()
    for element in first:
        record = records(slurm_cluster, element)
        assert (record["Partition"], record["JobName"], record["Restarts"]) == ("ondemand", JOB, "0"), record
        assert record["StdOut"] == str(tmp_path / f"element-{element}.out"), record
        nodes.add(record["NodeList"])
    assert nodes == {f"od{i}" for i in range(1, ONDEMAND_NODES + 1)}

    # What the elements got: the training flags, the control job's settings and id; none of
    # its SLURM_* variables (its CPUs per task would reach the elements' srun).
    wait_for(lambda: all((tmp_path / f"{e}.0.json").exists() for e in first), 30, "the elements to start")
    for element in first:
        seen = json.loads((tmp_path / f"{element}.0.json").read_text())
        assert seen["args"] == FLAGS
        env = seen["env"]
        assert (env["PARCAE_CONTROL_JOB"], env["PARCAE_JOB"], env["SLURM_ARRAY_JOB_ID"]) == (CONTROL_JOB, JOB, array)
        assert "SLURM_CPUS_PER_TASK" not in env, env

    # A fresh provisioner (a successor coordinator) finds the pool of an element in the queue.
    again = create_provisioner(ProvisionerConfig.from_dict(
        {"backend": "slurm", "partitions": {"spot": "spot", "on-demand": "ondemand"}}), JOB, (SPOT, ON_DEMAND),
        environ=slurm_cluster.env)
    assert again.pool_of(f"{first[1]}.0@od2") == "on-demand" and again.pool_of("node-1") is None
    assert again.running("on-demand") == provisioner.running("on-demand")

    # At most max-count: one more, which pends (every ondemand node is taken).
    [pending] = provisioner.request("on-demand", 3)
    assert pending.endswith("_0") and int(pending.split("_")[0]) > int(array)
    pending_array = pending.split("_")[0]  # scontrol knows a pending element by its array
    slurm_cluster.wait_state(pending_array, "PENDING", timeout=30)
    assert provisioner.request("on-demand", 1) == []  # max-count held
    assert len(provisioner.running("on-demand")) == ONDEMAND_NODES

    # Released: the pending one first, then the newest running one; the oldest runs on.
    released = provisioner.release("on-demand", 2)
    assert released == [pending, first[-1]]
    slurm_cluster.wait(pending_array, lambda r: r and r[0]["JobState"] == "CANCELLED", 60, "cancelled")
    slurm_cluster.wait(first[-1], lambda r: r and r[0]["JobState"] in ENDED, 60, "ended")
    assert states(slurm_cluster, [first[-1], first[0]]) == {first[-1]: "CANCELLED", first[0]: "RUNNING"}
    assert provisioner.running("on-demand") == [Instance(first[0], "on-demand")]
    assert provisioner.release("on-demand", 5) == [first[0]]
    slurm_cluster.wait(first[0], lambda r: r and r[0]["JobState"] in ENDED, 60, "ended")
    assert provisioner.running("on-demand") == [] and provisioner.release("on-demand", 1) == []


def test_prio_job_preempts_spot_elements_not_on_demand_ones(slurm_cluster, provisioner, tmp_path):
    spot = provisioner.request("spot", NODES)
    [on_demand] = provisioner.request("on-demand", 1)
    array = spot[0].split("_")[0]
    slurm_cluster.wait_state(array, "RUNNING", count=NODES, timeout=60)
    slurm_cluster.wait_state(on_demand, "RUNNING", timeout=60)
    assert all(records(slurm_cluster, e)["Partition"] == "spot" for e in spot)
    assert provisioner.pool_of(f"{spot[0]}.0@node1") == "spot"

    script = tmp_path / "prio.sbatch"
    script.write_text("#!/bin/bash\nsleep 1\n")
    prio = slurm_cluster.submit(script, "--partition=prio", f"--nodes={NODES}", "--exclusive",
                                f"--output={tmp_path}/prio.out", "--job-name=prio")
    # Grace time, slurmctld's grace timer, KillWait, the prio job itself and scheduling.
    slurm_cluster.wait_state(prio, "RUNNING", "COMPLETED", timeout=GRACE_S + GRACE_TIMER_S + KILL_WAIT_S + 60)
    # The preempted elements are held, not running: no more spot elements are asked for.
    assert provisioner.running("spot") == []
    assert provisioner.request("spot", 1) == []
    assert provisioner.running("on-demand") == [Instance(on_demand, "on-demand")]
    slurm_cluster.wait_state(prio, "COMPLETED", timeout=60)
    # Requeued elements are held cred_expire + 1 = 11 s, then run again.
    slurm_cluster.wait(array, lambda records: sum(r.get("JobState") == "RUNNING" and r.get("Restarts") == "1"
                                                  for r in records) == NODES, 120, "requeued and running")
    assert sorted(i.name for i in provisioner.running("spot")) == sorted(spot)
    record = records(slurm_cluster, on_demand)
    assert (record["JobState"], record["Restarts"]) == ("RUNNING", "0"), record
    preempted = slurm_cluster.log_lines(lambda line: "preempted JobId=" in line)
    assert all(f"JobId={e}(" in preempted for e in spot) and f"JobId={on_demand}(" not in preempted, preempted


# -- the coordinator provisioning on-demand elements for a deadline ---------------------
#
# GPT-tiny on four spot elements, paced so that the machine's own speed matters little: a
# step takes STEP_SECONDS over the world size plus the compute, 2-3 s on four workers,
# 4-5 s on two. The deadline asks for NEED_SAMPLES_PER_S over an hour: more than two
# instances train at this pace, less than four; the test ends long before the hour, and so
# long before the work left and the time left change the need by much. Both pools cost
# the same, so the policy's choice is the count whose rate meets the need, whatever spot
# counts it has seen (the spot outlook weighs instance counts only where on-demand costs
# more), and does not depend on how long each phase lasted.
STEP_SECONDS = 8.0
NEED_SAMPLES_PER_S = 2.3
DEADLINE_HOURS = 1.0
# The work that needs NEED_SAMPLES_PER_S over the hour, as the policy plans it (a fifth of
# the slack kept in hand, about a minute of margin): in iterations of GLOBAL_BATCH samples.
DEADLINE_ITERATIONS = 950
PRIO_SECONDS = 40  # the preempted elements stay away this long, and an on-demand one comes in


def deadline_config(folder: Path) -> Path:
    (folder / "profile.json").write_text(json.dumps(PROFILE))
    config = folder / "coordinator.yaml"
    config.write_text(f"""\
profile: {folder / 'profile.json'}
interval-seconds: 2
lookahead: 4
grace-seconds: {GRACE_S}
lease-seconds: 2
max-workers: {NODES}
min-workers: {NODES}
pools:
  - {{name: spot, market: spot, gpus_per_instance: 1, price: 1.0, max_count: {NODES}}}
  - {{name: on-demand, market: on-demand, gpus_per_instance: 1, price: 1.0, max_count: {NODES},
     startup_hours: 0.005}}
deadline: {{iterations: {DEADLINE_ITERATIONS}, hours: {DEADLINE_HOURS}}}
provisioner:
  backend: slurm
  partitions: {{spot: spot, on-demand: ondemand}}
  gres: none
""")
    return config


def provisioned(run_dir: Path) -> list[Provisioned]:
    path = run_dir / "events" / "coordinator.jsonl"
    return [e for e in read_events(path) if isinstance(e, Provisioned)] if path.exists() else []


def read_store(run_dir: Path, control: str, name: str, read):
    """read(JobStore) on the etcd of the job's control job, while it runs."""
    endpoint = (run_dir / f"control-{control}" / "etcd-endpoint").read_text().strip()
    with EtcdClient(endpoint, timeout=10) as client:
        return read(JobStore(client, name))


def test_coordinator_buys_on_demand_when_preempted_behind_and_gives_it_back_ahead(slurm_cluster, tiny_data,
                                                                                  tmp_path):
    """Issue 36, acceptance 3: two of four spot elements preempted, the job falls behind its
    deadline: the coordinator submits on-demand elements on `ondemand`; once the spot
    elements are back and the job is ahead, it cancels them."""
    name = "deadline-job"
    config = deadline_config(tmp_path)
    run_dir = tmp_path / "run"
    train = [*SMALL_GPT, "--train-iters", str(DEADLINE_ITERATIONS), "--lr", "3e-4", "--min-lr", "3e-5"]
    result = parcae_slurm(slurm_cluster, "submit", "--partition", "spot", "--control-partition", "control",
                          "--instances", str(NODES), "--gres", "none", "--job-name", name, "--coordinator-config",
                          str(config), "--run-dir", str(run_dir), "--", *train,
                          **hooks_env("paced"), PARCAE_TEST_STEP_SECONDS=str(STEP_SECONDS))
    assert result.returncode == 0, result.stderr
    control = re.search(r"control job (\d+)", result.stdout).group(1)
    spot = re.search(r"worker array (\d+)", result.stdout).group(1)
    try:
        try:
            wait_for(lambda: any(world(p) == NODES for p in plans(run_dir)), 300,
                     f"a plan on {NODES} spot elements")
            wait_for(lambda: read_store(run_dir, control, name, JobStore.progress), 120, "a progress record")
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{logs(run_dir)}")
        # Ahead on every spot element: nothing bought.
        assert provisioned(run_dir) == [] and read_store(run_dir, control, name, JobStore.provisioning) is None

        script = tmp_path / "prio.sbatch"
        script.write_text(f"#!/bin/bash\nsleep {PRIO_SECONDS}\n")
        prio_submitted = time.time()
        prio = slurm_cluster.submit(script, "--partition=prio", "--nodes=2", "--exclusive",
                                    f"--output={tmp_path}/prio.out", "--job-name=prio")
        try:
            [bought] = wait_for(lambda: provisioned(run_dir)[:1], 180, "on-demand elements to be requested")
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{logs(run_dir)}")
        on_demand = bought.instances[0].split("_")[0] if bought.instances else "-"
        slurm_cluster.wait_state(on_demand, "RUNNING", timeout=60)
        [prio_record] = slurm_cluster.wait_state(prio, "COMPLETED",
                                                 timeout=GRACE_S + GRACE_TIMER_S + KILL_WAIT_S + PRIO_SECONDS + 60)
        try:
            [give_back] = wait_for(lambda: [e for e in provisioned(run_dir)[1:] if e.wanted == 0][:1], 300,
                                   "the on-demand elements to be given back")
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{[(e.held, e.wanted, e.reason) for e in provisioned(run_dir)]}\n{logs(run_dir)}")
        record = read_store(run_dir, control, name, JobStore.provisioning)
        elements = slurm_cluster.wait(on_demand, lambda rs: rs and all(r.get("JobState") in ENDED for r in rs), 60,
                                      "ended")
        # The on-demand elements were all the job bought: none is left.
        assert slurm_cluster.run("squeue", "-h", "-n", name, "-p", "ondemand", "-o", "%i").strip() == ""
    finally:
        cancel_leftovers(slurm_cluster, name)

    # The coordinator: on-demand elements bought once behind, all given back once ahead.
    assert bought.pool == "on-demand" and bought.held == 0 and bought.wanted >= 1, bought
    assert bought.reason.startswith("behind") and len(bought.instances) == bought.wanted, bought
    assert {i.split("_")[0] for i in bought.instances} == {on_demand}, bought
    # Given back as spot elements came back, one at a time or together: each decision
    # names the elements it submitted or cancelled, and in the end every one was cancelled.
    events = provisioned(run_dir)[:provisioned(run_dir).index(give_back) + 1]
    print("\n".join(f"{e.held} -> {e.wanted} {e.instances}: {e.reason}" for e in events))
    assert all(e.pool == "on-demand" and e.reason.startswith("behind" if e.wanted > e.held else "ahead")
               and len(e.instances) == abs(e.wanted - e.held) for e in events), events
    assert all(a.wanted == b.held for a, b in zip(events, events[1:])), events
    bought_all = [i for e in events if e.wanted > e.held for i in e.instances]
    given_back = [i for e in events if e.wanted < e.held for i in e.instances]
    assert sorted(given_back) == sorted(bought_all) and give_back.wanted == 0, events
    assert record is not None and record.wanted == {"on-demand": 0} and record.reason == give_back.reason, record

    # SLURM: they ran on ondemand, never preempted, and were cancelled; two spot elements
    # were preempted, and requeued and started again before the on-demand ones were given back.
    assert sorted(f"{on_demand}_{e['ArrayTaskId']}" for e in elements) == sorted(bought.instances), elements
    for element in elements:
        assert (element["Partition"], element["JobName"], element["Restarts"], element["JobState"]) == \
            ("ondemand", name, "0", "CANCELLED"), element
    preempted = set(re.findall(rf"preempted JobId={spot}_(\d+)\(\d+\) has been requeued",
                               slurm_cluster.log_lines(lambda line: "preempted JobId=" in line)))
    assert len(preempted) == 2, preempted
    spot_records = {r["ArrayTaskId"]: r for r in slurm_cluster.jobs(spot)}
    assert all(spot_records[t]["Restarts"] == "1" for t in preempted), spot_records
    back = max(clock(spot_records[t]["StartTime"]) for t in preempted)
    assert prio_submitted <= bought.time and back <= give_back.time + 1, (prio_record, spot_records, give_back)
