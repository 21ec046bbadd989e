"""Tokenizers that work offline, with the attributes megatron-core's datasets read.

Megatron-LM's GPT-2 BPE and BERT WordPiece tokenizers, read from the usual vocab (and
merge) files through the `tokenizers` library, which can also train such files from a
local corpus; and a tokenizer transformers saved to a local folder. No hub, no download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer

EOD_TOKEN = "<|endoftext|>"
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class Tokenizer:
    """One tokenizer object for GPT (eod) and BERT (cls/sep/mask/pad) datasets."""

    def __init__(self, tokenizer_type: str, vocab_file: str, merge_file: str | None = None) -> None:
        self.tokenizer_type = tokenizer_type
        if tokenizer_type == "GPT2BPETokenizer":
            if merge_file is None:
                raise ValueError("GPT2BPETokenizer needs a merge file")
            self._tok = ByteLevelBPETokenizer(vocab_file, merge_file)
            self._tok.add_special_tokens([EOD_TOKEN])
        elif tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
            self._tok = BertWordPieceTokenizer(vocab_file, lowercase=tokenizer_type.endswith("LowerCase"))
        else:
            raise ValueError(f"unknown tokenizer type {tokenizer_type!r}")
        # Ordered by id: `tokenizers` returns its vocabulary in hash order, which changes from
        # process to process, and megatron's BERT dataset draws random tokens from this order.
        self.vocab = dict(sorted(self._tok.get_vocab().items(), key=lambda item: item[1]))
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.vocab_size = len(self.vocab)
        # megatron-core's datasets hash this into their cache key.
        self.unique_identifiers = {"class": tokenizer_type, "vocab_size": self.vocab_size,
                                   "vocab_file": str(vocab_file), "merge_file": str(merge_file)}

    def _id(self, token: str) -> int:
        if token not in self.vocab:
            raise ValueError(f"{self.tokenizer_type} vocabulary has no {token!r} token")
        return self.vocab[token]

    @property
    def eod(self) -> int:
        return self._id(EOD_TOKEN) if self.tokenizer_type == "GPT2BPETokenizer" else self._id("[SEP]")

    @property
    def cls(self) -> int:
        return self._id("[CLS]")

    @property
    def sep(self) -> int:
        return self._id("[SEP]")

    @property
    def mask(self) -> int:
        return self._id("[MASK]")

    @property
    def pad(self) -> int:
        return self._id("[PAD]") if "[PAD]" in self.vocab else self.eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


class HuggingFaceTokenizer:
    """A tokenizer that transformers saved to a local folder (`save_pretrained`), with the
    attributes megatron-core's datasets read; it is never looked up on a hub."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--tokenizer-model {folder}: no tokenizer transformers can read ({exc})") from None
        if self._tok.eos_token_id is None:
            raise ValueError(f"--tokenizer-model {folder}: the tokenizer has no end-of-sequence token for EOD")
        self.vocab = dict(sorted(self._tok.get_vocab().items(), key=lambda item: item[1]))
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.vocab_size = len(self._tok)
        self.unique_identifiers = {"class": "HuggingFaceTokenizer", "vocab_size": self.vocab_size,
                                   "tokenizer_model": str(folder)}

    def _special(self, name: str) -> int:
        token_id = getattr(self._tok, f"{name}_token_id")
        if token_id is None:
            raise ValueError(f"the HuggingFace tokenizer has no {name} token")
        return token_id

    @property
    def eod(self) -> int:
        return self._tok.eos_token_id

    @property
    def cls(self) -> int:
        return self._special("cls")

    @property
    def sep(self) -> int:
        return self._special("sep")

    @property
    def mask(self) -> int:
        return self._special("mask")

    @property
    def pad(self) -> int:
        return self.eod if self._tok.pad_token_id is None else self._tok.pad_token_id

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


def train_tokenizer(tokenizer_type: str, texts: Iterable[str], vocab_size: int,
                    vocab_file: str, merge_file: str | None = None) -> None:
    """Train vocab (and merge) files of the given type on local text."""
    Path(vocab_file).parent.mkdir(parents=True, exist_ok=True)
    if tokenizer_type == "GPT2BPETokenizer":
        if merge_file is None:
            raise ValueError("GPT2BPETokenizer needs --merge-file")
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False)
        vocab_json, merges_txt = tok.save_model(str(Path(vocab_file).parent), "tmp-parcae")
        Path(vocab_json).replace(vocab_file)
        Path(merges_txt).replace(merge_file)
    else:
        tok = BertWordPieceTokenizer(lowercase=tokenizer_type.endswith("LowerCase"))
        tok.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=list(BERT_SPECIAL_TOKENS),
                                show_progress=False)
        (vocab_txt,) = tok.save_model(str(Path(vocab_file).parent), "tmp-parcae")
        Path(vocab_txt).replace(vocab_file)
