"""bf16 and fp16 through in-place layout changes, and the planes of every collective.

In half precision another T or P rounds differently, so a run that never changes layout
is no reference: an in-place change must give what the same change made by
checkpoint-restart gives (save at the change, relaunch under the new layout, load),
loss scale and skipped steps included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collective_probe import read_findings
from helpers import SMALL_GPT, layout_flags, torchrun, write_tracker
from megatron_parcae.events import Iteration
from megatron_parcae.training.checkpointing import PROGRESS
from reconfig.optimizer_state import LossScale

ITERS, CHANGE = 10, 5
INITIAL_SCALE = 2.0**20
# A scale too large for the first steps: they overflow and are skipped, it halves at each
# overflow (hysteresis 1) and doubles after 3 clean steps, so one short run shows all of it.
FP16 = ["--fp16", "--initial-loss-scale", str(INITIAL_SCALE), "--hysteresis", "1", "--loss-scale-window", "3"]
# Plain Adam on 2 processes (D = 1: T and P change), the distributed optimizer on 4 (D = 2,
# so its shards are cut again too).
CASES = pytest.mark.parametrize("precision,distributed_optimizer,processes", [
    pytest.param(["--bf16"], False, 2, marks=pytest.mark.extended),
    pytest.param(FP16, False, 2, marks=pytest.mark.extended),
    (FP16, True, 4)], ids=["bf16-adam", "fp16-adam", "fp16-distributed-adam"])


def _iterations(run) -> dict[int, Iteration]:
    assert run.returncode == 0, f"run failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return {e.iteration: e for e in run.of(Iteration)}


def _final_progress(root: Path) -> dict:
    return json.loads((root / f"iter_{ITERS:07d}" / PROGRESS).read_text())


@pytest.mark.slow
@CASES
def test_in_place_change_equals_checkpoint_restart(tiny_data, tmp_path, precision, distributed_optimizer, processes):
    flags = SMALL_GPT + precision + ["--train-iters", str(ITERS)]
    flags += ["--use-distributed-optimizer"] if distributed_optimizer else []
    saved, probe = tmp_path / "in-place", tmp_path / "probe"
    in_place = _iterations(torchrun("pretrain_gpt.py", processes, flags + layout_flags(1, 2) + [
        "--save", str(saved), "--save-interval", str(CHANGE), "--parcae",
        "--parcae-layout-schedule", f"{CHANGE}:2,1,{processes // 2}"], probe=probe))
    write_tracker(saved, CHANGE)
    restarted_root = tmp_path / "restarted"
    restarted = _iterations(torchrun("pretrain_gpt.py", processes, flags + layout_flags(2, 1) + [
        "--load", str(saved), "--save", str(restarted_root)]))

    after = range(CHANGE + 1, ITERS + 1)
    assert sorted(restarted) == list(after) and sorted(in_place) == list(range(1, ITERS + 1))
    for it in after:
        a, b = in_place[it], restarted[it]
        assert abs(a.losses["lm loss"] - b.losses["lm loss"]) <= 1e-6 * abs(b.losses["lm loss"]), (it, a, b)
        assert (a.loss_scale, a.skipped_iterations, a.trained_samples, a.learning_rate) == (
            b.loss_scale, b.skipped_iterations, b.trained_samples, b.learning_rate), (it, a, b)
    # Adam's step and the loss scaler end alike in both (the final checkpoints' records).
    final, reference = _final_progress(saved), _final_progress(restarted_root)
    assert (final["optimizer_step"], final["loss_scale"]) == (reference["optimizer_step"], reference["loss_scale"])
    skipped = sum(e.skipped_iterations for e in in_place.values())
    assert final["optimizer_step"] == ITERS - skipped
    last = in_place[ITERS]
    assert last.trained_samples == last.consumed_samples - skipped * last.global_batch_size
    assert last.losses["lm loss"] < in_place[1].losses["lm loss"] - 0.2  # it trains once the scale settles

    if precision == FP16:
        assert in_place[1].skipped_iterations == 1 and "loss scale: 524288.0 |" in in_place[1].log_line()
        assert "number of skipped iterations:   1 |" in in_place[1].log_line()
        # The scale carried over: a change that lost it would restart at the initial
        # scale and overflow again.
        before = in_place[CHANGE].loss_scale
        assert before < INITIAL_SCALE and in_place[CHANGE + 1].loss_scale in (before, 2 * before)
        assert in_place[CHANGE + 1].skipped_iterations == 0
        assert LossScale.from_dict(final["loss_scale"]).scale == last.loss_scale
    else:
        assert final["loss_scale"] is None and skipped == 0

    # Every collective of the loop and the executor used its plane's device.
    sites, violations = read_findings(probe)
    assert not violations, violations
    expected = {("megatron_parcae/training/runtime.py:_global_mean_losses:all_reduce", "control"),
                ("reconfig/execute.py:_agree_on_progress:all_reduce", "control"),
                ("reconfig/transfer.py:exchange:all_reduce", "data"),
                ("reconfig/transfer.py:_exchange:isend", "control"), ("reconfig/transfer.py:_exchange:recv", "control"),
                ("reconfig/transfer.py:_exchange:batch_isend_irecv", "data"),
                ("reconfig/transfer.py:_exchange:all_reduce", "control"),
                ("megatron_parcae/training/checkpointing.py:behind:all_reduce", "control"),
                ("reconfig/planes.py:control_barrier:all_reduce", "control")}
    if distributed_optimizer:
        expected |= {("reconfig/optimizer_state.py:_gather_distributed:all_reduce", "data"),
                     ("reconfig/execute.py:_fill:all_reduce", "data")}
    assert expected <= sites, expected - sites


@pytest.mark.slow
def test_a_change_before_the_first_applied_update(tiny_data):
    """fp16 skips every step until its scale settles, and Adam makes its moments only at
    its first applied update: a change before then exports the distributed optimizer's
    state with no moments yet, and trains on as the run without it."""
    iters, change = 12, 3
    flags = SMALL_GPT + ["--fp16", "--initial-loss-scale", str(2.0**28), "--hysteresis", "1",
                         "--use-distributed-optimizer", "--train-iters", str(iters)]
    plain = _iterations(torchrun("pretrain_gpt.py", 1, flags))
    changed = _iterations(torchrun("pretrain_gpt.py", 1, flags + [
        "--parcae", "--parcae-layout-schedule", f"{change}:1,1,1"]))
    assert all(plain[it].skipped_iterations == 1 for it in range(1, change + 1))
    assert sum(plain[it].skipped_iterations == 0 for it in range(change + 1, iters + 1)) >= 2
    assert sorted(changed) == sorted(plain) == list(range(1, iters + 1))
    for it, b in plain.items():
        a = changed[it]
        assert abs(a.losses["lm loss"] - b.losses["lm loss"]) <= 1e-6 * abs(b.losses["lm loss"]), (it, a, b)
        assert (a.loss_scale, a.skipped_iterations) == (b.loss_scale, b.skipped_iterations), (it, a, b)
