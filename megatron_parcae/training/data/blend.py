"""What `--data-path` and `--split` say, read as Megatron-LM reads them, with errors that
name the flag. Free of torch: arguments are checked before it loads.

`--data-path A B` blends whole datasets in proportion to their sizes (one pass over
each, as megatron-core does without weights); `--data-path 0.7 A 0.3 B` samples them in
proportion to the weights (normalized), as often as the training needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Blend:
    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None  # None: by dataset size


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(words: list[str]) -> Blend:
    """A list of prefixes, or of weight-prefix pairs when the first word is a number."""
    if _number(words[0]) is None:
        return Blend(tuple(words), None)
    if len(words) % 2:
        raise ValueError(f"--data-path: a weighted list needs a weight before every prefix, got {len(words)} words")
    weights = []
    for weight in words[0::2]:
        value = _number(weight)
        if value is None or not math.isfinite(value) or value <= 0:
            raise ValueError(f"--data-path: weight {weight!r} is not a positive number")
        weights.append(value)
    return Blend(tuple(words[1::2]), tuple(weights))


def parse_split(text: str) -> tuple[float, float, float]:
    """--split's train, validation and test shares (1 to 3 numbers, the rest 0), normalized."""
    parts = [part.strip() for part in text.split(",")]
    shares = [_number(part) for part in parts]
    if not 1 <= len(parts) <= 3 or any(s is None or not math.isfinite(s) or s < 0 for s in shares):
        raise ValueError("--split: expected up to 3 comma-separated numbers >= 0 (train,validation,test), "
                         f"got {text!r}")
    shares += [0.0] * (3 - len(shares))
    total = sum(shares)
    if shares[0] <= 0:
        raise ValueError(f"--split {text}: the training share must be positive")
    return shares[0] / total, shares[1] / total, shares[2] / total
