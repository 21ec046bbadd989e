"""`parcae preprocess`: text or JSONL -> megatron-core indexed datasets (.bin/.idx).

Flag names follow Megatron-LM's tools/preprocess_data.py. Output files are
`{output_prefix}_{key}_document` (one item per document, for GPT) or
`{output_prefix}_{key}_sentence` with --split-sentences (one item per sentence, which
BERT's sentence-pair sampling needs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from megatron_parcae.training.arguments import TOKENIZERS
from megatron_parcae.training.data.tokenizer import Tokenizer, train_tokenizer

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")


class InputError(ValueError):
    """Malformed input file; the message gives file:line."""


def read_documents(path: str, json_keys: tuple[str, ...]) -> Iterator[dict[str, str]]:
    """Documents of a JSONL file (one object a line) or a text file (blank-line separated)."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{lineno}: not JSON: {exc.msg}") from None
                if not isinstance(obj, dict):
                    raise InputError(f"{path}:{lineno}: expected a JSON object")
                for key in json_keys:
                    if not isinstance(obj.get(key), str):
                        raise InputError(f"{path}:{lineno}: no string field {key!r}")
                yield {key: obj[key] for key in json_keys}
    else:
        text = p.read_text(encoding="utf-8")
        for block in re.split(r"\n\s*\n", text):
            if block.strip():
                yield {key: block.strip() for key in json_keys}


def split_sentences(text: str) -> list[str]:
    return [s for s in (part.strip() for part in _SENTENCE_END.split(text)) if s]


def write_indexed_dataset(documents: Iterator[list[list[int]]], prefix: str, vocab_size: int) -> int:
    """Write documents (lists of token lists) as a megatron-core indexed dataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    import torch

    dtype = np.uint16 if vocab_size < 65500 else np.int32
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    count = 0
    for items in documents:
        items = [item for item in items if item]
        if not items:
            continue
        builder.add_document(torch.tensor([t for item in items for t in item], dtype=torch.int64),
                             [len(item) for item in items])
        count += 1
    builder.finalize(get_idx_path(prefix))
    return count


def preprocess(input_path: str, output_prefix: str, tokenizer: Tokenizer, json_keys: tuple[str, ...] = ("text",),
               split: bool = False, append_eod: bool = False) -> dict[str, str]:
    """Tokenize every document; returns {json key: dataset prefix}."""
    level = "sentence" if split else "document"
    prefixes = {}
    for key in json_keys:
        def docs() -> Iterator[list[list[int]]]:
            for doc in read_documents(input_path, (key,)):
                pieces = split_sentences(doc[key]) if split else [doc[key]]
                items = [tokenizer.tokenize(piece) for piece in pieces]
                if append_eod and items:
                    items[-1] = items[-1] + [tokenizer.eod]
                yield items
        prefix = f"{output_prefix}_{key}_{level}"
        if write_indexed_dataset(docs(), prefix, tokenizer.vocab_size) == 0:
            raise InputError(f"{input_path}: no documents with text under {key!r}")
        prefixes[key] = prefix
    return prefixes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSONL (one object per line) or plain text file")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL keys whose text is tokenized, one dataset each")
    parser.add_argument("--split-sentences", action="store_true", help="one item per sentence (BERT)")
    parser.add_argument("--append-eod", action="store_true", help="end each document with the EOD token (GPT)")
    parser.add_argument("--tokenizer-type", choices=TOKENIZERS, required=True, help="tokenizer, as in the training flags")
    parser.add_argument("--vocab-file", required=True, help="the tokenizer's vocabulary (written with --train-vocab-size)")
    parser.add_argument("--merge-file", default=None, help="BPE merges, which GPT2BPETokenizer needs")
    parser.add_argument("--train-vocab-size", type=int, default=None,
                        help="train the vocab (and merge) file on --input first, with this many tokens")
    parser.add_argument("--output-prefix", required=True, help="path prefix of the .bin/.idx files written")


def run(args: argparse.Namespace) -> int:
    try:
        if not Path(args.input).is_file():
            raise InputError(f"--input: no such file {args.input}")
        if args.tokenizer_type == "GPT2BPETokenizer" and args.merge_file is None:
            raise InputError("--merge-file is required with GPT2BPETokenizer")
        if args.train_vocab_size is not None:
            texts = (doc[k] for doc in read_documents(args.input, tuple(args.json_keys)) for k in args.json_keys)
            train_tokenizer(args.tokenizer_type, texts, args.train_vocab_size, args.vocab_file, args.merge_file)
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if path is not None and not Path(path).is_file():
                raise InputError(f"{flag}: no such file {path} (train one with --train-vocab-size)")
        tokenizer = Tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
        prefixes = preprocess(args.input, args.output_prefix, tokenizer, tuple(args.json_keys),
                              args.split_sentences, args.append_eod)
    except (InputError, UnicodeDecodeError) as exc:
        print(f"parcae preprocess: error: {exc}", file=sys.stderr)
        return 2
    for key, prefix in prefixes.items():
        print(f"{key}: {prefix}.bin, {prefix}.idx")
    return 0
