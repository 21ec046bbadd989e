"""--eval-interval and --eval-iters: the validation loss on --split's validation share,
the same under every layout, for GPT and BERT, and without effect on training."""

from __future__ import annotations

import math

import pytest

from helpers import SMALL_GPT, Run, assert_close, computed_once, layout_flags, losses, torchrun
from megatron_parcae.events import Evaluation
from megatron_parcae.training.pretrain import pretrain

EVAL = ["--eval-interval", "2", "--eval-iters", "2"]


def validation_losses(run: Run) -> dict[int, float]:
    return {e.iteration: e.losses["lm loss"] for e in run.of(Evaluation)}


@pytest.mark.parametrize("args,message", [
    (["--data-path", "0.7", "data/python-docs-gpt_text_document", "0.3"],
     "--data-path: a weighted list needs a weight before every prefix, got 3 words"),
    (["--data-path", "1", "data/python-docs-gpt_text_document", "-2", "data/python-docs-gpt_text_document"],
     "--data-path: weight '-2' is not a positive number"),
    (["--data-path", "0", "data/python-docs-gpt_text_document"], "--data-path: weight '0' is not a positive number"),
    (["--split", "100,0,0", "--eval-interval", "10"],
     "--eval-interval needs a validation share in --split, got 100,0,0"),
    (["--eval-interval", "0"], "--eval-interval must be positive, got 0"),
    (["--eval-interval", "10", "--eval-iters", "-1"], "--eval-iters must be >= 0, got -1"),
    (["--split", "98,two,0"],
     "--split: expected up to 3 comma-separated numbers >= 0 (train,validation,test), got '98,two,0'"),
    (["--split", "0,1,0"], "--split 0,1,0: the training share must be positive"),
], ids=["odd-weighted", "negative-weight", "zero-weight", "no-validation-share", "interval", "iters", "split-text",
        "no-training-share"])
def test_bad_input_fails_in_one_line(tiny_data, capsys, args, message):
    """Checked in pretrain's argument parsing: exit 2 before torch.distributed is touched."""
    with pytest.raises(SystemExit) as exited:
        pretrain("gpt", ["--config", "configs/gpt-tiny.yaml", *args])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"pretrain_gpt.py: error: {message}\n"


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> dict[str, dict[int, float]]:
    """4 iterations at T1P1D2, evaluated at 2 and 4."""
    def run(_) -> dict[str, dict[int, float]]:
        done = torchrun("pretrain_gpt.py", 2, SMALL_GPT + EVAL + ["--train-iters", "4"])
        return {"train": losses(done), "validation": validation_losses(done)}

    return {kind: {int(it): loss for it, loss in found.items()} for kind, found in
            computed_once(tmp_path_factory, "evaluation-reference", run).items()}


@pytest.mark.extended
@pytest.mark.slow
def test_validation_loss_is_the_same_in_a_pipeline(reference):
    run = torchrun("pretrain_gpt.py", 2, SMALL_GPT + EVAL + layout_flags(1, 2) + ["--train-iters", "4"])
    assert_close(losses(run), reference["train"])
    assert sorted(reference["validation"]) == [2, 4]
    assert_close(validation_losses(run), reference["validation"])
    assert " validation loss at iteration 4 | lm loss value: " in run.stdout


@pytest.mark.slow
def test_evaluating_leaves_training_unchanged(tiny_data):
    """With dropout on: evaluation draws no mask a step draws, consumes no training sample
    and leaves the model training."""
    dropout = SMALL_GPT + ["--train-iters", "4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    evaluated = torchrun("pretrain_gpt.py", 1, dropout + EVAL)
    assert sorted(validation_losses(evaluated)) == [2, 4]
    assert_close(losses(evaluated), losses(torchrun("pretrain_gpt.py", 1, dropout)))


@pytest.mark.extended
@pytest.mark.slow
def test_bert_evaluates_through_a_pipeline(tiny_data):
    run = torchrun("pretrain_bert.py", 2, ["--config", "configs/bert-tiny.yaml", "--train-iters", "2",
                                           "--eval-interval", "1", "--eval-iters", "1", *layout_flags(1, 2)])
    assert run.returncode == 0, run.stderr[-3000:]
    found = run.of(Evaluation)
    assert [e.iteration for e in found] == [1, 2]
    for event in found:
        assert event.losses.keys() == {"lm loss", "sop loss"} and all(map(math.isfinite, event.losses.values()))
