"""The cells of the Child-Sum TreeLSTM (torch): the equations, weight keys and the planner are in
common/models/childsum.py."""

from __future__ import annotations

import torch
from torch import nn

from batchmaker.common.models.childsum import ChildSumPlanner
from batchmaker.common.models.kernels import doubled, stored, table_bytes, token_projection, tree_state
from batchmaker.common.models.tree import NO_WORD
from batchmaker.common.models.tree_cells import TreeModel, gate_blocks, lstm_state

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


class ChildSumTreeLSTMModel(ChildSumPlanner, TreeModel):
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
