"""The cells of the TreeLSTMs (torch): the planner is common/models/tree.py.

Both models keep their weights in one nn.Module whose state_dict is the weights file, so
that a training script trains exactly the cells the workers serve and saves them with
`state_dict()`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from batchmaker.common.models.base import Model
from batchmaker.common.models.tree import CLASSIFIER, TreePlanner

EMBEDDING_KEY = "embedding.weight"


def lstm_state(
    i: torch.Tensor, o: torch.Tensor, u: torch.Tensor, carried: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The end of every TreeLSTM node: c = σ(i)⊙tanh(u) + what the forget gates carried over from
    the children, and h = σ(o)⊙tanh(c). The gates come in as pre-activations."""
    c = torch.sigmoid(i) * torch.tanh(u) + carried
    return torch.sigmoid(o) * torch.tanh(c), c


class TreeModel(TreePlanner, Model):
    """A TreeLSTM's cells: the tree cells a subclass defines, over one embedding, and the optional classifier."""

    # -- what a subclass defines -------------------------------------------------------------
    @abstractmethod
    def tree_weights(self) -> nn.Module:
        """A module holding the tree cells' weights under their documented state_dict keys."""

    @abstractmethod
    def tree_cell_modules(self, weights: nn.Module) -> dict[str, nn.Module]:
        """The tree cells by name, sharing the parameters of `weights`."""

    @abstractmethod
    def tree_kernels(self, state: dict[str, torch.Tensor], fold: bool) -> dict[str, nn.Module]:
        """The tree cells' serving kernels (common/models/kernels.py) by name, from the weights file's
        tensors; the cells that read a word fold its input projection into a table when `fold`."""

    @abstractmethod
    def folded_bytes(self) -> int:
        """Memory the folded tables would take."""

    @abstractmethod
    def reference_node(
        self, weights: dict[str, torch.Tensor], token: int, children: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, c) of one node from its word and its children's (h, c), written from the equations."""

    # -- the Model interface -----------------------------------------------------------------
    def weights_module(self) -> nn.Module:
        """All weights in one module: its state_dict is the weights file, in the documented layout."""
        weights = self.tree_weights()
        if self.num_classes:
            weights.classifier = nn.Linear(self.hidden_size, self.num_classes)
        return weights

    def weights_from(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """`weights_module` holding `state`'s tensors themselves (no copy; unknown or missing keys raise)."""
        with torch.device("meta"):
            weights = self.weights_module()
        weights.load_state_dict(state, assign=True)
        return weights

    def cell_modules(self, weights: nn.Module) -> dict[str, nn.Module]:
        """Every cell by name, sharing the parameters of `weights` (a training script trains these)."""
        cells = self.tree_cell_modules(weights)
        if self.num_classes:
            cells[CLASSIFIER] = weights.classifier
        return cells

    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        kernels = self.tree_kernels(state, self.folds(self.folded_bytes()))
        if self.num_classes:
            kernels[CLASSIFIER] = self.weights_from(state).classifier
        return {self.keys[name]: cell for name, cell in kernels.items()}

    def torch_nn_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        return {self.keys[name]: cell for name, cell in self.cell_modules(self.weights_from(state)).items()}

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            return {key: tuple(value.shape) for key, value in self.weights_module().state_dict().items()}

    def init_weights(self, seed: int) -> dict[str, torch.Tensor]:
        """N(0, 1) embeddings and U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the rest, as torch initializes them."""
        generator = torch.Generator().manual_seed(seed)
        shapes = self.weight_shapes()
        state = {}
        for key, shape in shapes.items():
            if key == EMBEDDING_KEY:
                state[key] = torch.randn(shape, generator=generator)
            else:
                fan_in = shapes[key.rpartition(".")[0] + ".weight"][1]
                state[key] = (torch.rand(shape, generator=generator) * 2 - 1) * fan_in**-0.5
        return state

    def reference(self, state: dict[str, torch.Tensor], inputs: Any) -> dict[str, Any]:
        """One node at a time in float64, children before parents, from the equations (never the cells).

        The recursion h_j, c_j = f(x_j, children's h and c) is evaluated bottom-up rather
        than by recursive calls, so trees deeper than Python's recursion limit work too.
        """
        return self.reference_forward({key: value.double() for key, value in state.items()})(inputs)

    def reference_forward(self, state: dict[str, torch.Tensor]) -> Callable[[Any], dict[str, Any]]:
        """The reference's equations in the dtype of `state` (float32 for a weights file: what a timing compares)."""

        def forward(inputs: Any) -> dict[str, Any]:
            tree = self.parse(inputs)
            h: dict[int, torch.Tensor] = {}
            c: dict[int, torch.Tensor] = {}
            with torch.no_grad():
                for i in tree.order:
                    kids = [(h[k], c[k]) for k in tree.children[i]]
                    h[i], c[i] = self.reference_node(state, tree.tokens[i], kids)
                result = {"h": h[tree.root], "c": c[tree.root]}
                if self.num_classes:
                    result["logits"] = state["classifier.weight"] @ h[tree.root] + state["classifier.bias"]
            return {name: value.numpy().astype(np.float32) for name, value in result.items()}

        return forward


def gate_blocks(matrix: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Split a stacked gate weight (or bias) into its named blocks of rows, for the references."""
    return dict(zip(names, matrix.chunk(len(names), dim=0)))
