"""Chain GRU: an embedding followed by one or more GRU layers (see common/models/chain.py).

Outputs `h`, the last layer's final state.
"""

from __future__ import annotations

import torch
from torch import nn

from common.config import ModelConfig
from common.models.chain import ChainModel
from common.models.kernels import GRUKernel, gru_input


class GRUStep(nn.Module):
    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.cell = nn.GRUCell(input_size, hidden_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.cell(x, h),)


class GRUModel(ChainModel):
    kind = "gru"
    rnn_name = "gru"
    state_names = ("h",)
    gates = 3

    def make_step(self, input_size: int) -> nn.Module:
        return GRUStep(input_size, self.hidden_size)

    def make_kernel(self, embedding: torch.Tensor | None, weights: dict[str, torch.Tensor], fold: bool) -> nn.Module:
        projection = gru_input(embedding, weights["weight_ih"], weights["bias_ih"], fold)
        return GRUKernel(projection, weights["weight_hh"], weights["bias_hh"])

    def reference_rnn(self) -> nn.Module:
        return nn.GRU(self.embedding_size, self.hidden_size, num_layers=self.num_layers)


def build(config: ModelConfig) -> GRUModel:
    return GRUModel(config)
