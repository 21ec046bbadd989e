"""Run the real pretraining scripts under torchrun and read what they log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO

_LOSS = re.compile(r"iteration\s+(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|")

# Small enough that a 4-process run of 10-20 iterations takes seconds on 2 cores.
SMALL_GPT = ["--config", "configs/gpt-tiny.yaml", "--num-layers", "4", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1"]


def layout_flags(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def torchrun(script: str, nproc: int, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "scripts" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def losses(result: subprocess.CompletedProcess) -> dict[int, float]:
    """Logged lm loss by iteration; fails with the run's output when the run failed."""
    assert result.returncode == 0, f"run failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    found = {int(i): float(v) for i, v in _LOSS.findall(result.stdout)}
    assert found, f"no loss logged:\n{result.stdout[-2000:]}"
    return found


def assert_same_state(checkpoint: Path, reference: Path, flags: list[str], model: str = "gpt") -> None:
    """`parcae compare`: parameters and Adam moments within 1e-5 relative over the model."""
    run = subprocess.run([sys.executable, "-m", "megatron_parcae.cli", "compare", "--checkpoint", str(checkpoint),
                          "--reference", str(reference), "--model", model, "--", *flags], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}"
    difference = json.loads(run.stdout)
    assert difference["params"] <= 1e-5 and difference["moments"] <= 1e-5, difference


def assert_close(a: dict[int, float], b: dict[int, float], rel: float = 1e-5) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for it in sorted(a):
        assert abs(a[it] - b[it]) <= rel * abs(b[it]), f"iteration {it}: {a[it]} vs {b[it]}"


def write_tracker(root: Path, iteration: int) -> None:
    """Point a checkpoint directory at an earlier saved iteration (as Megatron users do)."""
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
