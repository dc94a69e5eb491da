"""The cells of chain RNNs (torch): the planner is common/models/chain.py.

Weights use torch.nn.Embedding + torch.nn.LSTM / torch.nn.GRU state_dict names (see chain.py).
Workers serve the kernels of common/models/kernels.py (layer 0 folds the embedding into its
input projection); `torch_nn_cells` are the same steps written with torch.nn cells.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np
import torch
from torch import nn

from common.models.base import Model, token_ids
from common.models.chain import ChainPlanner
from common.models.gru import GRUPlanner
from common.models.kernels import GRUKernel, LSTMKernel, gru_input, lstm_input, table_bytes
from common.models.lstm import LSTMPlanner


class EmbeddingStep(nn.Module):
    """First layer: looks the token up, then runs one recurrent step."""

    def __init__(self, embedding: nn.Embedding, step: nn.Module):
        super().__init__()
        self.embedding = embedding
        self.step = step

    def forward(self, tokens: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.step(self.embedding(tokens), *state)


class ChainModel(ChainPlanner, Model):
    """The shared weights layout, cells and reference of LSTM and GRU chains."""

    rnn_name: str  # state_dict prefix: "lstm" or "gru"
    gates: int  # rows of weight_ih per hidden unit

    @abstractmethod
    def make_step(self, input_size: int) -> nn.Module:
        """One layer's torch.nn recurrent step, taking (x, *state) and returning the new state tuple."""

    @abstractmethod
    def make_kernel(self, embedding: torch.Tensor | None, weights: dict[str, torch.Tensor], fold: bool) -> nn.Module:
        """One layer's serving kernel from its torch.nn weights (weight_ih, weight_hh, bias_ih, bias_hh):
        a token step when `embedding` is given (folded when `fold`), a vector step otherwise."""

    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        fold = self.folds(table_bytes(self.vocab_size, self.gates * self.hidden_size))
        return {
            key: self.make_kernel(state["embedding.weight"] if layer == 0 else None, self._layer_weights(state, layer), fold)
            for layer, key in enumerate(self.layer_keys)
        }

    def _layer_weights(self, state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
        return {name: state[f"{self.rnn_name}.{name}_l{layer}"] for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}

    def torch_nn_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        embedding = nn.Embedding(self.vocab_size, self.embedding_size)
        embedding.load_state_dict({"weight": state["embedding.weight"]})
        cells: dict[str, nn.Module] = {}
        for layer, key in enumerate(self.layer_keys):
            step = self.make_step(self.embedding_size if layer == 0 else self.hidden_size)
            step.cell.load_state_dict(self._layer_weights(state, layer))
            cells[key] = EmbeddingStep(embedding, step) if layer == 0 else step
        return cells

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"embedding.weight": (self.vocab_size, self.embedding_size)}
        rows = self.gates * self.hidden_size
        for layer in range(self.num_layers):
            input_size = self.embedding_size if layer == 0 else self.hidden_size
            shapes[f"{self.rnn_name}.weight_ih_l{layer}"] = (rows, input_size)
            shapes[f"{self.rnn_name}.weight_hh_l{layer}"] = (rows, self.hidden_size)
            shapes[f"{self.rnn_name}.bias_ih_l{layer}"] = (rows,)
            shapes[f"{self.rnn_name}.bias_hh_l{layer}"] = (rows,)
        return shapes

    def init_weights(self, seed: int) -> dict[str, torch.Tensor]:
        """N(0, 1) embeddings and U(-1/sqrt(hidden), 1/sqrt(hidden)) recurrent weights, as torch initializes them."""
        generator = torch.Generator().manual_seed(seed)
        bound = self.hidden_size**-0.5
        state = {}
        for key, shape in self.weight_shapes().items():
            if key == "embedding.weight":
                state[key] = torch.randn(shape, generator=generator)
            else:
                state[key] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
        return state

    @abstractmethod
    def reference_rnn(self) -> nn.Module:
        """The whole-sequence torch module (nn.LSTM or nn.GRU) the reference runs."""

    def reference(self, state: dict[str, torch.Tensor], inputs: Any) -> dict[str, Any]:
        """torch.nn.Embedding + the whole-sequence torch RNN, one request at a time."""
        tokens = torch.from_numpy(token_ids(inputs, "tokens", self.vocab_size, self.max_length))
        embedding = nn.Embedding(self.vocab_size, self.embedding_size)
        embedding.load_state_dict({"weight": state["embedding.weight"]})
        rnn = self.reference_rnn()
        prefix = f"{self.rnn_name}."
        rnn.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
        given = self.initial_states(inputs)
        initial = tuple(
            torch.tensor(given[name]) if name in given else torch.zeros(self.final_rows, self.hidden_size)
            for name in self.state_names
        )
        with torch.inference_mode():
            output, final = rnn(embedding(tokens), initial if len(initial) > 1 else initial[0])
        final = final if isinstance(final, tuple) else (final,)
        reply: dict[str, Any] = {"y": output.numpy().astype(np.float32)} if self.per_step else {}
        for name, value in zip(self.state_names, final):
            reply[name] = value[self.top].numpy().astype(np.float32)
            reply[f"{name}_n"] = value.numpy().astype(np.float32)
        return reply


class LSTMStep(nn.Module):
    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.cell = nn.LSTMCell(input_size, hidden_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cell(x, (h, c))


class LSTMModel(LSTMPlanner, ChainModel):
    rnn_name = "lstm"
    gates = 4

    def make_step(self, input_size: int) -> nn.Module:
        return LSTMStep(input_size, self.hidden_size)

    def make_kernel(self, embedding: torch.Tensor | None, weights: dict[str, torch.Tensor], fold: bool) -> nn.Module:
        projection = lstm_input(embedding, weights["weight_ih"], weights["bias_ih"], weights["bias_hh"], fold)
        return LSTMKernel(projection, weights["weight_hh"])

    def reference_rnn(self) -> nn.Module:
        return nn.LSTM(self.embedding_size, self.hidden_size, num_layers=self.num_layers)


class GRUStep(nn.Module):
    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.cell = nn.GRUCell(input_size, hidden_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.cell(x, h),)


class GRUModel(GRUPlanner, ChainModel):
    rnn_name = "gru"
    gates = 3

    def make_step(self, input_size: int) -> nn.Module:
        return GRUStep(input_size, self.hidden_size)

    def make_kernel(self, embedding: torch.Tensor | None, weights: dict[str, torch.Tensor], fold: bool) -> nn.Module:
        projection = gru_input(embedding, weights["weight_ih"], weights["bias_ih"], fold)
        return GRUKernel(projection, weights["weight_hh"], weights["bias_hh"])

    def reference_rnn(self) -> nn.Module:
        return nn.GRU(self.embedding_size, self.hidden_size, num_layers=self.num_layers)
