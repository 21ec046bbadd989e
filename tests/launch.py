"""Run the real pretraining scripts under torchrun and read the events they write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO
from megatron_parcae.events import Event, Iteration, read_events

# Small enough that a 4-process run of 10-20 iterations takes seconds on 2 cores.
SMALL_GPT = ["--config", "configs/gpt-tiny.yaml", "--num-layers", "4", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1"]


def layout_flags(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


@dataclass(frozen=True)
class Run:
    """A finished torchrun job: its exit code, output, and the events rank 0 of its layouts wrote."""

    returncode: int
    stdout: str
    stderr: str
    events: list[Event]

    def of(self, kind: type[Event]) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def torchrun(script: str, nproc: int, args: list[str], timeout: float = 600) -> Run:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="parcae-test-events-") as tmp:
        events = Path(tmp) / "events.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / "scripts" / script), *args, "--parcae-events", str(events)]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        return Run(done.returncode, done.stdout, done.stderr, read_events(events) if events.exists() else [])


def trained_losses(events: list[Event]) -> dict[int, float]:
    """The lm loss of each reported iteration."""
    return {e.iteration: e.losses["lm loss"] for e in events if isinstance(e, Iteration)}


def losses(run: Run) -> dict[int, float]:
    """Reported lm loss by iteration; fails with the run's output when the run failed."""
    assert run.returncode == 0, f"run failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    found = trained_losses(run.events)
    assert found, f"no loss reported:\n{run.stdout[-2000:]}"
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
