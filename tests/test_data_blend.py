"""--data-path blends as Megatron-LM reads them: the words, the samples a blend gives, and a
weighted blend trained, resumed from a checkpoint and relaid out in place, exactly.

The second dataset is the later half of the tiny corpus, tokenized as the tiny config's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import SMALL_GPT, assert_close, layout_flags, losses, torchrun, write_tracker
from megatron_parcae.training.data.blend import Blend, parse_blend, parse_split


@pytest.fixture(scope="module")
def blend_flags(tiny_data, tmp_path_factory) -> list[str]:
    """--data-path 0.7 (the whole corpus) 0.3 (its later half)."""
    from megatron_parcae.training.data.preprocess import preprocess
    from megatron_parcae.training.data.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("blend")
    lines = Path(tiny_data["corpus"]).read_text().splitlines(keepends=True)
    (folder / "half.jsonl").write_text("".join(lines[len(lines) // 2:]))
    tokenizer = Tokenizer("GPT2BPETokenizer", tiny_data["gpt_vocab"], tiny_data["gpt_merges"])
    second = preprocess(str(folder / "half.jsonl"), str(folder / "half"), tokenizer, append_eod=True)["text"]
    return ["--data-path", "0.7", tiny_data["gpt_prefix"], "0.3", second]


def test_words_read_as_megatron_lm_reads_them():
    assert parse_blend(["a", "b"]) == Blend(("a", "b"), None)
    assert parse_blend(["a"]) == Blend(("a",), None)
    assert parse_blend(["0.7", "a", "3e-1", "b"]) == Blend(("a", "b"), (0.7, 0.3))
    assert parse_split("969, 30, 1") == pytest.approx((0.969, 0.03, 0.001))
    assert parse_split("98,2") == pytest.approx((0.98, 0.02, 0.0))


@pytest.mark.parametrize("words,message", [
    (["0.7", "a", "0.3"], "a weighted list needs a weight before every prefix, got 3 words"),
    (["0.7", "a", "b", "c"], "weight 'b' is not a positive number"),
    (["1", "a", "0", "b"], "weight '0' is not a positive number"),
    (["1", "a", "-2", "b"], "weight '-2' is not a positive number"),
    (["nan", "a"], "weight 'nan' is not a positive number"),
])
def test_bad_weighted_lists_are_named(words, message):
    with pytest.raises(ValueError, match=message):
        parse_blend(words)


@pytest.mark.slow  # the second dataset and megatron-core: about 10 s
def test_blend_samples_by_weight_or_by_size(blend_flags):
    """The weights give each dataset its share of the training samples; a plain list of
    prefixes gives each its size's share, one pass over each (megatron-core's meaning)."""
    from megatron_parcae.training.arguments import parse_args
    from megatron_parcae.training.cpu import import_megatron_core
    from megatron_parcae.training.data.datasets import build_datasets, build_tokenizer

    import_megatron_core()
    weighted = parse_args(SMALL_GPT + ["--train-iters", "50"] + blend_flags, prog="test", model="gpt", world_size=1)
    train, _ = build_datasets(weighted, build_tokenizer(weighted))
    assert abs(float((train.dataset_index == 1).mean()) - 0.3) < 0.01
    by_size = parse_args(SMALL_GPT + ["--train-iters", "50", "--data-path", *blend_flags[2::2]], prog="test",
                         model="gpt", world_size=1)
    train, _ = build_datasets(by_size, build_tokenizer(by_size))
    sizes = [len(d) for d in train.datasets]
    assert len(train) == 50 * 8 and abs(float((train.dataset_index == 1).mean()) - sizes[1] / sum(sizes)) < 0.01


@pytest.fixture(scope="module")
def blend_run(blend_flags, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """6 iterations of the weighted blend at T1P1D2, saved at 3 and 6; the tracker names 3."""
    save = tmp_path_factory.mktemp("blend-ckpt")
    full = losses(torchrun("pretrain_gpt.py", 2, SMALL_GPT + blend_flags + [
        "--train-iters", "6", "--save", str(save), "--save-interval", "3"]))
    write_tracker(save, 3)
    return save, full


@pytest.mark.extended
@pytest.mark.slow
def test_blend_resumes_exactly_in_another_layout(blend_flags, blend_run):
    save, full = blend_run
    resumed = torchrun("pretrain_gpt.py", 2, SMALL_GPT + blend_flags + layout_flags(1, 2) + [
        "--train-iters", "6", "--load", str(save)])
    assert "loaded checkpoint" in resumed.stdout
    assert_close(losses(resumed), {it: loss for it, loss in full.items() if it > 3})


@pytest.mark.extended
@pytest.mark.slow
def test_blend_trains_on_through_an_in_place_change(blend_flags, blend_run):
    _, full = blend_run
    changed = torchrun("pretrain_gpt.py", 2, SMALL_GPT + blend_flags + [
        "--train-iters", "6", "--parcae", "--parcae-layout-schedule", "3:1,2,1"])
    assert "layout change at iteration 3" in changed.stdout
    assert_close(losses(changed), full)
