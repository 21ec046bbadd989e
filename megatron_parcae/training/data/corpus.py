"""A real English corpus that every Python installation carries: its own documentation.

The quick start, the tiny configs and the tests train on the reference-manual topics
of `pydoc_data` and the docstrings of the standard library: human-written text,
available offline, with no download. `prepare_tiny_datasets` builds the GPT and BERT
datasets the configs in configs/ point at.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from megatron_parcae.training.data.preprocess import preprocess
from megatron_parcae.training.data.tokenizer import Tokenizer, train_tokenizer

# Byte-level BPE for GPT, WordPiece for BERT, sized so that 50 iterations of the tiny
# models visibly learn: a small BPE vocabulary makes next-token statistics dense; a
# word-level WordPiece vocabulary makes masked-token statistics informative.
GPT_VOCAB_SIZE = 384
BERT_VOCAB_SIZE = 4096
MANIFEST = "parcae-tiny-data.json"


def python_docs() -> Iterator[str]:
    """Documents: reference-manual topics, then standard-library module docstrings."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name].strip()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if doc and len(doc) > 200:
            yield doc.strip()


def write_corpus(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for text in python_docs():
            f.write(json.dumps({"text": text}) + "\n")
    return path


def prepare_tiny_datasets(data_dir: str | Path = "data") -> dict[str, str]:
    """Build (once) the corpus, vocabularies and indexed datasets of the tiny configs."""
    data_dir = Path(data_dir)
    files = {
        "corpus": data_dir / "python-docs.jsonl",
        "gpt_vocab": data_dir / "gpt2-vocab.json",
        "gpt_merges": data_dir / "gpt2-merges.txt",
        "bert_vocab": data_dir / "bert-vocab.txt",
        "gpt_prefix": data_dir / "python-docs-gpt_text_document",
        "bert_prefix": data_dir / "python-docs-bert_text_sentence",
    }
    manifest = {"python": sys.version.split()[0], "gpt_vocab": GPT_VOCAB_SIZE, "bert_vocab": BERT_VOCAB_SIZE}
    try:
        if json.loads((data_dir / MANIFEST).read_text()) == manifest:
            return {k: str(v) for k, v in files.items()}
    except (OSError, ValueError):
        pass
    corpus = write_corpus(files["corpus"])
    texts = list(python_docs())
    train_tokenizer("GPT2BPETokenizer", texts, GPT_VOCAB_SIZE, str(files["gpt_vocab"]), str(files["gpt_merges"]))
    train_tokenizer("BertWordPieceLowerCase", texts, BERT_VOCAB_SIZE, str(files["bert_vocab"]))
    gpt = Tokenizer("GPT2BPETokenizer", str(files["gpt_vocab"]), str(files["gpt_merges"]))
    bert = Tokenizer("BertWordPieceLowerCase", str(files["bert_vocab"]))
    preprocess(str(corpus), str(data_dir / "python-docs-gpt"), gpt, append_eod=True)
    preprocess(str(corpus), str(data_dir / "python-docs-bert"), bert, split=True)
    (data_dir / MANIFEST).write_text(json.dumps(manifest))
    return {k: str(v) for k, v in files.items()}


if __name__ == "__main__":
    for key, value in prepare_tiny_datasets(sys.argv[1] if len(sys.argv) > 1 else "data").items():
        print(f"{key}: {value}")
