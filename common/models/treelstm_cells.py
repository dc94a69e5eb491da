"""The cells of the binary TreeLSTM (torch): the equations and the planner are in common/models/treelstm.py."""

from __future__ import annotations

import torch
from torch import nn

from batchmaker.common.models.kernels import doubled, stored, table_bytes, token_projection, tree_state
from batchmaker.common.models.tree_cells import TreeModel, gate_blocks, lstm_state
from batchmaker.common.models.treelstm import TreeLSTMPlanner

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


class TreeLSTMModel(TreeLSTMPlanner, TreeModel):
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
