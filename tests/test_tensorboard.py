"""--tensorboard-dir: the scalars a run writes, read back with TensorBoard's own reader
(the same scalars go to wandb: test_wandb.py); the model FLOPs behind TFLOP/s against a
hand count."""

from __future__ import annotations

import pytest

from helpers import SMALL_GPT, losses, torchrun
from megatron_parcae.events import Evaluation, Iteration, LayoutChange
from megatron_parcae.training.metrics.flops import model_flops_per_step


def matmul(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def test_gpt_and_bert_flops_match_a_hand_count():
    L, h, f, s, V, B = 2, 8, 24, 5, 40, 3
    layer = (matmul(s, h, 3 * h)  # Q, K, V
             + matmul(s, h, s)  # Q K^T (all heads together)
             + matmul(s, s, h)  # scores x V
             + matmul(s, h, h)  # output projection
             + matmul(s, h, f) + matmul(s, f, h))  # MLP
    gpt_forward = L * layer + matmul(s, h, V)
    assert model_flops_per_step("gpt", L, h, f, s, V, B) == 3 * B * gpt_forward
    bert_forward = gpt_forward + matmul(s, h, h) + matmul(1, h, h) + matmul(1, h, 2)  # LM transform, pooler, head
    assert model_flops_per_step("bert", L, h, f, s, V, B, binary_head=True) == 3 * B * bert_forward
    assert model_flops_per_step("bert", L, h, f, s, V, B) == 3 * B * (bert_forward - matmul(1, h, h) - matmul(1, h, 2))


@pytest.mark.slow
def test_scalars_follow_the_printed_log_and_the_layout_schedule(tiny_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # T1P1D2, then T2P1D1 from iteration 2, then T1P2D1 from iteration 4.
    run = torchrun("pretrain_gpt.py", 2, SMALL_GPT + [
        "--train-iters", "6", "--log-interval", "2", "--eval-interval", "3", "--eval-iters", "1",
        "--tensorboard-dir", str(tmp_path),
        "--parcae", "--parcae-layout-schedule", "2:2,1,1;4:1,2,1", "--log-throughput"])
    printed = losses(run)
    board = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    board.Reload()
    scalars = {tag: {e.step: e.value for e in board.Scalars(tag)} for tag in board.Tags()["scalars"]}
    assert set(scalars) == {"lm loss", "learning-rate", "grad-norm", "batch-size", "iteration-time",
                            "samples-per-second", "throughput", "parcae/tensor-model-parallel-size",
                            "parcae/pipeline-model-parallel-size", "parcae/data-parallel-size", "lm loss validation",
                            "parcae/layout-change-seconds"}
    changes = {e.iteration: e.seconds for e in run.of(LayoutChange)}
    assert scalars.pop("parcae/layout-change-seconds") == pytest.approx(changes, rel=1e-6) and sorted(changes) == [2, 4]
    validation = {e.iteration: e.losses["lm loss"] for e in run.of(Evaluation)}
    assert scalars.pop("lm loss validation") == pytest.approx(validation, rel=1e-6) and sorted(validation) == [3, 6]
    # --tensorboard-log-interval 1 (the default): every step, also those not printed.
    assert all(sorted(values) == [1, 2, 3, 4, 5, 6] for values in scalars.values())
    assert sorted(printed) == [2, 4, 6]
    for it, loss in printed.items():
        assert scalars["lm loss"][it] == pytest.approx(loss, rel=1e-6)
        assert f"iteration {it:8d}/" in run.stdout and f"lm loss: {loss:.6E}" in run.stdout
    logged = {e.iteration: e for e in run.of(Iteration)}
    assert scalars["learning-rate"][4] == pytest.approx(logged[4].learning_rate, rel=1e-6)
    assert scalars["grad-norm"][4] == pytest.approx(logged[4].grad_norm, rel=1e-6)
    # Step i trains in the layout of the boundary before it.
    layouts = {it: (scalars["parcae/tensor-model-parallel-size"][it], scalars["parcae/pipeline-model-parallel-size"][it],
                    scalars["parcae/data-parallel-size"][it]) for it in range(1, 7)}
    assert layouts == {1: (1, 1, 2), 2: (1, 1, 2), 3: (2, 1, 1), 4: (2, 1, 1), 5: (1, 2, 1), 6: (1, 2, 1)}
    flops = model_flops_per_step("gpt", 4, 64, 256, 32, 384, 8)
    for it in range(1, 7):
        assert scalars["samples-per-second"][it] == pytest.approx(8 / scalars["iteration-time"][it], rel=1e-5)
        assert scalars["throughput"][it] == pytest.approx(flops / (scalars["iteration-time"][it] * 1e12 * 2), rel=1e-5)
    for it in printed:  # --log-throughput: Megatron-LM's column, one decimal
        assert f"throughput per GPU (TFLOP/s/GPU): {logged[it].tflops_per_gpu:.1f} |" in run.stdout
        assert logged[it].tflops_per_gpu == pytest.approx(scalars["throughput"][it], rel=1e-5)
