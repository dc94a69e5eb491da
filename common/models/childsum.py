"""Child-Sum TreeLSTM (Tai et al. 2015): any number of children per node, one cell type for all.

For node j with word vector x_j (zero for a node without a word) and children k = 1..K:

    h̃    = Σ_k h_k
    i    = σ(W_i x + U_i h̃ + b_i)      o = σ(W_o x + U_o h̃ + b_o)      u = tanh(W_u x + U_u h̃ + b_u)
    f_k  = σ(W_f x + U_f h_k + b_f)    one forget gate per child
    c    = i⊙u + Σ_k f_k⊙c_k           h = o⊙tanh(c)

Only the sums depend on K, so nodes of every arity share the cell type `node` (the point
of the JIT dynamic batching paper's section 3): its children's h and c come in on two
ragged input ports, which the worker hands the cell as the children's rows flattened
over the batch plus, per row, the batch row (node) it belongs to. The sums are then
index_add over those segments, and a leaf is a node with no rows. Every node of a tree
is in one subgraph, and nodes of any arity that are ready at the same time share tasks.

Weights file keys (H = hidden_size, E = embedding_size, V = vocab_size):

* `embedding.weight` [V, E]
* `W.weight` [4H, E], `W.bias` [4H]: the rows of gates i, o, u, f (in that order) from x
* `U_iou.weight` [3H, H]: the rows of gates i, o, u from h̃ (no bias: W.bias holds it)
* `U_f.weight` [H, H]: the forget gate from each child's h_k (no bias)
* `classifier.weight` [num_classes, H], `classifier.bias` [num_classes], when num_classes > 0

This module is the planner. In common/models/childsum_cells.py, ChildSumCell is the cell
`torch_nn_cells` returns (and a training script would train); workers serve ChildSumKernel (common/models/kernels.py),
whose word projection is a folded table with a first row for "no word" (the bias alone).
"""

from __future__ import annotations

import numpy as np

from batchmaker.common.config import ModelConfig
from batchmaker.common.graph import CellGraph, NodeOutput, Ragged
from batchmaker.common.models.base import Model, model_named
from batchmaker.common.models.tree import TOKEN, CellPorts, Tree, TreePlanner
from batchmaker.common.plan import ZERO_REF, external_ref


class ChildSumPlanner(TreePlanner):
    kind = "childsum"

    def tree_cells(self) -> list[CellPorts]:
        state = self.state_kind
        return [("node", (TOKEN, state, state), (state, state), frozenset({1, 2}))]

    def add_tree_node(self, graph: CellGraph, token: int, children: list[int]) -> int:
        h = Ragged(tuple(NodeOutput(child, 0) for child in children))
        c = Ragged(tuple(NodeOutput(child, 1) for child in children))
        return graph.add_node(self.keys["node"], graph.add_external(np.int64(token)), h, c)

    def plan_inputs(self, tree: Tree, order: np.ndarray, position: np.ndarray):
        count = len(order)
        inputs = np.full((count, 3), ZERO_REF, np.int32)
        inputs[:, 0] = external_ref(np.arange(count))
        kids = [tree.children[node] for node in order.tolist()]
        ragged_count = np.array([len(k) for k in kids] + [0] * bool(self.num_classes), np.int32)  # the classifier: none
        ragged_start = (np.cumsum(ragged_count) - ragged_count).astype(np.int32)
        flat = 2 * position[np.array([child for k in kids for child in k], np.int64)]
        refs = np.full((len(flat), 3), ZERO_REF, np.int32)
        refs[:, 1], refs[:, 2] = flat, flat + 1
        lanes = [(self.keys["node"], count)]
        return lanes, inputs, (ragged_start, ragged_count, refs), np.array(tree.tokens, np.int64)[order]


def planner(config: ModelConfig) -> ChildSumPlanner:
    return ChildSumPlanner(config)


def build(config: ModelConfig) -> Model:
    return model_named("batchmaker.common.models.childsum_cells:ChildSumTreeLSTMModel", config)
