"""The live system end to end: `parcae replay` on a real trace segment, with real etcd,
the real coordinator and real worker processes that are preempted (SIGTERM, SIGKILL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, SMALL_GPT, TRACES, assert_close, losses, torchrun
from megatron_parcae.events import Iteration, read_events

pytestmark = pytest.mark.slow  # every test here starts processes

# Small steps keep the roundoff of changing tensor-parallel reductions from growing over
# a hundred iterations (the invariant is about the computation, not about chaos).
TRAIN = ["scripts/pretrain_gpt.py", *SMALL_GPT, "--train-iters", "2000", "--lr", "3e-4", "--min-lr", "3e-5"]
GLOBAL_BATCH = 8


def parcae(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "megatron_parcae.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def small_profile(tiny_data, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "small-gpt.json"
    result = parcae("profile", "--output", str(path), "--repeats", "2", "--", *SMALL_GPT, "--train-iters", "2000")
    assert result.returncode == 0, result.stderr[-2000:]
    return path


def test_replay_of_a_real_trace_trains_the_uninterrupted_model(small_profile, tmp_path):
    # aws-p3 hours 0.5-1.5 scaled to 5 instances: 5 preemptions and 4 arrivals in 90 s.
    result = parcae("replay", "--trace", str(TRACES / "aws-p3" / "p3-trace.csv"), "--start-hour", "0.5",
                    "--end-hour", "1.5", "--max-instances", "5", "--speedup", "40", "--grace-seconds", "8",
                    "--profile", str(small_profile), "--workdir", str(tmp_path), "--json", str(tmp_path / "s.json"),
                    "--", *TRAIN)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = json.loads((tmp_path / "s.json").read_text())["parcae"]
    assert summary["preemptions"] >= 5 and summary["arrivals"] >= 3, summary["events"]
    assert max(e["instances"] for e in summary["events"]) >= 4
    migrations = [c for c in summary["changes"] if c["kind"] != "restart"]
    assert len(migrations) >= 3, summary["changes"]
    assert [c["kind"] for c in summary["changes"]].count("restart") == 1, "state was lost: a restart after the start"
    assert summary["lost_steps"] == 0

    # Every iteration was trained once, in order, on the next global batch: whoever
    # was rank 0 reported it, and no worker reported one twice.
    logged = [(e.iteration, e.consumed_samples) for path in (tmp_path / "parcae").glob("worker-*.events.jsonl")
              for e in read_events(path) if isinstance(e, Iteration)]
    iterations = sorted(i for i, _ in logged)
    assert iterations == list(range(1, len(iterations) + 1)), "an iteration was skipped or repeated"
    assert all(c == i * GLOBAL_BATCH for i, c in logged)
    assert len(iterations) >= 20

    # The same samples without preemptions give the same model.
    replayed = {int(k): v for k, v in summary["losses"].items()}
    reference = losses(torchrun("pretrain_gpt.py", 1, [*TRAIN[1:], "--exit-interval", str(len(iterations))]))
    assert_close(replayed, {i: reference[i] for i in replayed})
