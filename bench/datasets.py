"""Request inputs for the benchmarks, all deterministic and built from the bundled data.

* `wmt`: the bundled English sentences (data/wmt16-ende), tokenized: lengths 1-50, mean 22.5.
* `fixed`: every request 24 tokens long (the mean length of the paper's WMT-15 set).
* `longtail`: lengths shaped like the paper's Figure 10 (WMT-15 Europarl): mostly the
  bundled sentences' lengths, plus a 3% tail running out to 330 tokens, so that about
  99% are shorter than 100 and the mean is about 25.
* `sst`: the Stanford Sentiment Treebank trees (data/sst, train and dev).
* `tree16`: one complete binary tree with 16 leaves, the same for every request.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from batchmaker.clients.text import Vocabulary, load_sentences
from batchmaker.common.models.sst import load_vocabulary, ptb_to_tree

SST_DIR = Path(__file__).resolve().parents[1] / "data" / "sst"
FIXED_LENGTH = 24
LONGEST = 330
TAIL_SHARE = 0.03
SEED = 2018


def _sentences() -> list[list[int]]:
    vocabulary = Vocabulary()
    return [ids for ids in (vocabulary.encode(s) for s in load_sentences()) if ids]


def wmt() -> list[dict[str, Any]]:
    return [{"tokens": ids} for ids in _sentences()]


def _stream(sentences: list[list[int]], length: int, start: int) -> list[int]:
    """`length` tokens of running text, starting at sentence `start`."""
    tokens: list[int] = []
    index = start
    while len(tokens) < length:
        tokens.extend(sentences[index % len(sentences)])
        index += 1
    return tokens[:length]


def fixed() -> list[dict[str, Any]]:
    sentences = _sentences()
    return [{"tokens": _stream(sentences, FIXED_LENGTH, i)} for i in range(len(sentences))]


def longtail() -> list[dict[str, Any]]:
    sentences = _sentences()
    rng = np.random.default_rng(SEED)
    lengths = [len(s) for s in sentences]
    tail = rng.random(len(sentences)) < TAIL_SHARE
    # Tail lengths from 51 to 330, dense near 50 and thinning out towards 330 (u**4).
    tail_lengths = 51 + np.floor((LONGEST - 50) * rng.random(len(sentences)) ** 4).astype(int)
    lengths = np.where(tail, tail_lengths, lengths)
    lengths[int(np.argmax(tail))] = LONGEST  # the longest request of Figure 10 is present
    return [{"tokens": _stream(sentences, int(n), i)} for i, n in enumerate(lengths)]


def sst() -> list[dict[str, Any]]:
    vocabulary = load_vocabulary(SST_DIR / "vocab.txt")
    requests = []
    for line in (SST_DIR / "train.txt").read_text(encoding="utf-8").splitlines():
        if line.strip():
            tokens, parents, _ = ptb_to_tree(line, vocabulary)
            requests.append({"tree": {"tokens": tokens, "parents": parents}})
    return requests


def tree16() -> list[dict[str, Any]]:
    """A complete binary tree in heap order: nodes 15..30 are the 16 leaves."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, 31)]
    tokens = [-1] * 15 + [4 + i for i in range(16)]
    return [{"tree": {"tokens": tokens, "parents": parents}}]


DATASETS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "wmt": wmt,
    "fixed": fixed,
    "longtail": longtail,
    "sst": sst,
    "tree16": tree16,
}
