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

ChildSumCell is the cell `torch_nn_cells` returns (and a training script would train);
workers serve ChildSumKernel (common/models/kernels.py), whose word projection is a folded
table with a first row for "no word" (the bias alone).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common.config import ModelConfig
from common.graph import CellGraph, NodeOutput, Ragged
from common.models.kernels import doubled, stored, table_bytes, token_projection, tree_state
from common.models.tree import NO_WORD, TOKEN, CellPorts, Tree, TreeModel, gate_blocks, lstm_state
from common.plan import ZERO_REF, external_ref

GATES = ("i", "o", "u", "f")


class ChildSumCell(nn.Module):
    """(token, children's h, their rows' nodes, children's c, their rows' nodes) -> (h, c).

    The unfold lists a node's children in the same order on both ragged ports, so the
    flat h and c rows line up one for one and one segment index serves both.
    """

    def __init__(self, embedding: nn.Embedding, W: nn.Linear, U_iou: nn.Linear, U_f: nn.Linear):
        super().__init__()
        self.embedding = embedding
        self.W = W
        self.U_iou = U_iou
        self.U_f = U_f

    def forward(
        self,
        tokens: torch.Tensor,
        child_h: torch.Tensor,
        child_node: torch.Tensor,
        child_c: torch.Tensor,
        _child_c_node: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        has_word = (tokens != NO_WORD).unsqueeze(1)
        x = self.embedding(tokens.clamp(min=0)) * has_word
        wx = self.W(x)
        hidden = child_h.shape[1]
        batch = tokens.shape[0]
        h_sum = child_h.new_zeros(batch, hidden).index_add_(0, child_node, child_h)
        i, o, u = (wx[:, : 3 * hidden] + self.U_iou(h_sum)).chunk(3, dim=1)
        f = torch.sigmoid(wx[:, 3 * hidden :].index_select(0, child_node) + self.U_f(child_h))
        carried = child_c.new_zeros(batch, hidden).index_add_(0, child_node, f * child_c)
        return lstm_state(i, o, u, carried)


class ChildSumKernel(nn.Module):
    """Serving form of ChildSumCell: the word projection is a table indexed by token + 1 (row 0: no
    word), and the sums feed products accumulated onto it."""

    def __init__(self, projection: nn.Module, U_iou: torch.Tensor, U_f: torch.Tensor):
        super().__init__()
        self.projection = projection
        self.register_buffer("iou_t", stored(doubled(U_iou, 3, (GATES.index("u"),)).T))
        self.register_buffer("f_t", stored(U_f.T))

    def forward(
        self,
        tokens: torch.Tensor,
        child_h: torch.Tensor,
        child_node: torch.Tensor,
        child_c: torch.Tensor,
        _child_c_node: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        wx = self.projection(tokens + 1)
        hidden = child_h.shape[1]
        batch = tokens.shape[0]
        h_sum = child_h.new_zeros(batch, hidden).index_add_(0, child_node, child_h)
        i, o, u = torch.sigmoid(torch.addmm(wx[:, : 3 * hidden], h_sum, self.iou_t)).chunk(3, dim=1)
        f = torch.sigmoid(torch.addmm(wx[:, 3 * hidden :].index_select(0, child_node), child_h, self.f_t))
        carried = child_c.new_zeros(batch, hidden).index_add_(0, child_node, f * child_c)
        return tree_state(i, o, u, carried)


class ChildSumWeights(nn.Module):
    def __init__(self, vocab_size: int, embedding_size: int, hidden_size: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.W = nn.Linear(embedding_size, len(GATES) * hidden_size)
        self.U_iou = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.U_f = nn.Linear(hidden_size, hidden_size, bias=False)


class ChildSumTreeLSTMModel(TreeModel):
    kind = "childsum"

    def tree_cells(self) -> list[CellPorts]:
        state = self.state_kind
        return [("node", (TOKEN, state, state), (state, state), frozenset({1, 2}))]

    def tree_weights(self) -> nn.Module:
        return ChildSumWeights(self.vocab_size, self.embedding_size, self.hidden_size)

    def tree_cell_modules(self, weights: nn.Module) -> dict[str, nn.Module]:
        return {"node": ChildSumCell(weights.embedding, weights.W, weights.U_iou, weights.U_f)}

    def tree_kernels(self, state: dict[str, torch.Tensor], fold: bool) -> dict[str, nn.Module]:
        embedding = state["embedding.weight"]
        words = torch.cat((embedding.new_zeros(1, embedding.shape[1]), embedding))  # row 0: no word
        u = (GATES.index("u"),)
        projection = token_projection(words, doubled(state["W.weight"], 4, u), doubled(state["W.bias"], 4, u), fold)
        return {"node": ChildSumKernel(projection, state["U_iou.weight"], state["U_f.weight"])}

    def folded_bytes(self) -> int:
        return table_bytes(self.vocab_size + 1, len(GATES) * self.hidden_size)

    def add_tree_node(self, graph: CellGraph, token: int, children: list[int]) -> int:
        h = Ragged(tuple(NodeOutput(child, 0) for child in children))
        c = Ragged(tuple(NodeOutput(child, 1) for child in children))
        return graph.add_node(self.keys["node"], graph.add_external(np.int64(token)), h, c)

    def plan_inputs(self, tree: Tree, order: np.ndarray, position: np.ndarray):
        count = len(order)
        inputs = np.full((count, 3), ZERO_REF, np.int32)
        inputs[:, 0] = external_ref(np.arange(count))
        kids = [tree.children[node] for node in order.tolist()]
        ragged_count = np.array([len(k) for k in kids], np.int32)
        ragged_start = (np.cumsum(ragged_count) - ragged_count).astype(np.int32)
        flat = 2 * position[np.array([child for k in kids for child in k], np.int64)]
        refs = np.full((len(flat), 3), ZERO_REF, np.int32)
        refs[:, 1], refs[:, 2] = flat, flat + 1
        lanes = [(self.keys["node"], count)]
        return lanes, inputs, (ragged_start, ragged_count, refs), np.array(tree.tokens, np.int64)[order]

    def reference_node(
        self, weights: dict[str, torch.Tensor], token: int, children: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sigmoid, tanh = torch.sigmoid, torch.tanh
        embedding = weights["embedding.weight"]
        x = embedding[token] if token != NO_WORD else embedding.new_zeros(embedding.shape[1])
        W, b = gate_blocks(weights["W.weight"], GATES), gate_blocks(weights["W.bias"], GATES)
        U = gate_blocks(weights["U_iou.weight"], GATES[:3])
        h_tilde = sum((h_k for h_k, _ in children), torch.zeros(self.hidden_size, dtype=x.dtype))
        i, o, u = (W[g] @ x + U[g] @ h_tilde + b[g] for g in ("i", "o", "u"))
        c = sigmoid(i) * tanh(u)
        for h_k, c_k in children:
            f_k = sigmoid(W["f"] @ x + weights["U_f.weight"] @ h_k + b["f"])
            c = c + f_k * c_k
        return sigmoid(o) * tanh(c), c


def build(config: ModelConfig) -> ChildSumTreeLSTMModel:
    return ChildSumTreeLSTMModel(config)
