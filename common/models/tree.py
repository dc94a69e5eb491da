"""What the binary and the Child-Sum TreeLSTM share: tree requests and the model skeleton.

A request's `tree` is `{"tokens": [...], "parents": [...]}`: node i carries word id
`tokens[i]` (-1 for an internal node without a word) and hangs below `parents[i]`
(-1 for the root). Children are ordered by node index, so in a binary tree the left
child is the one with the smaller index, as `ptb_to_tree` (common/models/sst.py) numbers them.

Both models unfold a tree in the same order (level by level, children before parents,
see `Tree.levels`) and may put a `classifier` cell (h -> logits) on the root. This module is
their planner (numpy); their cells are in common/models/tree_cells.py.

Cell priorities: the cell types a model lists later run later in every request
(internal after leaf, the classifier last), and preferring them lets requests finish
sooner (paper section 4.3). So a cell type without its own `[models.NAME.cells.CELL]`
table gets the model's priority plus its rank (leaf 0, internal 1, classifier 2). A
cell table sets the priority exactly: a config that tunes one cell type should give
internal a higher priority than leaf, and the classifier a higher one still.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import abstractmethod
from typing import Any

import numpy as np

from batchmaker.common.config import ModelConfig
from batchmaker.common.graph import CellGraph, CellTypeSpec, NodeOutput, ValueKind
from batchmaker.common.models.base import FOLD_KEY, Planner, check_params, int_param
from batchmaker.common.plan import ZERO_REF, Unfolded, plan_of
from batchmaker.common.protocol import BAD_REQUEST, INVALID_INPUT, RequestError, is_tensor_map, map_to_tensor

TOKEN = ValueKind("int64", ())
NO_WORD = -1  # the token of an internal node without a word
CLASSIFIER = "classifier"


# -- requests ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tree:
    """A validated tree.

    `children[i]` lists node i's children by index (the left child first). `levels[k]`
    lists the nodes of height k (leaves have height 0, a parent is one above its highest
    child), by index: every node's children sit on lower levels, so the levels in turn
    are a topological order, and the nodes of one level can be computed together.
    """

    tokens: list[int]
    parents: list[int]
    children: list[list[int]]
    levels: list[list[int]]
    root: int

    @functools.cached_property
    def order(self) -> list[int]:
        """Every node, children before parents."""
        return [node for level in self.levels for node in level]


def _int_list(tree: dict[str, Any], key: str, max_nodes: int) -> list[int]:
    """A plain list of ints or a 1-D integer tensor map, as a list of Python ints; its length is
    checked before its entries, so that refusing a long one costs nothing."""
    if key not in tree:
        raise RequestError(INVALID_INPUT, f"tree lacks {key!r}; send tokens and parents, one entry per node")
    raw = tree[key]
    if is_tensor_map(raw):
        array = map_to_tensor(raw, f"tree.{key}", rank=1)
        if array.dtype.kind not in "iu":
            got = f"{array.dtype}{list(array.shape)}"
            raise RequestError(INVALID_INPUT, f"tree.{key} must be a 1-D integer tensor, got {got}")
        _check_size(len(array), max_nodes)
        return array.tolist()
    if not isinstance(raw, list):
        raise RequestError(INVALID_INPUT, f"tree.{key} must be a list of integers")
    _check_size(len(raw), max_nodes)
    if not set(map(type, raw)) <= {int}:  # bool is not an int here
        raise RequestError(INVALID_INPUT, f"tree.{key} must be a list of integers")
    return raw


def _check_size(nodes: int, max_nodes: int) -> None:
    if nodes > max_nodes:
        raise RequestError(INVALID_INPUT, f"tree has {nodes} nodes; this model accepts at most {max_nodes}")


def _read(inputs: Any, vocab_size: int, max_nodes: int) -> tuple[list[int], list[int]]:
    """tokens and parents, checked entry by entry: types, lengths, the vocabulary."""
    if not isinstance(inputs, dict):
        raise RequestError(BAD_REQUEST, "inputs must be a map")
    if "tree" not in inputs:
        raise RequestError(BAD_REQUEST, "inputs lack 'tree'")
    raw = inputs["tree"]
    if not isinstance(raw, dict):
        raise RequestError(INVALID_INPUT, 'tree must be a map {"tokens": [...], "parents": [...]}')
    tokens, parents = _int_list(raw, "tokens", max_nodes), _int_list(raw, "parents", max_nodes)
    n = len(tokens)
    if n == 0:
        raise RequestError(INVALID_INPUT, "tree is empty; send at least one node")
    if len(parents) != n:
        raise RequestError(
            INVALID_INPUT, f"tree.tokens has {n} entries but tree.parents has {len(parents)}; give one parent per node"
        )
    if min(tokens) < NO_WORD or max(tokens) >= vocab_size:  # find the culprit only when there is one
        i = next(i for i, token in enumerate(tokens) if not NO_WORD <= token < vocab_size)
        token = tokens[i]
        raise RequestError(
            INVALID_INPUT,
            f"tree.tokens[{i}] = {token} is outside the vocabulary; valid ids are 0..{vocab_size - 1}, "
            f"or -1 for an internal node without a word",
        )
    if min(parents) < -1 or max(parents) >= n:
        i = next(i for i, parent in enumerate(parents) if not -1 <= parent < n)
        raise RequestError(
            INVALID_INPUT, f"tree.parents[{i}] = {parents[i]} is not a node; use 0..{n - 1}, or -1 for the root"
        )
    return tokens, parents


def _cycle_through(parents: list[int], start: int) -> list[int]:
    """The cycle that following parents from `start` runs into (start is not connected to the root)."""
    seen: dict[int, int] = {}
    path: list[int] = []
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = parents[node]
    return path[seen[node] :] + [node]


def _top_down(parents: list[int]) -> tuple[list[list[int]], list[int]]:
    """Children lists, and every node in parents-before-children order from the one root."""
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for i, parent in enumerate(parents):
        if parent == -1:
            roots.append(i)
        else:
            children[parent].append(i)
    if not roots:
        raise RequestError(INVALID_INPUT, "tree has no root; give the root parent -1")
    if len(roots) > 1:
        raise RequestError(
            INVALID_INPUT, f"tree has {len(roots)} roots (nodes {roots[0]} and {roots[1]} have parent -1); it needs one"
        )
    # Every node has one parent, so a walk down from the root meets each node at most once;
    # a node it misses leads up into a cycle instead of to the root.
    reached = [roots[0]]
    for node in reached:
        reached.extend(children[node])
    if len(reached) < len(parents):
        missed = min(set(range(len(parents))) - set(reached))
        cycle = " -> ".join(map(str, _cycle_through(parents, missed)))
        raise RequestError(
            INVALID_INPUT, f"tree is not a tree: tree.parents form a cycle ({cycle}) that does not reach the root"
        )
    return children, reached


def _check_nodes(tokens: list[int], children: list[list[int]], binary: bool) -> None:
    for i, kids in enumerate(children):
        if not kids and tokens[i] == NO_WORD:
            raise RequestError(INVALID_INPUT, f"node {i} is a leaf without a word (tree.tokens[{i}] = -1)")
        if binary and kids and len(kids) != 2:
            raise RequestError(
                INVALID_INPUT, f"node {i} has {len(kids)} child(ren); a binary tree needs exactly 2 per internal node"
            )
        if binary and kids and tokens[i] != NO_WORD:
            raise RequestError(
                INVALID_INPUT,
                f"node {i} is internal but has word {tokens[i]}; the binary TreeLSTM reads words at leaves only "
                f"(send -1)",
            )


def parse_tree(inputs: Any, vocab_size: int, max_nodes: int, binary: bool) -> Tree:
    """Validate a request's `tree` and return its structure.

    `binary` asks for the binary TreeLSTM's trees: exactly two children per internal
    node, and words at the leaves only (its internal cell has no word input, so a word
    there would be silently ignored).
    """
    tokens, parents = _read(inputs, vocab_size, max_nodes)
    children, top_down = _top_down(parents)
    # One pass from the leaves up computes heights and checks every node; a tree that fails a
    # check is reported by _check_nodes, which names the first bad node by index.
    height = [0] * len(tokens)
    for node in reversed(top_down):
        kids = children[node]
        if not kids:
            if tokens[node] == NO_WORD:
                _check_nodes(tokens, children, binary)
        elif binary and (len(kids) != 2 or tokens[node] != NO_WORD):
            _check_nodes(tokens, children, binary)
        else:
            height[node] = 1 + max(map(height.__getitem__, kids))
    root = top_down[0]
    levels: list[list[int]] = [[] for _ in range(height[root] + 1)]
    for node, node_height in enumerate(height):
        levels[node_height].append(node)
    return Tree(tokens, parents, children, levels, root)


# -- the planner ---------------------------------------------------------------------------------


CellPorts = tuple[str, tuple[ValueKind, ...], tuple[ValueKind, ...], frozenset[int]]


class TreePlanner(Planner):
    """A TreeLSTM's planning: the tree cells a subclass defines, and an optional root classifier.

    Params: vocab_size, hidden_size, embedding_size (default hidden_size), num_classes
    (default 0: no classifier; else `logits` float32[num_classes] of the root is returned
    too), max_nodes (default 1000).
    """

    binary = False  # parse_tree's `binary`

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        params = config.params
        allowed = {"vocab_size", "embedding_size", "hidden_size", "num_classes", "max_nodes", FOLD_KEY}
        check_params(params, allowed, self.name)
        self.vocab_size = int_param(params, "vocab_size", self.name)
        self.hidden_size = int_param(params, "hidden_size", self.name)
        self.embedding_size = int_param(params, "embedding_size", self.name, default=self.hidden_size)
        self.num_classes = int_param(params, "num_classes", self.name, default=0, minimum=0)
        self.max_nodes = int_param(params, "max_nodes", self.name, default=1000)
        self.state_kind = ValueKind("float32", (self.hidden_size,))
        cells = self.tree_cells()
        if self.num_classes:
            cells.append((CLASSIFIER, (self.state_kind,), (ValueKind("float32", (self.num_classes,)),), frozenset()))
        self.keys: dict[str, str] = {}
        self._cell_types: dict[str, CellTypeSpec] = {}
        for rank, (cell, inputs, outputs, ragged) in enumerate(cells):
            spec = self._cell_type(cell, inputs, outputs, ragged)
            if cell not in config.cells:
                spec = dataclasses.replace(spec, priority=spec.priority + rank)
            self.keys[cell] = spec.key
            self._cell_types[spec.key] = spec

    # -- what a subclass defines -------------------------------------------------------------
    @abstractmethod
    def tree_cells(self) -> list[CellPorts]:
        """(cell name, inputs, outputs, ragged input ports) of each tree cell, in the order they run."""

    @abstractmethod
    def add_tree_node(self, graph: CellGraph, token: int, children: list[int]) -> int:
        """Add one tree node whose children are the graph nodes `children`; return its graph node."""

    # -- the Planner interface -----------------------------------------------------------------
    @property
    def cell_types(self) -> dict[str, CellTypeSpec]:
        return self._cell_types

    def describe(self) -> dict[str, Any]:
        state = {"dtype": "float32", "shape": [self.hidden_size]}
        outputs = {"h": state, "c": state}
        if self.num_classes:
            outputs["logits"] = {"dtype": "float32", "shape": [self.num_classes]}
        ids = {"dtype": "int64", "shape": [-1]}
        return {
            "kind": self.kind,
            "inputs": {"tree": {"tokens": ids, "parents": ids, "max_nodes": self.max_nodes}},
            "outputs": outputs,
            "vocab_size": self.vocab_size,
        }

    def parse(self, inputs: Any) -> Tree:
        return parse_tree(inputs, self.vocab_size, self.max_nodes, self.binary)

    def unfold(self, inputs: Any) -> CellGraph:
        """One graph node per tree node, level by level, then the classifier on the root."""
        tree = self.parse(inputs)
        graph = CellGraph()
        node_of = [0] * len(tree.tokens)
        for i in tree.order:
            node_of[i] = self.add_tree_node(graph, tree.tokens[i], [node_of[k] for k in tree.children[i]])
        root = node_of[tree.root]
        graph.results = {"h": NodeOutput(root, 0), "c": NodeOutput(root, 1)}
        if self.num_classes:
            graph.results["logits"] = NodeOutput(graph.add_node(self.keys[CLASSIFIER], NodeOutput(root, 0)), 0)
        return graph

    def plan(self, inputs: Any) -> Unfolded:
        """The plan `unfold` compiles to, built with numpy: trees differ in shape, so plans are not
        reused, and building one must cost little more than reading the tree.

        Nodes run level by level (plan order is `tree.order`, then the classifier); a node's h and
        c take registers 2i and 2i+1 of its position i, the classifier's logits the one after."""
        tree = self.parse(inputs)
        order = np.array(tree.order, np.int64)
        count = len(order)
        position = np.empty(count, np.int64)
        position[order] = np.arange(count)
        heights = np.repeat(np.arange(len(tree.levels)), list(map(len, tree.levels)))
        lanes, inputs_of, ragged, externals = self.plan_inputs(tree, order, position)
        classes = bool(self.num_classes)
        total = count + classes
        depth = np.append(heights, heights[-1] + 1) if classes else heights
        ports = max(len(spec.inputs) for spec in self._cell_types.values())
        node_inputs = np.full((total, ports), ZERO_REF, np.int32)
        node_inputs[:count, : inputs_of.shape[1]] = inputs_of
        outputs = np.zeros((total, 2), np.int32)
        outputs[:count, 0] = 2 * np.arange(count)
        outputs[:count, 1] = outputs[:count, 0] + 1
        root = count - 1  # the root is the one node of the top level
        copies: dict[int, tuple[tuple[str | int, int], ...]] = {root: (("h", 0), ("c", 1))}
        registers = {self.state_kind: np.arange(2 * count)}
        if classes:
            node_inputs[count, 0] = 2 * root
            outputs[count, 0] = 2 * count
            copies[count] = (("logits", 0),)
            registers[self._cell_types[self.keys[CLASSIFIER]].outputs[0]] = np.array([2 * count])
            lanes.append((self.keys[CLASSIFIER], total))
        results = ("h", "c", "logits") if classes else ("h", "c")
        return Unfolded(
            plan_of(lanes, depth, node_inputs, outputs, ragged, registers, copies, results), {TOKEN: externals}
        )

    @abstractmethod
    def plan_inputs(
        self, tree: Tree, order: np.ndarray, position: np.ndarray
    ) -> tuple[list[tuple[str, int]], np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None, np.ndarray]:
        """For `plan`: the tree cells' lanes as (cell key, end position), every node's inputs in plan
        order (registers of children as 2 * position and 2 * position + 1, external token ids as
        external references numbered in plan order), ragged inputs (start, count, refs) if any, for every
        node of the plan (the classifier, last, reads none), and the external token ids."""
