"""Nothing of a dropped layout survives the change (issue 35, acceptance 1): with the
cyclic collector off and no `gc.collect()` called, the old layout's model chunks,
modules, parameters, DDP buffers with their parameter and gradient tensors, optimizers
and optimizer state are all freed once the new layout has trained its first step
(tests/release_probe.py watches each process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, SMALL_GPT, child_env
from megatron_parcae import events
from megatron_parcae.events import read_events
from release_probe import read_records

pytestmark = pytest.mark.slow  # starts processes

# T1 P1 D2, with 2 of the 4 processes on standby: two replicas join (data parallel), the
# pipeline deepens twice, then T and P change together, P and D, and T alone.
SCHEDULE = "2:1,1,4:join=2;4:1,2,2;6:1,4,1;8:2,2,1;10:2,1,2;12:4,1,1"
CHANGES = [(2, "inter-stage", (1, 1, 4)), (4, "pipeline", (1, 2, 2)), (6, "pipeline", (1, 4, 1)),
           (8, "tensor", (2, 2, 1)), (10, "pipeline", (2, 1, 2)), (12, "tensor", (4, 1, 1))]
KINDS = {"model chunk", "module", "parameter", "DDP buffer", "gradient buffer", "parameter buffer", "optimizer",
         "optimizer state"}


def test_every_dropped_layout_is_freed_without_the_cyclic_collector(tiny_data, tmp_path):
    probe, log = tmp_path / "probe", tmp_path / "events.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(REPO / "tests" / "release_probe.py"), str(probe), str(REPO / "scripts" / "pretrain_gpt.py"),
           *SMALL_GPT, "--use-distributed-optimizer", "--overlap-grad-reduce",
           "--train-iters", "14", "--parcae", "--parcae-layout-schedule", SCHEDULE, "--parcae-events", str(log)]
    run = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    changes = [(c.iteration, c.kind, (c.tp, c.pp, c.dp)) for c in read_events(log)
               if isinstance(c, events.LayoutChange)]
    assert changes == CHANGES

    records = read_records(probe)
    # Every process that held a layout checked it after the next layout's first step
    # (the two that join at 2 held none before).
    checked = sorted((r["iteration"], r["worker"]) for r in records)
    expected = sorted([(3, 0), (3, 1)] + [(i + 1, w) for i, *_ in CHANGES[1:] for w in range(4)])
    assert checked == expected, checked
    for r in records:
        assert set(r["held"]) == KINDS, r
        assert not r["alive"], f"worker {r['worker']} still holds its old layout at iteration {r['iteration']}: {r}"
        assert r["collections"] == 0, r


def test_the_probe_sees_what_a_live_reference_keeps(tiny_data, tmp_path):
    """The check can fail: a reference kept to the old optimizer shows as alive."""
    keeper = tmp_path / "keep_optimizer.py"
    keeper.write_text(
        "import runpy, sys\n"
        "from megatron_parcae.training.runtime import LayoutRuntime\n"
        "kept = []\n"
        "destroy = LayoutRuntime.destroy\n"
        "def keeping(runtime):\n"
        "    if runtime.optimizer is not None:\n"
        "        kept.append(runtime.optimizer)\n"
        "    destroy(runtime)\n"
        "LayoutRuntime.destroy = keeping\n"
        f"sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    probe = tmp_path / "probe"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "release_probe.py"), str(probe), str(keeper), str(REPO / "scripts" / "pretrain_gpt.py"),
           *SMALL_GPT, "--train-iters", "3", "--parcae", "--parcae-layout-schedule", "1:1,2,1"]
    run = subprocess.run(cmd, cwd=REPO, env={**child_env(), "PYTHONPATH": str(REPO)}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    records = read_records(probe)
    assert len(records) == 2 and all(r["alive"].get("optimizer", 0) >= 1 for r in records), records
