"""In-place layout changes of a running job (--parcae-layout-schedule) under torchrun with gloo.

Every run must log the losses of an uninterrupted single-process run on the same samples:
the executor moved exactly the parameters and Adam moments each new rank needs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import (SMALL_GPT, assert_close, assert_same_state, computed_folder, layout_flags, losses, shared_losses,
                     torchrun)
from megatron_parcae import events
from megatron_parcae.training.arguments import ArgumentError, parse_args
from reconfig.phases import EXPORT, PHASES
from reconfig.schedule import LayoutChange, parse_layout_schedule

ITERS = 12


@pytest.fixture(scope="module")
def reference_run(tiny_data, tmp_path_factory) -> tuple[dict[int, float], Path]:
    """Losses of an uninterrupted single-process run, and the folder of its final checkpoint."""
    def run(folder: Path) -> dict[int, float]:
        return losses(torchrun("pretrain_gpt.py", 1, SMALL_GPT + ["--train-iters", str(ITERS), "--save",
                                                                  str(folder / "checkpoints")]))

    return shared_losses(tmp_path_factory, "reconfig-reference", run), \
        computed_folder(tmp_path_factory, "reconfig-reference") / "checkpoints"


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[int, float]:
    return reference_run[0]


def _scheduled(nproc: int, pp: int, schedule: str, distributed_optimizer: bool, iters: int = ITERS,
               save: Path | None = None):
    extra = ["--use-distributed-optimizer"] if distributed_optimizer else []
    extra += [] if save is None else ["--save", str(save), "--save-interval", "3", "--async-save"]
    run = torchrun("pretrain_gpt.py", nproc, SMALL_GPT + layout_flags(1, pp) + extra + [
        "--train-iters", str(iters), "--parcae", "--parcae-layout-schedule", schedule], timeout=300)
    found = losses(run)
    for change in run.of(events.LayoutChange):  # timed phase by phase, within the change's own seconds
        assert set(PHASES) - {EXPORT} <= change.phases.keys() <= set(PHASES), change
        assert min(change.phases.values()) >= 0 and sum(change.phases.values()) <= change.seconds, change
    changes = [(c.iteration, c.kind, (c.tp, c.pp, c.dp), c.bytes_planned, c.process_groups, c.resident_mib)
               for c in run.of(events.LayoutChange)]
    saves = [s.iteration for s in run.of(events.Save)]
    return found, changes, saves


@pytest.mark.extended
@pytest.mark.slow
def test_tensor_and_pipeline_changes_train_the_same_model(reference_run, tmp_path):
    """With the distributed optimizer; plain Adam goes through T and P changes in the
    hand-over test below and in tests/test_half_precision.py."""
    reference, reference_save = reference_run
    found, changes, saves = _scheduled(4, 2, "3:2,2,1;6:1,1,4;9:2,1,2", True, save=tmp_path / "ckpt")
    assert [(i, layout) for i, _, layout, *_ in changes] == [(3, (2, 2, 1)), (6, (1, 1, 4)), (9, (2, 1, 2))]
    assert all(kind == "tensor" for _, kind, *_ in changes)
    assert saves == [3, 6, 9, 12]  # each written while training went on, completed before the change
    assert_close(found, reference)
    assert_same_state(tmp_path / "ckpt", reference_save, SMALL_GPT + ["--train-iters", str(ITERS)])


@pytest.mark.extended
@pytest.mark.slow
def test_pipeline_deepens_and_back_then_intra_stage_leave_moves_nothing(reference_run, tmp_path):
    """P 2 -> 4 -> 2, then a rank of each stage of the D=2 layout leaves and the other
    replica goes on alone, with no model state moved."""
    reference, reference_save = reference_run
    found, changes, _ = _scheduled(4, 2, "3:1,4,1;6:1,2,2;9:1,2,1:leave=1,3", False, save=tmp_path / "ckpt")
    assert [(kind, layout) for _, kind, layout, *_ in changes] == [
        ("pipeline", (1, 4, 1)), ("pipeline", (1, 2, 2)), ("intra-stage", (1, 2, 1))]
    assert changes[1][3] > 0 and changes[2][3] == 0  # P 4 -> 2 moves layers; intra-stage nothing
    assert_close(found, reference)
    assert_same_state(tmp_path / "ckpt", reference_save, SMALL_GPT + ["--train-iters", str(ITERS)])


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed-adam"])
def test_grace_period_hand_over_then_growth(reference, distributed_optimizer):
    """Stage 1 loses both replicas with notice (they send before exiting), two workers join,
    then T changes: six processes, two of them idle until they join. The default run trains
    this schedule with the distributed optimizer under the NCCL-rules probe
    (tests/test_nccl_rules.py)."""
    found, changes, _ = _scheduled(6, 2, "3:1,2,1:leave=2,3;6:1,2,2:join=2;9:2,2,1", distributed_optimizer)
    assert [(i, kind, layout) for i, kind, layout, *_ in changes] == [
        (3, "inter-stage", (1, 2, 1)), (6, "inter-stage", (1, 2, 2)), (9, "tensor", (2, 2, 1))]
    assert_close(found, reference)


@pytest.mark.slow
def test_repeated_changes_leak_no_process_groups(tiny_data):
    schedule = ";".join(f"{i}:{2 if i % 2 else 1},2,{1 if i % 2 else 2}" for i in range(1, 21))
    found, changes, _ = _scheduled(4, 2, schedule, False, iters=21)
    assert len(changes) == 20 and len(found) == 21
    groups = {g for *_, g, _ in changes}
    assert len(groups) == 1, [g for *_, g, _ in changes]
    # Rank 0's resident memory: the same layout after 20 changes as after the second
    # (the first change warms allocator caches).
    resident = [mib for *_, mib in changes]
    assert resident[-1] <= resident[1] * 1.05 + 16, resident


def test_schedule_parses():
    assert parse_layout_schedule("3:2,2,1; 6:1,1,4:leave=1,3:join=2") == (
        LayoutChange(3, 2, 2, 1), LayoutChange(6, 1, 1, 4, (1, 3), 2))


@pytest.mark.parametrize("schedule,world,message", [
    ("3:2,2", 4, "expected ITER:T,P,D"),
    ("3:2,2,1;3:1,1,4", 4, "iterations must increase"),
    ("3:1,2,1:leave=7", 4, "worker(s) [7] cannot leave"),
    ("3:1,2,2:join=4", 4, "none is left"),
    ("3:1,2,3:join=1", 5, "needs 6 workers, only 5 are available"),
    ("3:3,1,1", 4, "is not divisible by layout.tp 3"),
], ids=["syntax", "order", "leave-stranger", "join-all", "too-few", "tp-divides"])
def test_bad_schedules_fail_before_training(tiny_data, schedule, world, message):
    argv = ["--config", "configs/gpt-tiny.yaml", "--pipeline-model-parallel-size", "2", "--parcae",
            "--parcae-layout-schedule", schedule]
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args(argv, prog="pretrain_gpt.py", model="gpt", world_size=world)


def test_schedule_needs_parcae(tiny_data):
    with pytest.raises(ArgumentError, match="needs --parcae"):
        parse_args(["--config", "configs/gpt-tiny.yaml", "--parcae-layout-schedule", "3:1,1,1"],
                   prog="pretrain_gpt.py", model="gpt", world_size=1)


@pytest.mark.extended
@pytest.mark.slow
def test_bert_changes_train_the_same_model(tiny_data):
    """BERT (`encoder.layers`, random masking) with the distributed optimizer and the
    model flags of tests/test_model_flags.py: replicas leave (their optimizer shards
    move: not intra-stage), the pipeline deepens as two workers join, then T changes
    (T=2, P=2)."""
    small = ["--config", "configs/bert-tiny.yaml", "--hidden-size", "64", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--train-iters", "8", "--log-interval", "1", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
             "--untie-embeddings-and-output-weights"]
    run = torchrun("pretrain_bert.py", 6, small + layout_flags(1, 2) + [
        "--use-distributed-optimizer", "--parcae", "--parcae-layout-schedule", "2:1,2,1:leave=1,3;4:1,4,1:join=2;6:2,2,1"],
        timeout=300)
    kinds = [(c.iteration, c.kind) for c in run.of(events.LayoutChange)]
    assert kinds == [(2, "inter-stage"), (4, "pipeline"), (6, "tensor")], kinds
    assert_close(losses(run), losses(torchrun("pretrain_bert.py", 1, small)))
