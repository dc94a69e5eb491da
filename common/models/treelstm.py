"""Binary TreeLSTM (Tai et al. 2015, the N-ary Tree-LSTM with N = 2) over constituency trees.

For node j with word vector x_j and left/right children (h_l, c_l), (h_r, c_r):

    i   = σ(W_i x + U_i^l h_l + U_i^r h_r + b_i)        o = σ(W_o x + U_o^l h_l + U_o^r h_r + b_o)
    f_l = σ(W_f x + U_fl^l h_l + U_fl^r h_r + b_fl)      u = tanh(W_u x + U_u^l h_l + U_u^r h_r + b_u)
    f_r = σ(W_f x + U_fr^l h_l + U_fr^r h_r + b_fr)
    c   = i⊙u + f_l⊙c_l + f_r⊙c_r                       h = o⊙tanh(c)

In a constituency tree words sit at the leaves only, so the equations split into two
cell types with their own weights, as in the paper's section 4.4: `leaf` (word -> h, c:
no children, so no U terms and no forget gates) and `internal` (h_l, c_l, h_r, c_r ->
h, c: no word, so no W terms). A tree's leaves are then single-node subgraphs, ready at
once, and its internal nodes form one subgraph that runs level by level after them.
Internal ranks above leaf in priority (see common/models/tree.py for how configs set it).

Weights file keys (H = hidden_size, E = embedding_size, V = vocab_size):

* `embedding.weight` [V, E]
* `leaf.weight` [3H, E], `leaf.bias` [3H]: the rows of gates i, o, u (in that order) from x
* `internal.weight` [5H, 2H], `internal.bias` [5H]: the rows of gates i, f_l, f_r, o, u from
  the concatenation [h_l, h_r] (columns 0..H-1 read h_l, H..2H-1 read h_r)
* `classifier.weight` [num_classes, H], `classifier.bias` [num_classes], when num_classes > 0:
  logits = classifier.weight @ h_root + classifier.bias

Trees must be binary: every internal node has exactly two children and no word.

This module is the planner; common/models/treelstm_cells.py holds the cells `scripts/train_sst.py`
trains and the kernels workers serve (common/models/kernels.py): a leaf is a row of its folded table and the gate
nonlinearities, an internal node two recurrent products and one sigmoid over its gates.
"""

from __future__ import annotations

import numpy as np

from batchmaker.common.config import ModelConfig
from batchmaker.common.graph import CellGraph, NodeOutput
from batchmaker.common.models.base import Model, model_named
from batchmaker.common.models.tree import TOKEN, CellPorts, Tree, TreePlanner
from batchmaker.common.plan import ZERO_REF, external_ref


class TreeLSTMPlanner(TreePlanner):
    kind = "treelstm"
    binary = True

    def tree_cells(self) -> list[CellPorts]:
        state = self.state_kind
        return [
            ("leaf", (TOKEN,), (state, state), frozenset()),
            ("internal", (state,) * 4, (state, state), frozenset()),
        ]

    def add_tree_node(self, graph: CellGraph, token: int, children: list[int]) -> int:
        if not children:
            return graph.add_node(self.keys["leaf"], graph.add_external(np.int64(token)))
        left, right = children
        return graph.add_node(
            self.keys["internal"], NodeOutput(left, 0), NodeOutput(left, 1), NodeOutput(right, 0), NodeOutput(right, 1)
        )

    def plan_inputs(self, tree: Tree, order: np.ndarray, position: np.ndarray):
        leaves = len(tree.levels[0])
        inputs = np.full((len(order), 4), ZERO_REF, np.int32)
        inputs[:leaves, 0] = external_ref(np.arange(leaves))
        children = np.array([tree.children[node] for node in tree.order[leaves:]], np.int64).reshape(-1, 2)
        registers = 2 * position[children]  # h of the left and right child; c is the register after each
        inputs[leaves:, 0::2] = registers
        inputs[leaves:, 1::2] = registers + 1
        lanes = [(self.keys["leaf"], leaves), (self.keys["internal"], len(order))]
        return lanes, inputs, None, np.array(tree.tokens, np.int64)[order[:leaves]]


def planner(config: ModelConfig) -> TreeLSTMPlanner:
    return TreeLSTMPlanner(config)


def build(config: ModelConfig) -> Model:
    return model_named("batchmaker.common.models.treelstm_cells:TreeLSTMModel", config)
