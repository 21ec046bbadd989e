"""scripts/pretrain_gpt.py under torchrun with gloo: layouts, checkpoints, bad input.

Real megatron-core models and schedules in real processes; every run trains the tiny
configs' data (the Python documentation).
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import (REPO, SMALL_GPT, assert_close, computed_folder, layout_flags, losses, shared_losses, torchrun,
                     write_tracker)



@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> dict[int, float]:
    return shared_losses(tmp_path_factory, "training-reference",
                         lambda _: losses(torchrun("pretrain_gpt.py", 1, SMALL_GPT + ["--train-iters", "10"])))


# Each optimizer with TP, PP and DP, in four layouts (T1P2 alone is what the resume tests
# train; the executor's tests cover both optimizers across layout changes, and
# test_nccl_rules.py's four-process run trains T1P2D2 with Adam before its first change).
@pytest.mark.parametrize("layout,distributed_optimizer", [
    pytest.param((2, 1, 1), False, marks=pytest.mark.extended), pytest.param((1, 1, 2), True, marks=pytest.mark.extended),
    ((2, 2, 1), True), pytest.param((1, 2, 2), False, marks=pytest.mark.extended),
], ids=lambda v: "T%dP%dD%d" % v if isinstance(v, tuple) else ("distributed-adam" if v else "adam"))
@pytest.mark.slow
def test_layouts_train_the_same_model(reference, layout, distributed_optimizer):
    tp, pp, dp = layout
    extra = ["--use-distributed-optimizer"] if distributed_optimizer else []
    run = torchrun("pretrain_gpt.py", tp * pp * dp, SMALL_GPT + layout_flags(tp, pp) + ["--train-iters", "10"] + extra)
    assert_close(losses(run), reference)


@pytest.fixture(scope="module")
def saved_run(tiny_data, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """20 iterations at T1P2D1 with asynchronous checkpoints at 10 and 20; the tracker names 10."""
    def run(folder: Path) -> dict[int, float]:
        full = losses(torchrun("pretrain_gpt.py", 2, SMALL_GPT + layout_flags(1, 2) + [
            "--train-iters", "20", "--save", str(folder / "ckpt"), "--save-interval", "10",
            "--use-distributed-optimizer", "--async-save"]))
        write_tracker(folder / "ckpt", 10)
        return full

    full = shared_losses(tmp_path_factory, "resume", run)
    return computed_folder(tmp_path_factory, "resume") / "ckpt", full


@pytest.mark.slow
# The default run resumes in another layout in tests/test_half_precision.py (T1P2 -> T2P1D2,
# fp16 and the distributed optimizer) and in the same one in tests/test_exit_signal_handler.py.
@pytest.mark.extended
@pytest.mark.parametrize("resume_layout", [(1, 2, 1), (2, 1, 2)],
                         ids=["same-layout", "other-layout"])
def test_resume_continues_exactly(saved_run, resume_layout):
    save, full = saved_run
    tp, pp, dp = resume_layout
    resumed = torchrun("pretrain_gpt.py", tp * pp * dp, SMALL_GPT + layout_flags(tp, pp) + [
        "--train-iters", "20", "--load", str(save)])
    assert "loaded checkpoint" in resumed.stdout
    assert_close(losses(resumed), {it: loss for it, loss in full.items() if it > 10})


def _fail(args: list[str], world_size: int = 1) -> str:
    """Run the script as a torchrun rank would; return its one-line error."""
    env = {**os.environ, "WORLD_SIZE": str(world_size), "RANK": "0"}
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "pretrain_gpt.py"), *args],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


@pytest.mark.parametrize("args,world,flag", [
    (["--num-attention-heads", "3", "--tensor-model-parallel-size", "2"], 2, "--num-attention-heads"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2, "--global-batch-size"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3"),
    (["--data-path", "data/no-such-dataset"], 1, "--data-path"),
    (["--async-save"], 1, "--async-save needs --save"),
    (["--parcae", "--parcae-etcd", "127.0.0.1:1", "--parcae-job", "j", "--parcae-metadata-endpoint", "http://x"], 1,
     "--parcae-metadata-endpoint needs --parcae-notice aws, gcp or azure"),
    (["--parcae", "--parcae-etcd", "127.0.0.1:1", "--parcae-job", "j", "--parcae-notice", "aws",
      "--parcae-metadata-endpoint", "ftp://x"], 1, "--parcae-metadata-endpoint: endpoint must look like http://"),
], ids=["heads", "layers", "global-batch", "world-size", "data-path", "async-save", "endpoint-alone", "endpoint-url"])
@pytest.mark.slow
def test_bad_input_fails_in_one_line(tiny_data, args, world, flag):
    assert flag in _fail(["--config", "configs/gpt-tiny.yaml", *args], world)


@pytest.mark.slow
def test_unknown_config_key_is_named(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text((REPO / "configs" / "gpt-tiny.yaml").read_text() + "num-layerz: 4\n")
    assert "num-layerz" in _fail(["--config", str(config)])


@pytest.mark.slow
def test_bert_tiny_learns_in_20_iterations(tiny_data):
    """GPT-tiny's learning is checked by tests/test_half_precision.py and the quick start."""
    run = losses(torchrun("pretrain_bert.py", 2, ["--config", "configs/bert-tiny.yaml", "--train-iters", "20",
                                                  *layout_flags(1, 2)]))
    first, last = run[min(run)], run[max(run)]
    assert last < 0.8 * first, (first, last)


_FLAG_NAMES = ["num-layers", "hidden-size", "num-attention-heads", "micro-batch-size", "global-batch-size",
               "tensor-model-parallel-size", "lr", "lr-decay-style", "bf16", "data-path", "seed", "parcae",
               "parcae-etcd", "parcae-worker-id", "save-interval", "no-such-flag"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.integers(-2, 64), max_size=3))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(_FLAG_NAMES), _VALUES, max_size=6) | _VALUES)
def test_config_loader_gives_only_clear_errors(tiny_data, tmp_path_factory, loaded):
    """Any YAML document over the tiny config either parses or fails with an ArgumentError."""
    import yaml

    from megatron_parcae.training.arguments import ArgumentError, parse_args

    config = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    base = yaml.safe_load((REPO / "configs" / "gpt-tiny.yaml").read_text())
    config.write_text(yaml.safe_dump({**base, **loaded} if isinstance(loaded, dict) else loaded))
    try:
        args = parse_args(["--config", str(config)], prog="fuzz", model="gpt", world_size=1)
    except ArgumentError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert math.isfinite(args.lr) and args.num_layers % args.pipeline_model_parallel_size == 0


def test_collection_resumes_with_what_was_built_frozen():
    from megatron_parcae.training.loop import _collect_from_now_on

    gc.disable()  # as scripts/pretrain_*.py do before importing torch
    try:
        _collect_from_now_on()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()
