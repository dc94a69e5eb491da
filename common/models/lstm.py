"""Chain LSTM: an embedding followed by one or more LSTM layers.

Weights use torch.nn.Embedding + torch.nn.LSTM state_dict names
(`embedding.weight`, `lstm.weight_ih_l0`, `lstm.weight_hh_l0`, `lstm.bias_ih_l0`,
`lstm.bias_hh_l0`, then `_l1`, ... for further layers), so a model trained with
`nn.Sequential`-free code like `self.embedding = nn.Embedding(...); self.lstm = nn.LSTM(...)`
is served by saving its state_dict.

Unfolding: node (layer l, step t) reads layer l-1's h at step t (the token for
layer 0) and its own layer's h, c at step t-1; each layer is its own cell type
because it has its own weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from common.config import ModelConfig
from common.graph import ZERO, CellGraph, CellTypeSpec, NodeOutput, ValueKind
from common.models.base import Model, check_params, int_param, token_ids

TOKEN = ValueKind("int64", ())


class EmbeddingLSTMCell(nn.Module):
    """First layer: looks the token up, then runs one LSTM step."""

    def __init__(self, embedding: nn.Embedding, cell: nn.LSTMCell):
        super().__init__()
        self.embedding = embedding
        self.cell = cell

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cell(self.embedding(tokens), (h, c))


class StackedLSTMCell(nn.Module):
    """A layer above the first: its input is the lower layer's h at the same step."""

    def __init__(self, cell: nn.LSTMCell):
        super().__init__()
        self.cell = cell

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cell(x, (h, c))


def lstm_cell_from_state(state: dict[str, torch.Tensor], layer: int, input_size: int, hidden: int) -> nn.LSTMCell:
    cell = nn.LSTMCell(input_size, hidden)
    cell.load_state_dict(
        {
            "weight_ih": state[f"lstm.weight_ih_l{layer}"],
            "weight_hh": state[f"lstm.weight_hh_l{layer}"],
            "bias_ih": state[f"lstm.bias_ih_l{layer}"],
            "bias_hh": state[f"lstm.bias_hh_l{layer}"],
        }
    )
    return cell


class LSTMModel(Model):
    kind = "lstm"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        params = config.params
        check_params(params, {"vocab_size", "embedding_size", "hidden_size", "num_layers", "max_length"}, self.name)
        self.vocab_size = int_param(params, "vocab_size", self.name)
        self.hidden_size = int_param(params, "hidden_size", self.name)
        self.embedding_size = int_param(params, "embedding_size", self.name, default=self.hidden_size)
        self.num_layers = int_param(params, "num_layers", self.name, default=1)
        self.max_length = int_param(params, "max_length", self.name, default=1000)
        state = ValueKind("float32", (self.hidden_size,))
        self.state_kind = state
        self._cell_types = {}
        for layer in range(self.num_layers):
            first = TOKEN if layer == 0 else state
            spec = self._cell_type(f"layer{layer}", (first, state, state), (state, state))
            self._cell_types[spec.key] = spec
        self.layer_keys = list(self._cell_types)

    @property
    def cell_types(self) -> dict[str, CellTypeSpec]:
        return self._cell_types

    def describe(self) -> dict[str, Any]:
        hidden = [self.hidden_size]
        return {
            "kind": self.kind,
            "inputs": {"tokens": {"dtype": "int64", "shape": [-1], "max_length": self.max_length}},
            "outputs": {"h": {"dtype": "float32", "shape": hidden}, "c": {"dtype": "float32", "shape": hidden}},
            "vocab_size": self.vocab_size,
        }

    def unfold(self, inputs: Any) -> CellGraph:
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        graph = CellGraph()
        below: list[Any] = [graph.add_external(token) for token in tokens]
        for key in self.layer_keys:
            h: Any = ZERO
            c: Any = ZERO
            outputs = []
            for x in below:
                node = graph.add_node(key, x, h, c)
                h, c = NodeOutput(node, 0), NodeOutput(node, 1)
                outputs.append(h)
            below = outputs
        graph.results = {"h": h, "c": c}
        return graph

    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        embedding = nn.Embedding(self.vocab_size, self.embedding_size)
        embedding.load_state_dict({"weight": state["embedding.weight"]})
        cells: dict[str, nn.Module] = {}
        for layer, key in enumerate(self.layer_keys):
            input_size = self.embedding_size if layer == 0 else self.hidden_size
            cell = lstm_cell_from_state(state, layer, input_size, self.hidden_size)
            cells[key] = EmbeddingLSTMCell(embedding, cell) if layer == 0 else StackedLSTMCell(cell)
        return cells

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"embedding.weight": (self.vocab_size, self.embedding_size)}
        gates = 4 * self.hidden_size
        for layer in range(self.num_layers):
            input_size = self.embedding_size if layer == 0 else self.hidden_size
            shapes[f"lstm.weight_ih_l{layer}"] = (gates, input_size)
            shapes[f"lstm.weight_hh_l{layer}"] = (gates, self.hidden_size)
            shapes[f"lstm.bias_ih_l{layer}"] = (gates,)
            shapes[f"lstm.bias_hh_l{layer}"] = (gates,)
        return shapes

    def init_weights(self, seed: int) -> dict[str, torch.Tensor]:
        """N(0, 1) embeddings and U(-1/sqrt(hidden), 1/sqrt(hidden)) LSTM weights, as torch initializes them."""
        generator = torch.Generator().manual_seed(seed)
        bound = self.hidden_size**-0.5
        state = {}
        for key, shape in self.weight_shapes().items():
            if key == "embedding.weight":
                state[key] = torch.randn(shape, generator=generator)
            else:
                state[key] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
        return state

    def reference(self, state: dict[str, torch.Tensor], inputs: Any) -> dict[str, Any]:
        """torch.nn.Embedding + torch.nn.LSTM over the whole sequence, one request at a time."""
        tokens = torch.from_numpy(token_ids(inputs, "tokens", self.vocab_size, self.max_length))
        embedding = nn.Embedding(self.vocab_size, self.embedding_size)
        lstm = nn.LSTM(self.embedding_size, self.hidden_size, num_layers=self.num_layers)
        embedding.load_state_dict({"weight": state["embedding.weight"]})
        lstm.load_state_dict({k.removeprefix("lstm."): v for k, v in state.items() if k.startswith("lstm.")})
        with torch.inference_mode():
            _, (h, c) = lstm(embedding(tokens))
        return {"h": h[-1].numpy().astype(np.float32), "c": c[-1].numpy().astype(np.float32)}


def build(config: ModelConfig) -> LSTMModel:
    return LSTMModel(config)
