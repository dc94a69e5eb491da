"""Chain RNNs: an embedding followed by one or more recurrent layers, unfolded over the tokens.

Node (layer l, step t) reads layer l-1's h at step t (the token for layer 0) and its
own layer's state at step t-1; each layer is its own cell type because it has its
own weights. Weights use torch.nn.Embedding + torch.nn.LSTM / torch.nn.GRU
state_dict names (`embedding.weight`, `<rnn>.weight_ih_l0`, `<rnn>.weight_hh_l0`,
`<rnn>.bias_ih_l0`, `<rnn>.bias_hh_l0`, then `_l1`, ...), so a model trained as
`self.embedding = nn.Embedding(...); self.<rnn> = nn.LSTM(...)` is served by saving
its state_dict.

This module is the planner (numpy): how a request unfolds. The cells, served by workers, are
in common/models/chain_cells.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.config import ModelConfig
from common.graph import ZERO, CellGraph, CellTypeSpec, External, NodeOutput, NodeSpec, ValueKind
from common.models.base import FOLD_KEY, PlanCache, Planner, check_params, int_param, padded_length, token_ids
from common.plan import Plan, Unfolded, compile_graph

TOKEN = ValueKind("int64", ())


class ChainPlanner(Planner):
    """The shared unfolding and validation of LSTM and GRU chains."""

    state_names: tuple[str, ...]  # recurrent state per layer, also the reply's outputs

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        params = config.params
        allowed = {"vocab_size", "embedding_size", "hidden_size", "num_layers", "max_length", FOLD_KEY}
        check_params(params, allowed, self.name)
        self.vocab_size = int_param(params, "vocab_size", self.name)
        self.hidden_size = int_param(params, "hidden_size", self.name)
        self.embedding_size = int_param(params, "embedding_size", self.name, default=self.hidden_size)
        self.num_layers = int_param(params, "num_layers", self.name, default=1)
        self.max_length = int_param(params, "max_length", self.name, default=1000)
        state = ValueKind("float32", (self.hidden_size,))
        states = (state,) * len(self.state_names)
        self._cell_types = {}
        for layer in range(self.num_layers):
            first = TOKEN if layer == 0 else state
            spec = self._cell_type(f"layer{layer}", (first, *states), states)
            self._cell_types[spec.key] = spec
        self.layer_keys = list(self._cell_types)
        self.plan_cache = PlanCache()  # by length and padded length

    @property
    def cell_types(self) -> dict[str, CellTypeSpec]:
        return self._cell_types

    def describe(self) -> dict[str, Any]:
        state = {"dtype": "float32", "shape": [self.hidden_size]}
        return {
            "kind": self.kind,
            "inputs": {"tokens": {"dtype": "int64", "shape": [-1], "max_length": self.max_length}},
            "outputs": {name: state for name in self.state_names},
            "vocab_size": self.vocab_size,
        }

    can_pad = True

    def unfold(self, inputs: Any) -> CellGraph:
        return self._unfold(token_ids(inputs, "tokens", self.vocab_size, self.max_length), None)

    def plan(self, inputs: Any) -> Unfolded:
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        return Unfolded(self._plan(len(tokens), None), {TOKEN: tokens})

    def plan_padded(self, inputs: Any, bucket_width: int) -> Unfolded:
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        padded = padded_length(len(tokens), bucket_width)
        externals = tokens if padded == len(tokens) else np.append(tokens, 0)  # the padding token
        return Unfolded(self._plan(len(tokens), padded), {TOKEN: externals})

    def _plan(self, length: int, padded: int | None) -> Plan:
        """One plan per length: requests differ only in their tokens."""

        def compile_plan() -> Plan:
            return compile_graph(self._unfold(np.zeros(length, np.int64), padded), self.cell_types, self.name).plan

        return self.plan_cache.get((length, padded), compile_plan)

    def unfold_padded(self, inputs: Any, bucket_width: int) -> CellGraph:
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        return self._unfold(tokens, padded_length(len(tokens), bucket_width))

    def _unfold(self, tokens: np.ndarray, padded_length: int | None) -> CellGraph:
        """Layers of steps over the tokens, then padding steps (token 0) up to `padded_length`.

        Written for speed: the manager runs this for every request, on its critical path."""
        graph = CellGraph()
        graph.externals = tokens.tolist()
        below: list[Any] = [External(i) for i in range(len(tokens))]
        if padded_length is not None:
            graph.externals.append(0)
            below += [External(len(tokens))] * (padded_length - len(tokens))
        last = len(tokens) - 1
        ports = range(len(self.state_names))
        nodes = graph.nodes
        for key in self.layer_keys:
            state: tuple[Any, ...] = (ZERO,) * len(self.state_names)
            outputs = []
            for step, x in enumerate(below):
                node = len(nodes)
                nodes.append(NodeSpec(key, (x, *state)))
                state = tuple([NodeOutput(node, port) for port in ports])
                outputs.append(state[0])
                if step == last:
                    final = state
            below = outputs
        graph.results = dict(zip(self.state_names, final))
        if padded_length is not None:
            graph.padded_length = padded_length
            graph.last_padding = len(graph.nodes) - 1
        return graph
