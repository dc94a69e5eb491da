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

The cells above are the ones `scripts/train_sst.py` trains; workers serve the kernels
below them (common/models/kernels.py): a leaf is a row of its folded table and the gate
nonlinearities, an internal node two recurrent products and one sigmoid over its gates.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common.config import ModelConfig
from common.graph import CellGraph, NodeOutput
from common.models.kernels import doubled, stored, table_bytes, token_projection, tree_state
from common.models.tree import TOKEN, CellPorts, Tree, TreeModel, gate_blocks, lstm_state
from common.plan import ZERO_REF, external_ref

LEAF_GATES = ("i", "o", "u")
INTERNAL_GATES = ("i", "f_l", "f_r", "o", "u")


class LeafCell(nn.Module):
    """token -> (h, c) of a node without children."""

    def __init__(self, embedding: nn.Embedding, gates: nn.Linear):
        super().__init__()
        self.embedding = embedding
        self.gates = gates

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u = self.gates(self.embedding(tokens)).chunk(3, dim=1)
        return lstm_state(i, o, u, 0.0)


class InternalCell(nn.Module):
    """(h_l, c_l, h_r, c_r) -> (h, c) of a node with two children and no word."""

    def __init__(self, gates: nn.Linear):
        super().__init__()
        self.gates = gates

    def forward(
        self, h_l: torch.Tensor, c_l: torch.Tensor, h_r: torch.Tensor, c_r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i, f_l, f_r, o, u = self.gates(torch.cat((h_l, h_r), dim=1)).chunk(5, dim=1)
        return lstm_state(i, o, u, torch.sigmoid(f_l) * c_l + torch.sigmoid(f_r) * c_r)


class LeafKernel(nn.Module):
    """Serving form of LeafCell: the gates i, o, u of a word are its projection (u doubled)."""

    def __init__(self, projection: nn.Module):
        super().__init__()
        self.projection = projection

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u = torch.sigmoid(self.projection(tokens)).chunk(3, dim=1)
        return tree_state(i, o, u, None)


class InternalKernel(nn.Module):
    """Serving form of InternalCell: U [h_l, h_r] as two products accumulated in place (no concatenation)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        weight = doubled(weight, len(INTERNAL_GATES), (INTERNAL_GATES.index("u"),))
        hidden = weight.shape[1] // 2
        self.register_buffer("left_t", stored(weight[:, :hidden].T))
        self.register_buffer("right_t", stored(weight[:, hidden:].T))
        self.register_buffer("bias", doubled(bias, len(INTERNAL_GATES), (INTERNAL_GATES.index("u"),)))

    def forward(
        self, h_l: torch.Tensor, c_l: torch.Tensor, h_r: torch.Tensor, c_r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gates = torch.addmm(self.bias, h_l, self.left_t).addmm_(h_r, self.right_t)
        i, f_l, f_r, o, u = torch.sigmoid(gates).chunk(5, dim=1)
        return tree_state(i, o, u, torch.addcmul(f_l * c_l, f_r, c_r))


class BinaryWeights(nn.Module):
    def __init__(self, vocab_size: int, embedding_size: int, hidden_size: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.leaf = nn.Linear(embedding_size, len(LEAF_GATES) * hidden_size)
        self.internal = nn.Linear(2 * hidden_size, len(INTERNAL_GATES) * hidden_size)


class TreeLSTMModel(TreeModel):
    kind = "treelstm"
    binary = True

    def tree_cells(self) -> list[CellPorts]:
        state = self.state_kind
        return [
            ("leaf", (TOKEN,), (state, state), frozenset()),
            ("internal", (state,) * 4, (state, state), frozenset()),
        ]

    def tree_weights(self) -> nn.Module:
        return BinaryWeights(self.vocab_size, self.embedding_size, self.hidden_size)

    def tree_cell_modules(self, weights: nn.Module) -> dict[str, nn.Module]:
        return {"leaf": LeafCell(weights.embedding, weights.leaf), "internal": InternalCell(weights.internal)}

    def tree_kernels(self, state: dict[str, torch.Tensor], fold: bool) -> dict[str, nn.Module]:
        u = (LEAF_GATES.index("u"),)
        weight, bias = doubled(state["leaf.weight"], 3, u), doubled(state["leaf.bias"], 3, u)
        return {
            "leaf": LeafKernel(token_projection(state["embedding.weight"], weight, bias, fold)),
            "internal": InternalKernel(state["internal.weight"], state["internal.bias"]),
        }

    def folded_bytes(self) -> int:
        return table_bytes(self.vocab_size, len(LEAF_GATES) * self.hidden_size)

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

    def reference_node(
        self, weights: dict[str, torch.Tensor], token: int, children: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sigmoid, tanh = torch.sigmoid, torch.tanh
        if not children:
            x = weights["embedding.weight"][token]
            W, b = gate_blocks(weights["leaf.weight"], LEAF_GATES), gate_blocks(weights["leaf.bias"], LEAF_GATES)
            i, o, u = (W[g] @ x + b[g] for g in LEAF_GATES)
            c = sigmoid(i) * tanh(u)
            return sigmoid(o) * tanh(c), c
        (h_l, c_l), (h_r, c_r) = children
        U = gate_blocks(weights["internal.weight"], INTERNAL_GATES)
        b = gate_blocks(weights["internal.bias"], INTERNAL_GATES)
        hidden = self.hidden_size
        i, f_l, f_r, o, u = (U[g][:, :hidden] @ h_l + U[g][:, hidden:] @ h_r + b[g] for g in INTERNAL_GATES)
        c = sigmoid(i) * tanh(u) + sigmoid(f_l) * c_l + sigmoid(f_r) * c_r
        return sigmoid(o) * tanh(c), c


def build(config: ModelConfig) -> TreeLSTMModel:
    return TreeLSTMModel(config)
