"""Chain LSTM: an embedding followed by one or more LSTM layers (see common/models/chain.py).

Outputs `h` and `c`, the last layer's final state.
"""

from __future__ import annotations

import torch
from torch import nn

from common.config import ModelConfig
from common.models.chain import ChainModel
from common.models.kernels import LSTMKernel, lstm_input


class LSTMStep(nn.Module):
    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.cell = nn.LSTMCell(input_size, hidden_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cell(x, (h, c))


class LSTMModel(ChainModel):
    kind = "lstm"
    rnn_name = "lstm"
    state_names = ("h", "c")
    gates = 4

    def make_step(self, input_size: int) -> nn.Module:
        return LSTMStep(input_size, self.hidden_size)

    def make_kernel(self, embedding: torch.Tensor | None, weights: dict[str, torch.Tensor], fold: bool) -> nn.Module:
        projection = lstm_input(embedding, weights["weight_ih"], weights["bias_ih"], weights["bias_hh"], fold)
        return LSTMKernel(projection, weights["weight_hh"])

    def reference_rnn(self) -> nn.Module:
        return nn.LSTM(self.embedding_size, self.hidden_size, num_layers=self.num_layers)


def build(config: ModelConfig) -> LSTMModel:
    return LSTMModel(config)
