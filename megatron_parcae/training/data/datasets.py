"""Training samples: megatron-core datasets, and which micro-batches each rank trains.

Samples are addressed by their index in the training stream. A step consumes the global
batch [consumed, consumed + G); it is cut into micro-batches of consecutive samples, and
micro-batch k goes to data-parallel rank k mod D. The cut does not depend on D, so every
layout trains the same micro-batches in the same step, and a job that changes layout
needs nothing but the consumed-samples count to continue. An evaluation's batches of the
validation split are cut the same way, and chosen by its iteration alone.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from megatron_parcae.training.data.tokenizer import HuggingFaceTokenizer, Tokenizer


@dataclass(frozen=True)
class MockTokenizer:
    """Vocabulary size and EOD for random-token benchmark data."""

    vocab_size: int

    @property
    def eod(self) -> int:
        return self.vocab_size - 1

    @property
    def unique_identifiers(self) -> dict:
        return {"class": "MockTokenizer", "vocab_size": self.vocab_size}


def build_tokenizer(args: argparse.Namespace) -> Tokenizer | HuggingFaceTokenizer | MockTokenizer:
    if args.tokenizer_type == "NullTokenizer":
        # Megatron-LM's: the data's ids as they are, --vocab-size of them, then the EOD id.
        return MockTokenizer(args.vocab_size + 1)
    if args.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model)
    if args.vocab_file is not None and args.tokenizer_type is not None:
        return Tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    return MockTokenizer(args.vocab_size)


def build_datasets(args: argparse.Namespace, tokenizer) -> tuple[torch.utils.data.Dataset,
                                                                  torch.utils.data.Dataset | None]:
    """The training split, long enough for --train-iters global batches, and the validation
    split, long enough for every evaluation (None without --eval-interval)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    num_samples = args.train_iters * args.global_batch_size
    num_valid = validation_batches(args) * args.global_batch_size
    blend = args.data_blend
    common = dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if blend is None else (list(blend.prefixes), blend.weights and list(blend.weights)),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        mid_level_dataset_surplus=0.005,
    )
    if args.model == "gpt":
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

        cls = MockGPTDataset if args.mock_data else GPTDataset
        config = GPTDatasetConfig(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                  create_attention_mask=False, **common)
    else:
        from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig

        cls = BERTMaskedWordPieceDataset
        config = BERTMaskedWordPieceDatasetConfig(
            masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=1,
            masking_do_full_word=False, masking_do_permutation=False, masking_use_longer_ngrams=False,
            masking_use_geometric_distribution=False, classification_head=not args.bert_no_binary_head,
            **common)
    # Independently started workers (--parcae-etcd, no WORLD yet) build at once; megatron-core
    # writes its index cache without locking, so one builds while the others wait, then read
    # its cache. (Within a WORLD megatron-core builds on rank 0 behind a barrier itself.)
    independent = blend is not None and not torch.distributed.is_initialized()
    lock_dir = Path(args.data_cache_path or Path(blend.prefixes[0]).parent) if independent else None
    with _exclusive(lock_dir / ".parcae-dataset-build.lock" if lock_dir else None):
        train, valid, _ = BlendedMegatronDatasetBuilder(cls, [num_samples, num_valid, 0], lambda: True, config).build()
    if train is None or len(train) < num_samples:
        raise ValueError(f"--data-path holds too little data for {num_samples} training samples")
    if num_valid == 0:
        return train, None
    if valid is None or len(valid) < num_valid:
        raise ValueError(f"--split: the validation split holds too little data for {num_valid} samples")
    return train, valid


def validation_batches(args: argparse.Namespace) -> int:
    """Global batches the run's evaluations read in all: --eval-iters at each --eval-interval."""
    if args.eval_interval is None:
        return 0
    return args.train_iters // args.eval_interval * args.eval_iters


def validation_batch_indices(args: argparse.Namespace, iteration: int) -> range:
    """The validation global batches of the evaluation at `iteration`: each evaluation reads
    the --eval-iters batches after the previous one's, by the iteration alone, so a resumed
    or relaid-out run reads what an uninterrupted one reads."""
    first = (iteration // args.eval_interval - 1) * args.eval_iters
    return range(first, first + args.eval_iters)


@contextlib.contextmanager
def _exclusive(lock_path: Path | None) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` (no lock when None)."""
    if lock_path is None:
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def rank_micro_batches(consumed: int, global_batch: int, micro_batch: int, dp_rank: int,
                       dp_size: int) -> list[range]:
    """Sample indices of the micro-batches this data-parallel rank trains in one step."""
    count = global_batch // micro_batch
    return [range(consumed + k * micro_batch, consumed + (k + 1) * micro_batch)
            for k in range(dp_rank, count, dp_size)]


def collate(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.as_tensor(np.stack([np.asarray(s[key]) for s in samples])) for key in samples[0]}


def step_iterator(dataset, micro_batches: list[range]) -> Iterator[dict[str, torch.Tensor]]:
    """The micro-batches of one step, as megatron-core's schedules pull them."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    for indices in micro_batches:
        batch = collate([dataset[i] for i in indices])
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}
