"""The cells of chain RNNs (torch): the planner is common/models/chain.py.

Weights use torch.nn.Embedding + torch.nn.LSTM / torch.nn.GRU (+ torch.nn.Linear) state_dict names
(see chain.py). Workers serve the kernels of common/models/kernels.py (layer 0 folds the embedding
into its input projection; layers above a bidirectional one split their input projection in two);
`torch_nn_cells` are the same steps written with torch.nn cells.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from batchmaker.common.models.base import Model
from batchmaker.common.models.chain import ChainPlanner
from batchmaker.common.models.gru import GRUPlanner
from batchmaker.common.models.kernels import (
    GRUKernel,
    LSTMKernel,
    PairGRUKernel,
    PairLSTMKernel,
    Projection,
    gru_input,
    lstm_input,
    table_bytes,
    vector_projection,
)
from batchmaker.common.models.lstm import LSTMPlanner


class EmbeddingStep(nn.Module):
    """First layer: looks the token up, then runs one recurrent step."""

    def __init__(self, embedding: nn.Embedding, step: nn.Module):
        super().__init__()
        self.embedding = embedding
        self.step = step

    def forward(self, tokens: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.step(self.embedding(tokens), *state)


class PairStep(nn.Module):
    """A layer above a bidirectional one: concatenates both directions, then runs one recurrent step."""

    def __init__(self, step: nn.Module):
        super().__init__()
        self.step = step

    def forward(self, a: torch.Tensor, b: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.step(torch.cat([a, b], dim=1), *state)


class LinearHead(nn.Module):
    """The head as torch.nn.Linear over both directions concatenated (forward, then reverse)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, *directions: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat(directions, dim=1))


class StepHead(nn.Module):
    """A last layer's step that also emits [h, h's part of the head]: a per-step head without a cell of its own."""

    def __init__(self, step: nn.Module, head: nn.Module):
        super().__init__()
        self.step = step
        self.head = head

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = self.step(*inputs)
        return (*state, torch.cat([state[0], self.head(state[0])], dim=1))


