"""Stanford Sentiment Treebank trees: PTB bracketed lines read into the tokens/parents form the tree models take.

`load_vocabulary` reads a vocabulary file (data/sst/vocab.txt) and `ptb_to_tree` turns one
bracketed line into a request's `{"tokens", "parents"}` plus each node's label.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from batchmaker.common.models.tree import NO_WORD

UNK_ID = 0  # id of `<unk>` in a vocabulary file; ptb_to_tree maps unknown words to it
# A bracket, or a label or word: SST words may hold non-ASCII spaces (U+00A0 in "2 1/2"), so only ASCII ones split.
PTB_PIECE = re.compile(r"[()]|[^()\x20\t\r\n]+")


def load_vocabulary(path: Path) -> dict[str, int]:
    """A vocabulary file (one word a line, line number = id) as word -> id."""
    with Path(path).open(encoding="utf-8", newline="\n") as file:
        return {line.rstrip("\n"): index for index, line in enumerate(file)}


def ptb_to_tree(line: str, vocabulary: Mapping[str, int]) -> tuple[list[int], list[int], list[int]]:
    """Convert one PTB bracketed line, e.g. `(3 (2 It) (4 (2 's) (3 lovely)))`, to (tokens, parents, labels).

    Nodes are numbered in pre-order (the root is 0, a left subtree comes before the
    right one), so children are in index order. A `(label word)` node is a leaf with the
    word's id (UNK_ID for a word the vocabulary lacks); other nodes get NO_WORD. `labels`
    holds each node's label; the root's is the sentence's. Raises ValueError for a line
    that is not one well-formed tree.
    """
    pieces = PTB_PIECE.findall(line)
    tokens: list[int] = []
    parents: list[int] = []
    labels: list[int] = []
    has_children: list[bool] = []
    open_nodes: list[int] = []
    position = 0
    while position < len(pieces):
        piece = pieces[position]
        if piece == "(":
            if tokens and not open_nodes:
                raise ValueError(f"more than one tree on the line: {line!r}")
            if position + 1 >= len(pieces) or not pieces[position + 1].isdigit():
                raise ValueError(f"a node without a numeric label at piece {position}: {line!r}")
            parent = open_nodes[-1] if open_nodes else -1
            if parent != -1:
                if tokens[parent] != NO_WORD:
                    raise ValueError(f"node {parent} has both a word and children: {line!r}")
                has_children[parent] = True
            open_nodes.append(len(tokens))
            tokens.append(NO_WORD)
            parents.append(parent)
            labels.append(int(pieces[position + 1]))
            has_children.append(False)
            position += 2
            continue
        if not open_nodes:
            raise ValueError(f"unbalanced brackets or a word outside any node at piece {position}: {line!r}")
        node = open_nodes[-1]
        if piece == ")":
            if tokens[node] == NO_WORD and not has_children[node]:
                raise ValueError(f"node {node} has neither a word nor children: {line!r}")
            open_nodes.pop()
        elif tokens[node] != NO_WORD or has_children[node]:
            raise ValueError(f"node {node} holds {piece!r} besides other content: {line!r}")
        else:
            tokens[node] = vocabulary.get(piece, UNK_ID)
        position += 1
    if open_nodes or not tokens:
        raise ValueError(f"unbalanced brackets or no tree: {line!r}")
    return tokens, parents, labels
