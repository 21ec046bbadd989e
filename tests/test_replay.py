"""The live system end to end: `parcae replay` on a real trace segment, with real etcd,
the real coordinator and real worker processes that are preempted (SIGTERM, SIGKILL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, SMALL_GPT, TRACES, assert_close, assert_same_state, computed_once, losses, torchrun
from megatron_parcae.control.etcd.keys import SAVE_AND_EXIT
from megatron_parcae.events import Iteration, PlanPublished, read_events

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
    def profile(folder: Path) -> str:
        path = folder / "small-gpt.json"
        result = parcae("profile", "--output", str(path), "--repeats", "2", "--", *SMALL_GPT, "--train-iters", "2000")
        assert result.returncode == 0, result.stderr[-2000:]
        return str(path)

    return Path(computed_once(tmp_path_factory, "small-profile", profile))


@pytest.mark.extended
def test_instances_of_two_processes_are_preempted_whole_and_train_the_uninterrupted_model(small_profile, tmp_path):
    # aws-p3 hours 0.5-1.5 at 3 instances of 2 processes (torchrun each): 3 preemptions of
    # whole instances and 3 arrivals in 90 s, 6 processes at the peak.
    save = tmp_path / "checkpoints"
    command = [*TRAIN, "--save", str(save), "--save-interval", "40"]
    result = parcae("replay", "--trace", str(TRACES / "aws-p3" / "p3-trace.csv"), "--start-hour", "0.5",
                    "--end-hour", "1.5", "--max-instances", "3", "--gpus-per-instance", "2", "--speedup", "40",
                    "--grace-seconds", "8", "--profile", str(small_profile), "--workdir", str(tmp_path),
                    "--json", str(tmp_path / "s.json"), "--", *command)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = json.loads((tmp_path / "s.json").read_text())["parcae"]
    assert summary["preemptions"] >= 3 and summary["arrivals"] >= 1, summary["events"]
    assert max(e["instances"] for e in summary["events"]) == 3
    assert summary["lost_steps"] == 0
    # Against the ideal at the throughput this run measured; changes in trace seconds too.
    assert set(summary["samples_per_second"]) <= set(summary["seconds_per_layout"]), summary["samples_per_second"]
    assert 0 < summary["samples"] <= summary["ideal_samples"] * 1.1, summary
    assert summary["live_to_ideal"] == pytest.approx(summary["samples"] / summary["ideal_samples"], abs=0.002)
    assert summary["mean_change_trace_seconds"] == pytest.approx(summary["mean_change_seconds"] * 40, abs=0.1)
    assert summary["change_to_interval"] == pytest.approx(summary["mean_change_trace_seconds"] / 60, abs=0.002)

    plans = [e for e in read_events(tmp_path / "parcae" / "coordinator-1.events.jsonl") if isinstance(e, PlanPublished)]
    # One start from the seed; any later restart resumes a save-and-exit (preempted before
    # another instance had registered, on a slow machine), never a fallback to a checkpoint.
    assert plans[0].kind == "start" and [c["kind"] for c in summary["changes"]].count("restart") == \
        1 + sum(plan.kind == "restart" for plan in plans[1:]), plans
    for before, plan in zip(plans, plans[1:]):
        assert plan.kind != "restart" or before.kind == "save-and-exit", plans
    instance_of: dict[int, str] = {}
    for plan in plans:
        for rank in range(0, len(plan.workers), plan.tp):  # a tensor-parallel group stays on one instance
            assert len(set(plan.instances[rank:rank + plan.tp])) == 1, plan
        for worker, instance in zip(plan.workers, plan.instances):
            assert instance_of.setdefault(worker, instance) == instance, f"worker id {worker} reused"
    # Notices were answered by plans; those that moved state did it within the grace
    # period. (Which instances are preempted depends on which had come up: when no other
    # can take the state, the answer is a save-and-exit, which changes no layout.) A plan
    # published less than a grace period before the replay ended may not have finished:
    # the replay's clock starts at most when the first plan's change ended.
    answered = [p for p in plans if "notice from workers" in p.reason]
    assert answered, [p.reason for p in plans]
    start = plans[0].time - next(c["at_seconds"] for c in summary["changes"] if c["generation"] == plans[0].generation)
    moved = {p.generation for p in answered if p.kind not in ("restart", SAVE_AND_EXIT)
             and p.time - start + 8 <= summary["wall_seconds"]}
    notices = [c for c in summary["changes"] if c["generation"] in moved]
    assert (notices or not moved) and all(c["seconds"] is not None and c["seconds"] < 8 for c in notices), notices

    logged = [e for path in (tmp_path / "parcae").glob("instance-*.events.jsonl")
              for e in read_events(path) if isinstance(e, Iteration)]
    iterations = sorted(e.iteration for e in logged)
    assert iterations == list(range(1, len(iterations) + 1)), "an iteration was skipped or repeated"
    assert all(e.consumed_samples == e.iteration * GLOBAL_BATCH for e in logged) and len(iterations) >= 40

    # The last checkpoint the job wrote equals an uninterrupted run's at that iteration.
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    reference = tmp_path / "reference"
    run = torchrun("pretrain_gpt.py", 1, [*TRAIN[1:], "--exit-interval", str(saved), "--save", str(reference)])
    replayed = {int(k): v for k, v in summary["losses"].items() if int(k) <= saved}
    reference_losses = losses(run)
    assert_close(replayed, {i: reference_losses[i] for i in replayed})
    assert_same_state(save, reference, TRAIN[1:])
