"""`--dataset text`: a character-level corpus that needs no download, pinned by its hash.

The text is the English documentation that ships inside CPython itself (`pydoc_data.topics`: the
language reference's topics, what `help("if")` prints), about 465k characters on Python 3.11,
joined in sorted topic order. Its sha256 is pinned (`SHA256`): another Python version's copy may
differ, and then `load` says so in one line rather than training on different data silently (the
run's config.json would not tell the difference).

Contract: `load(block)` returns the splits of token windows, (train, validation, test) pairs and
the vocabulary size (psgd/train/data.py wraps them in its Dataset): x (N, block) int64
character ids, y the same shifted by one (next-character targets), from non-overlapping windows.
Split by position, never shuffled across it (neighbouring windows share context): the first 80%
of the text trains, the next 10% validates, the last 10% tests. `vocab` is the sorted set of the
text's characters (`num_classes`). `unigram_loss()` is the cross-entropy of predicting every
character by its training-set frequency: the floor a model that learned nothing beats.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter

import torch

SHA256 = "37d06970fc926e60"  # first 16 hex digits of sha256 of the joined text on CPython 3.11
BLOCK = 64                   # tokens per window (the GPT's context)
VOCAB = 103                  # distinct characters of the pinned corpus (a shard sizes the GPT from it)
TRAIN, VAL = 0.8, 0.1        # fractions of the text, by position; the rest tests


def corpus() -> str:
    import pydoc_data.topics as topics  # noqa: PLC0415 - part of the standard library

    text = "".join(topics.topics[k] for k in sorted(topics.topics))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    if digest != SHA256:
        raise ValueError(f"--dataset text: this Python's pydoc_data.topics has sha256 {digest}..., psgd pins "
                         f"{SHA256}... (CPython 3.11): the corpus differs, so results would not compare")
    return text


def windows(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = (len(ids) - 1) // block
    x = ids[:n * block].view(n, block)
    y = ids[1:n * block + 1].view(n, block)
    return x.contiguous(), y.contiguous()


def load(block: int = BLOCK) -> tuple:
    text = corpus()
    vocab = sorted(set(text))
    assert len(vocab) == VOCAB, f"the pinned corpus has {VOCAB} characters, this one {len(vocab)}"
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
    a, b = int(len(ids) * TRAIN), int(len(ids) * (TRAIN + VAL))
    train, val, test = (windows(part, block) for part in (ids[:a], ids[a:b], ids[b:]))
    return train, val, test, len(vocab)


def unigram_loss() -> float:
    """Cross-entropy (nats per character) of the training part's character frequencies on the test part."""
    text = corpus()
    a, b = int(len(text) * TRAIN), int(len(text) * (TRAIN + VAL))
    counts = Counter(text[:a])
    total = sum(counts.values())
    test = text[b:]
    return -sum(math.log(max(counts.get(c, 0), 1) / total) for c in test) / len(test)
