"""Checkpoints a Megatron user can take elsewhere: what a run saves under one layout
loads into a plain megatron-core GPTModel at T1P1 through `model.sharded_state_dict()`
and `dist_checkpointing.load`, and what such a model saves loads into a run under
another layout (tests/plain_megatron.py is that plain program)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, SMALL_GPT, layout_flags, losses, torchrun

pytestmark = pytest.mark.slow  # every test here starts processes

GBS = 8  # SMALL_GPT's global batch


def plain(command: str, directory, batch_at: int, flags: list[str]) -> float:
    """tests/plain_megatron.py: the plain model's loss on the batch after `batch_at` samples."""
    run = subprocess.run([sys.executable, str(REPO / "tests" / "plain_megatron.py"), command, str(directory),
                          "--batch-at", str(batch_at), "--", *flags], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])["loss"]


@pytest.mark.extended
def test_a_t2p2_checkpoint_loads_into_a_plain_megatron_core_model_at_t1p1(tiny_data, tmp_path):
    """SwiGLU's fc1 is a sharded factory, the tied output layer a replica on the last stage:
    the plain model's loss on batch 3 from iteration 2's checkpoint is the run's own."""
    flags = SMALL_GPT + ["--swiglu", "--train-iters", "3"]
    run = losses(torchrun("pretrain_gpt.py", 4, flags + layout_flags(2, 2) + [
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]))
    loss = plain("load", tmp_path / "ckpt" / "iter_0000002", 2 * GBS, flags)
    assert abs(loss - run[3]) <= 1e-5 * abs(run[3]), (loss, run[3])


def test_a_plain_megatron_core_checkpoint_loads_here_under_another_layout(tiny_data, tmp_path):
    """A T1P1 model's own checkpoint (no optimizer state, no progress record) loads at
    T2P2 with --finetune, whose first loss is the plain model's; without it, or into
    another model, the run refuses in one line."""
    flags = SMALL_GPT + ["--swiglu", "--untie-embeddings-and-output-weights", "--train-iters", "2"]
    loss = plain("save", tmp_path / "plain", 0, flags)
    load = ["--load", str(tmp_path / "plain")]
    refused = torchrun("pretrain_gpt.py", 1, flags + load)
    assert refused.returncode != 0 and "load its weights with --finetune" in refused.stderr, refused.stderr[-2000:]
    refused = torchrun("pretrain_gpt.py", 1, flags + load + ["--finetune", "--ffn-hidden-size", "128"])
    assert refused.returncode != 0 and "checkpoint is of another model (decoder.layers.mlp.linear_fc2.weight is " \
        "(4, 64, 256) there, (4, 64, 128) here)" in refused.stderr, refused.stderr[-2000:]
    run = losses(torchrun("pretrain_gpt.py", 4, flags + layout_flags(2, 2) + [
        "--load", str(tmp_path / "plain"), "--finetune"]))
    assert sorted(run) == [1, 2]
    assert abs(run[1] - loss) <= 1e-5 * abs(loss), (run[1], loss)
