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

from common.config import ConfigError, ModelConfig
from common.graph import ZERO, CellGraph, CellTypeSpec, External, NodeOutput, NodeSpec, ValueKind
from common.models.base import FOLD_KEY, PlanCache, Planner, check_params, int_param, padded_length, token_ids
from common.models.vectors import float_rows
from common.plan import Plan, Unfolded, compile_graph
from common.protocol import INVALID_INPUT, RequestError

TOKEN = ValueKind("int64", ())


class ChainPlanner(Planner):
    """The shared unfolding and validation of LSTM and GRU chains."""

    state_names: tuple[str, ...]  # recurrent state per layer: `h` (and `c`), also the reply's outputs

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        params = config.params
        allowed = {"vocab_size", "embedding_size", "hidden_size", "num_layers", "max_length", "per_step", FOLD_KEY}
        check_params(params, allowed, self.name)
        self.vocab_size = int_param(params, "vocab_size", self.name)
        self.hidden_size = int_param(params, "hidden_size", self.name)
        self.embedding_size = int_param(params, "embedding_size", self.name, default=self.hidden_size)
        self.num_layers = int_param(params, "num_layers", self.name, default=1)
        self.max_length = int_param(params, "max_length", self.name, default=1000)
        self.per_step = bool_param(params, "per_step", self.name)
        state = ValueKind("float32", (self.hidden_size,))
        states = (state,) * len(self.state_names)
        self._cell_types = {}
        for layer in range(self.num_layers):
            first = TOKEN if layer == 0 else state
            spec = self._cell_type(f"layer{layer}", (first, *states), states)
            self._cell_types[spec.key] = spec
        self.layer_keys = list(self._cell_types)
        self.state_kind = state
        self.input_kind = TOKEN
        self.directions = 1
        finals = range(self.num_layers * self.directions)  # nn.LSTM's h_n rows: layer * directions + direction
        self.final_names = {name: tuple(f"{name}_n{i}" for i in finals) for name in self.state_names}
        self.top = (self.num_layers - 1) * self.directions  # the last layer's forward direction in h_n
        self.plan_cache = PlanCache()  # by length, padded length and the initial states given
        self._step_names: dict[int, tuple[str, ...]] = {}  # per_step results by length

    @property
    def cell_types(self) -> dict[str, CellTypeSpec]:
        return self._cell_types

    def describe(self) -> dict[str, Any]:
        state = {"dtype": "float32", "shape": [self.hidden_size]}
        states = {"dtype": "float32", "shape": [self.num_layers * self.directions, self.hidden_size]}
        initial = {f"{name}0": {**states, "optional": True} for name in self.state_names}
        return {
            "kind": self.kind,
            "inputs": {"tokens": {"dtype": "int64", "shape": [-1], "max_length": self.max_length}, **initial},
            "outputs": {
                **{name: state for name in self.state_names},
                **{f"{name}_n": states for name in self.state_names},
                **({"y": {"dtype": "float32", "shape": [-1, self.hidden_size * self.directions]}} if self.per_step else {}),
            },
            "vocab_size": self.vocab_size,
        }

    can_pad = True

    def unfold(self, inputs: Any) -> CellGraph:
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        return self._unfold(tokens, None, self.initial_states(inputs), 0)

    def unfold_padded(self, inputs: Any, bucket_width: int) -> CellGraph:
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        return self._unfold(tokens, padded_length(len(tokens), bucket_width), self.initial_states(inputs), 0)

    def plan(self, inputs: Any) -> Unfolded:
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        return self._planned(tokens, None, inputs)

    def plan_padded(self, inputs: Any, bucket_width: int) -> Unfolded:
        tokens = token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        padded = padded_length(len(tokens), bucket_width)
        return self._planned(tokens, padded, inputs, 0)

    def initial_states(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        """The initial states the request gives (`h0`, `c0`), by state name: float32 [layers * directions, H]."""
        if "h0" not in inputs and "c0" not in inputs:
            return {}
        if "c0" in inputs and "c" not in self.state_names:
            raise RequestError(INVALID_INPUT, f"c0 is an LSTM's initial cell state; model {self.name!r} is a {self.kind} and has none")
        return {
            name: float_rows(inputs[f"{name}0"], f"{name}0", self.hidden_size, rows=self.final_rows)
            for name in self.state_names
            if f"{name}0" in inputs
        }

    @property
    def final_rows(self) -> int:
        """Rows of h_n (and of h0): one per layer and direction."""
        return self.num_layers * self.directions

    def _planned(self, rows: np.ndarray, padded: int | None, inputs: dict[str, Any], padding: Any = None) -> Unfolded:
        """The cached plan of this shape with the request's input rows (then the padding row, when
        the padded length exceeds the length) and initial states as its externals."""
        initial = self.initial_states(inputs)
        length = len(rows)  # the model's state in the plan: outputs assembles `y` of this many steps
        plan, order = self._plan(length, padded, tuple(initial))
        if padded is not None and padded > length:
            rows = np.concatenate([rows, np.asarray(padding, rows.dtype)[None]])
        if not initial:
            return Unfolded(plan, {self.input_kind: rows}, length)
        states = np.concatenate(list(initial.values()))
        if self.input_kind == self.state_kind:
            return Unfolded(plan, {self.state_kind: np.concatenate([rows, states])[order]}, length)
        return Unfolded(plan, {self.input_kind: rows, self.state_kind: states[order - len(rows)]}, length)

    def _plan(self, length: int, padded: int | None, given: tuple[str, ...]) -> tuple[Plan, np.ndarray | None]:
        """One plan per length, padded length and initial states given: requests differ only in their
        external values. With initial states, also the order in which the plan reads the external rows
        of the state kind, as indices into the input rows (the padding row included) followed by the
        initial states' rows: the plan is compiled from rows that hold their own index."""

        def compile_plan() -> tuple[Plan, np.ndarray | None]:
            labels = labelled(self.input_kind, 0, length + 1)
            count = length + (padded is not None and padded > length)
            initial = {name: labelled(self.state_kind, count + i * self.final_rows, self.final_rows) for i, name in enumerate(given)}
            unfolded = compile_graph(self._unfold(labels[:length], padded, initial, labels[length]), self.cell_types, self.name)
            if not given:
                return unfolded.plan, None
            order = unfolded.externals[self.state_kind].reshape(-1, self.hidden_size)[:, 0].astype(np.int64)
            return unfolded.plan, order

        return self.plan_cache.get((length, padded, given), compile_plan)

    def _unfold(self, rows: np.ndarray, padded_length: int | None, initial: dict[str, np.ndarray], padding: Any) -> CellGraph:
        """Layers of steps over the input rows, then padding steps on the `padding` row up to `padded_length`.

        Written for speed: the manager runs this for every request, on its critical path."""
        graph = CellGraph()
        graph.externals = rows.tolist()
        length = graph.state = len(rows)
        below: list[Any] = [External(i) for i in range(length)]
        if padded_length is not None and padded_length > length:
            graph.externals.append(padding)
            below += [External(length)] * (padded_length - length)
        first_state = len(graph.externals)
        for values in initial.values():
            graph.externals.extend(values)
        last = length - 1
        ports = range(len(self.state_names))
        nodes = graph.nodes
        for layer, key in enumerate(self.layer_keys):
            state = self._start(layer, initial, first_state)
            outputs = []
            for step, x in enumerate(below):
                node = len(nodes)
                nodes.append(NodeSpec(key, (x, *state)))
                state = tuple([NodeOutput(node, port) for port in ports])
                outputs.append(state[0])
                if step == last:
                    for name, value in zip(self.state_names, state):
                        graph.results[self.final_names[name][layer]] = value
            below = outputs
        if self.per_step:
            graph.results.update(zip(self.step_names(length), below))
        if padded_length is not None:
            graph.padded_length = padded_length
            graph.last_padding = len(graph.nodes) - 1
        return graph

    def _start(self, row: int, initial: dict[str, np.ndarray], first_state: int) -> tuple[Any, ...]:
        """The initial state of h_n row `row`: the given initial states' external rows, else zeros."""
        if not initial:
            return (ZERO,) * len(self.state_names)
        given = {name: External(first_state + i * self.final_rows + row) for i, name in enumerate(initial)}
        return tuple(given.get(name, ZERO) for name in self.state_names)

    def step_names(self, length: int) -> tuple[str, ...]:
        """The results holding the last layer's output at each step (`per_step`), made once per length."""
        names = self._step_names.get(length)
        if names is None:
            names = self._step_names[length] = tuple(f"y{step}" for step in range(length))
        return names

    def outputs(self, graph: CellGraph | Unfolded, results: dict[str, np.ndarray]) -> dict[str, Any]:
        """`h` (and `c`): the last layer's final state; `h_n` (and `c_n`): every layer's, as nn.LSTM orders them;
        `y` with `per_step`: the last layer's output at every step, as nn.LSTM's `output`."""
        reply: dict[str, Any] = {}
        for name, finals in self.final_names.items():
            rows = [results[key] for key in finals]
            reply[name] = rows[self.top]
            reply[f"{name}_n"] = np.stack(rows)
        if self.per_step:
            reply["y"] = np.stack([results[key] for key in self.step_names(graph.state)])
        return reply

    @property
    def can_stream(self) -> bool:  # type: ignore[override]
        return self.per_step

    def partial_outputs(self, graph: CellGraph | Unfolded, results: dict[str, np.ndarray], start: int) -> dict[str, Any] | None:
        """With `per_step`: the rows of `y` from `start` on whose step's output has been read, up to the first
        step not yet read (the steps of the last layer complete in order)."""
        names = self.step_names(graph.state)
        end = start
        while end < len(names) and names[end] in results:
            end += 1
        return {"y": np.stack([results[key] for key in names[start:end]])} if end > start else None


def bool_param(params: dict[str, Any], key: str, model: str) -> bool:
    """A true/false key, false when absent."""
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"[models.{model}] {key} must be true or false, got {value!r}")
    return value


def labelled(kind: ValueKind, first: int, count: int) -> np.ndarray:
    """`count` values of `kind` holding the numbers first, first + 1, ... (every element of a row alike)."""
    numbers = np.arange(first, first + count).astype(kind.dtype)
    return np.broadcast_to(numbers.reshape(-1, *[1] * len(kind.shape)), (count, *kind.shape)).copy()
