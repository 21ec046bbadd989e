"""Megatron-LM's model and memory flags under in-place layout changes.

RoPE, RMSNorm, an untied output layer, SwiGLU and grouped-query attention change which
parameters exist and how they are cut over TP; sequence parallelism, recomputation and
overlapped reductions change how a step runs. A run whose layout changes T, P and D
must still train the model an unchanged run trains.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import REPO, SMALL_GPT, assert_close, assert_same_state, layout_flags, losses, torchrun, write_tracker
from megatron_parcae import events
from megatron_parcae.training.arguments import ArgumentError, parse_args

ITERS = 8
MODEL = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2",
         "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1", "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--overlap-param-gather", "--train-iters", str(ITERS)]


@pytest.mark.extended
@pytest.mark.slow
def test_flags_train_the_same_model_through_tensor_pipeline_and_data_changes(tiny_data, tmp_path):
    """T 2 -> 1 -> 2 -> 1: the per-group QKV and the vocab-parallel output layer are re-cut
    each time, and sequence parallelism goes off and on; the checkpoints agree too."""
    reference = torchrun("pretrain_gpt.py", 1, SMALL_GPT + MODEL + ["--save", str(tmp_path / "reference")])
    changed = torchrun("pretrain_gpt.py", 4, SMALL_GPT + MODEL + layout_flags(2, 2) + [
        "--save", str(tmp_path / "changed"), "--parcae", "--parcae-layout-schedule", "2:1,1,4;4:2,1,2;6:1,2,2"],
        timeout=300)
    found = losses(changed)
    layouts = [(c.iteration, c.kind, (c.tp, c.pp, c.dp)) for c in changed.of(events.LayoutChange)]
    assert layouts == [(2, "tensor", (1, 1, 4)), (4, "tensor", (2, 1, 2)), (6, "tensor", (1, 2, 2))], layouts
    assert_close(found, losses(reference))
    assert_same_state(tmp_path / "changed", tmp_path / "reference", SMALL_GPT + MODEL)


@pytest.mark.extended
@pytest.mark.slow
def test_swiglu_is_recut_when_tensor_parallelism_changes_and_in_checkpoints(tiny_data, tmp_path):
    """fc1 holds [gate; up] per TP shard (stride 2): T 2 -> 1 must regroup both halves, and
    a checkpoint written at T = 2 resumes at T = 1 as the uninterrupted run goes on."""
    flags = SMALL_GPT + ["--swiglu", "--train-iters", "4"]
    # Iteration 2's checkpoint is saved before the boundary's change, still at T = 2.
    changed = torchrun("pretrain_gpt.py", 2, flags + layout_flags(2, 1) + [
        "--save", str(tmp_path / "t2"), "--save-interval", "2",
        "--parcae", "--parcae-layout-schedule", "2:1,1,2"], timeout=300)
    assert [(c.kind, c.tp) for c in changed.of(events.LayoutChange)] == [("tensor", 1)]
    reference = losses(torchrun("pretrain_gpt.py", 1, flags))
    assert_close(losses(changed), reference)
    write_tracker(tmp_path / "t2", 2)
    resumed = losses(torchrun("pretrain_gpt.py", 1, flags + ["--load", str(tmp_path / "t2")]))
    assert_close(resumed, {i: reference[i] for i in (3, 4)})


def _parse(extra: list[str], world_size: int = 1):
    return parse_args(SMALL_GPT + ["--train-iters", "4"] + extra, prog="pretrain_gpt.py", model="gpt",
                      world_size=world_size)


@pytest.mark.parametrize("extra,world,message", [
    (["--overlap-param-gather", "--overlap-grad-reduce"], 1, "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], 1, "--overlap-param-gather needs --overlap-grad-reduce"),
    (["--recompute-method", "block"], 1, "--recompute-method needs --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], 1,
     "--recompute-num-layers needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "1"], 1,
     "--recompute-granularity full needs --recompute-method"),
    (["--group-query-attention", "--num-query-groups", "3"], 1, "--num-query-groups 3 does not divide "
                                                               "--num-attention-heads 4"),
    (["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"], 2,
     "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--group-query-attention", "--num-query-groups", "1", "--parcae", "--parcae-layout-schedule", "2:2,1,1"], 2,
     "--parcae-layout-schedule: change at iteration 2: model.num_query_groups 1 is not divisible by layout.tp 2"),
    (["--rotary-percent", "0"], 1, "--rotary-percent must be in (0, 1]"),
], ids=["param-gather-plain-adam", "param-gather-alone", "method-without-full", "layers-with-selective",
        "full-without-method", "groups-divide-heads", "groups-divide-tp", "schedule-changes-tp", "rotary-percent"])
def test_bad_combinations_fail_before_training(tiny_data, extra, world, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        _parse(extra, world)


def test_a_bad_combination_exits_2_with_one_line(tiny_data):
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0"}
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "pretrain_gpt.py"), *SMALL_GPT, "--train-iters", "4",
                          "--overlap-param-gather"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --overlap-param-gather needs --use-distributed-optimizer"], run.stderr


def test_shape_follows_the_flags(tiny_data):
    """What the planner counts: no position table under RoPE, the output layer when untied."""
    from reconfig.layout import POSITION_EMBEDDING, HEAD, ModelShape

    plain, flagged = (ModelShape.from_args(_parse(extra), vocab_size=384) for extra in (
        [], ["--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--swiglu",
             "--group-query-attention", "--num-query-groups", "2"]))
    assert plain.unit(POSITION_EMBEDDING).params == 32 * 64 and flagged.unit(POSITION_EMBEDDING).params == 0
    assert flagged.unit(HEAD).split_params == plain.unit(HEAD).split_params + 384 * 64
    # QKV loses 2 of 4 key/value heads of 16 (2 x 2 x 16 x 64 weights and 64 biases); fc1 doubles (256 x 64 + 256).
    assert flagged.unit("layer.0").split_params - plain.unit("layer.0").split_params == 256 * 65 - 64 * 65


def test_a_checkpoint_loads_only_into_the_flags_that_wrote_it(tiny_data):
    """RoPE drops the position table, RMSNorm the biases, GQA shrinks QKV: another value
    of any of them is refused by name; a record without the newer flags has their defaults."""
    from megatron_parcae.training.checkpointing import CheckpointError, _shape, check_same_model

    plain = _parse([])
    saved = _shape(plain)
    check_same_model("ckpt", saved, plain)
    check_same_model("ckpt", {k: saved[k] for k in ("model", "num_layers", "hidden_size", "ffn_hidden_size",
                                                     "num_attention_heads", "max_position_embeddings")}, plain)
    for extra, named in [(["--position-embedding-type", "rope"], "position_embedding_type: learned_absolute != rope"),
                         (["--normalization", "RMSNorm"], "normalization: LayerNorm != RMSNorm"),
                         (["--swiglu"], "swiglu: False != True"),
                         (["--group-query-attention", "--num-query-groups", "2"], "num_query_groups: None != 2")]:
        with pytest.raises(CheckpointError, match=re.escape(f"--load ckpt: checkpoint is of another model ({named})")):
            check_same_model("ckpt", saved, _parse(extra))