class ChainModel(ChainPlanner, Model):
    """The shared weights layout, cells and reference of LSTM and GRU chains."""

    rnn_name: str  # state_dict prefix: "lstm" or "gru"
    gates: int  # rows of weight_ih per hidden unit

    @abstractmethod
    def make_step(self, input_size: int) -> nn.Module:
        """One layer's torch.nn recurrent step, taking (x, *state) and returning the new state tuple."""

    @abstractmethod
    def make_kernel(
        self, embedding: torch.Tensor | None, weights: dict[str, torch.Tensor], fold: bool, split: int | None
    ) -> nn.Module:
        """One layer's serving kernel from its torch.nn weights (weight_ih, weight_hh, bias_ih, bias_hh):
        a token step when `embedding` is given (folded when `fold`), a vector step otherwise (of two
        vectors, weight_ih's columns split at `split`, when given)."""

    @property
    def _layer_inputs(self) -> list[int]:
        """The width of each layer's input: the embedding (or x), then both directions of the layer below."""
        return [self.embedding_size] + [self.hidden_size * self.directions] * (self.num_layers - 1)

    def _weight_suffixes(self) -> list[str]:
        """The state_dict suffix of each layer and direction, in h_n order: _l0, _l0_reverse, _l1, ..."""
        return [
            f"_l{layer}{direction}"
            for layer in range(self.num_layers)
            for direction in ("", "_reverse")[: self.directions]
        ]

    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        fold = self.vocab_size is not None and self.folds(table_bytes(self.vocab_size, self.gates * self.hidden_size))
        cells = {}
        for row, (key, suffix) in enumerate(zip(self.layer_keys, self._weight_suffixes())):
            layer = row // self.directions
            embedding = state["embedding.weight"] if layer == 0 and self.vocab_size is not None else None
            split = self.hidden_size if layer > 0 and self.directions == 2 else None
            cells[key] = self.make_kernel(embedding, self._layer_weights(state, suffix), fold, split)
        if self.step_heads:
            self._add_step_heads(cells, [Projection(weight, bias) for weight, bias in self._head_parts(state)])
        elif self.head_size is not None:
            split = self.hidden_size if self.directions == 2 else None
            cells[self.head_key] = vector_projection(state["head.weight"], state["head.bias"], split)
        return cells

    def _head_parts(self, state: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The head's (weight, bias) on each direction's h: its columns for that direction; the bias
        goes with the forward part, the others add zeros."""
        weight, bias = state["head.weight"], state["head.bias"]
        columns = weight.split(self.hidden_size, dim=1)
        return [(part, bias if direction == 0 else torch.zeros_like(bias)) for direction, part in enumerate(columns)]

    def _add_step_heads(self, cells: dict[str, nn.Module], heads: list[nn.Module]) -> None:
        """Wrap the last layer's step of each direction to emit its part of the head."""
        for key, head in zip(self.layer_keys[-self.directions :], heads, strict=True):
            cells[key] = StepHead(cells[key], head)

    def _layer_weights(self, state: dict[str, torch.Tensor], suffix: str) -> dict[str, torch.Tensor]:
        return {
            name: state[f"{self.rnn_name}.{name}{suffix}"] for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        }

    def torch_nn_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        embedding = None
        if self.vocab_size is not None:
            embedding = nn.Embedding(self.vocab_size, self.embedding_size)
            embedding.load_state_dict({"weight": state["embedding.weight"]})
        cells: dict[str, nn.Module] = {}
        for row, (key, suffix) in enumerate(zip(self.layer_keys, self._weight_suffixes())):
            layer = row // self.directions
            step = self.make_step(self._layer_inputs[layer])
            step.cell.load_state_dict(self._layer_weights(state, suffix))
            if layer == 0:
                cells[key] = step if embedding is None else EmbeddingStep(embedding, step)
            else:
                cells[key] = PairStep(step) if self.directions == 2 else step
        if self.step_heads:
            self._add_step_heads(cells, [self._linear(weight, bias) for weight, bias in self._head_parts(state)])
        elif self.head_size is not None:
            cells[self.head_key] = LinearHead(self._head(state))
        return cells

    @staticmethod
    def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
        linear = nn.Linear(weight.shape[1], weight.shape[0])
        linear.load_state_dict({"weight": weight, "bias": bias})
        return linear

    def _head(self, state: dict[str, torch.Tensor]) -> nn.Linear:
        return self._linear(state["head.weight"], state["head.bias"])

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {} if self.vocab_size is None else {"embedding.weight": (self.vocab_size, self.embedding_size)}
        rows = self.gates * self.hidden_size
        for row, suffix in enumerate(self._weight_suffixes()):
            shapes[f"{self.rnn_name}.weight_ih{suffix}"] = (rows, self._layer_inputs[row // self.directions])
            shapes[f"{self.rnn_name}.weight_hh{suffix}"] = (rows, self.hidden_size)
            shapes[f"{self.rnn_name}.bias_ih{suffix}"] = (rows,)
            shapes[f"{self.rnn_name}.bias_hh{suffix}"] = (rows,)
        if self.head_size is not None:
            shapes["head.weight"] = (self.head_size, self.hidden_size * self.directions)
            shapes["head.bias"] = (self.head_size,)
        return shapes

    def init_weights(self, seed: int) -> dict[str, torch.Tensor]:
        """N(0, 1) embeddings, U(-1/sqrt(hidden), 1/sqrt(hidden)) recurrent weights and U(-1/sqrt(fan_in),
        1/sqrt(fan_in)) head weights, as torch initializes them."""
        generator = torch.Generator().manual_seed(seed)
        state = {}
        for key, shape in self.weight_shapes().items():
            if key == "embedding.weight":
                state[key] = torch.randn(shape, generator=generator)
                continue
            fan_in = self.hidden_size * (self.directions if key.startswith("head.") else 1)
            state[key] = (torch.rand(shape, generator=generator) * 2 - 1) * fan_in**-0.5
        return state

    @abstractmethod
    def reference_rnn(self) -> nn.Module:
        """The whole-sequence torch module (nn.LSTM or nn.GRU) the reference runs."""

    def reference(self, state: dict[str, torch.Tensor], inputs: Any) -> dict[str, Any]:
        """torch.nn.Embedding (for tokens) + the whole-sequence torch RNN (+ torch.nn.Linear), one request at a time."""
        return self.reference_forward(state)(inputs)

    def reference_forward(self, state: dict[str, torch.Tensor]) -> Callable[[Any], dict[str, Any]]:
        embedding = None
        if self.vocab_size is not None:
            embedding = nn.Embedding(self.vocab_size, self.embedding_size)
            embedding.load_state_dict({"weight": state["embedding.weight"]})
        rnn = self.reference_rnn()
        prefix = f"{self.rnn_name}."
        rnn.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
        head = self._head(state) if self.head_size is not None else None

        def forward(inputs: Any) -> dict[str, Any]:
            sequence = torch.tensor(self.input_rows(inputs))
            given = self.initial_states(inputs)
            initial = tuple(
                torch.tensor(given[name]) if name in given else torch.zeros(self.final_rows, self.hidden_size)
                for name in self.state_names
            )
            with torch.inference_mode():
                if embedding is not None:
                    sequence = embedding(sequence)
                output, final = rnn(sequence, initial if len(initial) > 1 else initial[0])
                final = final if isinstance(final, tuple) else (final,)
                reply: dict[str, Any] = {"y": output.numpy().astype(np.float32)} if self.per_step else {}
                for name, value in zip(self.state_names, final):
                    reply[name] = value[self.top].numpy().astype(np.float32)
                    reply[f"{name}_n"] = value.numpy().astype(np.float32)
                if head is not None:
                    last = torch.cat(list(final[0][self.top :]))  # torch.cat([h_n[-2], h_n[-1]]) when bidirectional
                    reply["logits"] = head(output if self.per_step else last).numpy().astype(np.float32)
            return reply

        return forward


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

    def make_kernel(
        self, embedding: torch.Tensor | None, weights: dict[str, torch.Tensor], fold: bool, split: int | None
    ) -> nn.Module:
        projection = lstm_input(embedding, weights["weight_ih"], weights["bias_ih"], weights["bias_hh"], fold, split)
        return (LSTMKernel if split is None else PairLSTMKernel)(projection, weights["weight_hh"])

    def reference_rnn(self) -> nn.Module:
        return nn.LSTM(self.embedding_size, self.hidden_size, self.num_layers, bidirectional=self.directions == 2)


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

    def make_kernel(
        self, embedding: torch.Tensor | None, weights: dict[str, torch.Tensor], fold: bool, split: int | None
    ) -> nn.Module:
        projection = gru_input(embedding, weights["weight_ih"], weights["bias_ih"], fold, split)
        return (GRUKernel if split is None else PairGRUKernel)(projection, weights["weight_hh"], weights["bias_hh"])

    def reference_rnn(self) -> nn.Module:
        return nn.GRU(self.embedding_size, self.hidden_size, self.num_layers, bidirectional=self.directions == 2)
