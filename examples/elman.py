"""A user-defined model: an Elman RNN, h' = tanh(W x + U h + b), over token embeddings.

The worked example of docs/models.md: a custom cell, an unfold function building the cell
graph, weights, and an unbatched reference. Serve it with a config table such as

    [models.elman]
    builder = "examples.elman:build"
    weights = "weights/elman.pt"
    vocab_size = 1000
    hidden_size = 64
    batch_sizes = [1, 2, 4, 8, 16, 32, 64]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from batchmaker.common.config import ModelConfig
from batchmaker.common.graph import ZERO, CellGraph, CellTypeSpec, NodeOutput, ValueKind
from batchmaker.common.models.base import Model, check_params, int_param, token_ids

TOKEN = ValueKind("int64", ())


class ElmanCell(nn.Module):
    """One step for a whole batch: every input and output has the batch as its first dimension."""

    def __init__(self, embedding: nn.Embedding, step: nn.RNNCell):
        super().__init__()
        self.embedding = embedding
        self.step = step

    def forward(self, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.step(self.embedding(tokens), h)


class ElmanModel(Model):
    kind = "elman"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        check_params(config.params, {"vocab_size", "hidden_size", "max_length"}, self.name)
        self.vocab_size = int_param(config.params, "vocab_size", self.name)
        self.hidden_size = int_param(config.params, "hidden_size", self.name)
        self.max_length = int_param(config.params, "max_length", self.name, default=1000)
        state = ValueKind("float32", (self.hidden_size,))
        spec = self._cell_type("step", (TOKEN, state), (state,))  # batch sizes and priority come from the config
        self._cell_types = {spec.key: spec}
        self.step_key = spec.key

    @property
    def cell_types(self) -> dict[str, CellTypeSpec]:
        return self._cell_types

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "inputs": {"tokens": {"dtype": "int64", "shape": [-1], "max_length": self.max_length}},
            "outputs": {"h": {"dtype": "float32", "shape": [self.hidden_size]}},
            "vocab_size": self.vocab_size,
        }

    def unfold(self, inputs: Any) -> CellGraph:
        """One node per token: node t reads token t (an external value) and node t-1's h."""
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        graph = CellGraph()
        h: Any = ZERO  # the first step starts from the all-zero state
        for token in tokens:
            node = graph.add_node(self.step_key, graph.add_external(token), h)
            h = NodeOutput(node, 0)
        graph.results = {"h": h}
        return graph

    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        embedding = nn.Embedding(self.vocab_size, self.hidden_size)
        embedding.load_state_dict({"weight": state["embedding.weight"]})
        step = nn.RNNCell(self.hidden_size, self.hidden_size)
        step.load_state_dict({k: state[f"rnn.{k}"] for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")})
        return {self.step_key: ElmanCell(embedding, step)}

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        size = self.hidden_size
        return {
            "embedding.weight": (self.vocab_size, size),
            "rnn.weight_ih": (size, size),
            "rnn.weight_hh": (size, size),
            "rnn.bias_ih": (size,),
            "rnn.bias_hh": (size,),
        }

    def reference(self, state: dict[str, torch.Tensor], inputs: Any) -> dict[str, Any]:
        """The same equations, one token at a time, written out by hand."""
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        h = torch.zeros(self.hidden_size)
        for token in tokens.tolist():
            x = state["embedding.weight"][token]
            h = torch.tanh(
                state["rnn.weight_ih"] @ x + state["rnn.bias_ih"] + state["rnn.weight_hh"] @ h + state["rnn.bias_hh"]
            )
        return {"h": h.numpy().astype(np.float32)}


def build(config: ModelConfig) -> ElmanModel:
    return ElmanModel(config)
