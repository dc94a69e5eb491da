"""Random trees for checks and tests: binary trees for the binary TreeLSTM, any trees for Child-Sum."""

from __future__ import annotations

import numpy as np

from batchmaker.common.models.tree import NO_WORD


def binary_tree(rng: np.random.Generator, leaves: int, vocab_size: int) -> dict:
    """Words on the leaves, none on internal nodes, pairs of neighbours joined at random."""
    tokens = [int(t) for t in rng.integers(vocab_size, size=leaves)]
    parents = [-1] * leaves
    roots = list(range(leaves))
    while len(roots) > 1:
        at = int(rng.integers(len(roots) - 1))
        parent = len(tokens)
        tokens.append(NO_WORD)
        parents.append(-1)
        for child in roots[at : at + 2]:
            parents[child] = parent
        roots[at : at + 2] = [parent]
    return {"tokens": tokens, "parents": parents}


def random_tree(rng: np.random.Generator, nodes: int, vocab_size: int, max_children: int = 9) -> dict:
    """A Child-Sum tree: 0..max_children children a node, numbered in a shuffled order, words anywhere."""
    children: list[list[int]] = [[]]
    frontier = [0]
    while len(children) < nodes and frontier:
        parent = frontier.pop(int(rng.integers(len(frontier))))
        for _ in range(min(int(rng.integers(1, max_children + 1)), nodes - len(children))):
            children[parent].append(len(children))
            frontier.append(len(children))
            children.append([])
    label = rng.permutation(len(children))
    tokens, parents = [0] * len(children), [-1] * len(children)
    for node, kids in enumerate(children):
        word = int(rng.integers(vocab_size))
        tokens[label[node]] = word if not kids or rng.random() < 0.5 else NO_WORD
        for kid in kids:
            parents[label[kid]] = int(label[node])
    return {"tokens": tokens, "parents": parents}
