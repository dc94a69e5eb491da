"""Chain RNNs: recurrent layers unfolded over a sequence of tokens (through an embedding) or vectors.

Node (layer l, step t) reads layer l-1's h at step t (the input for layer 0) and its own
layer's state at step t-1; each layer is its own cell type because it has its own weights.
A bidirectional layer adds a reverse cell type scanning from the last step to the first, and
the layer above reads both directions at step t (two inputs, no concatenation). An optional
linear head over the final output is a cell type of its own, so the heads of many requests batch
together; a head at every step (`per_step`) rides on the last layer's cells instead: each direction's
cell also emits its h beside its part of the head (the head's columns for that direction, the bias
on the forward part), and the reply adds the parts, so a step costs no cell and no task of its own.
Weights use
torch.nn.Embedding + torch.nn.LSTM / torch.nn.GRU (+ torch.nn.Linear) state_dict names
(`embedding.weight`, `<rnn>.weight_ih_l0`, `<rnn>.weight_hh_l0`, `<rnn>.bias_ih_l0`,
`<rnn>.bias_hh_l0`, `_l0_reverse`, then `_l1`, ..., `head.weight`, `head.bias`), so a model trained
as `self.embedding = nn.Embedding(...); self.<rnn> = nn.LSTM(...); self.head = nn.Linear(...)` is
served by saving its state_dict.

This module is the planner (numpy): how a request unfolds. The cells, served by workers, are
in common/models/chain_cells.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchmaker.common.config import ConfigError, ModelConfig
from batchmaker.common.graph import ZERO, CellGraph, CellTypeSpec, External, NodeOutput, NodeSpec, ValueKind
from batchmaker.common.models.base import (
    FOLD_KEY,
    PlanCache,
    Planner,
    check_params,
    int_param,
    padded_length,
    token_ids,
)
from batchmaker.common.models.vectors import float_rows
from batchmaker.common.plan import Plan, Unfolded, compile_graph
from batchmaker.common.protocol import BAD_REQUEST, INVALID_INPUT, RequestError

TOKEN = ValueKind("int64", ())
KEYS = {"vocab_size", "input_size", "embedding_size", "hidden_size", "num_layers", "max_length", "per_step"}
KEYS |= {"bidirectional", "head_size", FOLD_KEY}


class ChainPlanner(Planner):
    """The shared unfolding and validation of LSTM and GRU chains."""

    state_names: tuple[str, ...]  # recurrent state per layer: `h` (and `c`), also the reply's outputs

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        params = config.params
        check_params(params, KEYS, self.name)
        if ("vocab_size" in params) == ("input_size" in params):
            raise ConfigError(
                f"[models.{self.name}] give vocab_size (token inputs) or input_size (vector inputs x), "
                "not both or neither"
            )
        if "input_size" in params and "embedding_size" in params:
            raise ConfigError(f"[models.{self.name}] embedding_size applies to token inputs (vocab_size) only")
        self.hidden_size = int_param(params, "hidden_size", self.name)
        if "vocab_size" in params:
            self.vocab_size: int | None = int_param(params, "vocab_size", self.name)
            self.embedding_size = int_param(params, "embedding_size", self.name, default=self.hidden_size)
            self.input_size: int | None = None
            self.input_kind = TOKEN
            self._padding: Any = 0  # the padding token
        else:
            self.vocab_size = None
            self.input_size = self.embedding_size = int_param(params, "input_size", self.name)
            self.input_kind = ValueKind("float32", (self.input_size,))
            self._padding = np.zeros(self.input_size, np.float32)
        self.num_layers = int_param(params, "num_layers", self.name, default=1)
        self.max_length = int_param(params, "max_length", self.name, default=1000)
        self.per_step = bool_param(params, "per_step", self.name)
        self.directions = 2 if bool_param(params, "bidirectional", self.name) else 1
        self.head_size = int_param(params, "head_size", self.name) if "head_size" in params else None
        self.state_kind = state = ValueKind("float32", (self.hidden_size,))
        self.step_heads = self.per_step and self.head_size is not None  # the head rides on the last layer's cells
        self._cell_types = {}
        states = (state,) * len(self.state_names)
        for layer in range(self.num_layers):
            below = (self.input_kind,) if layer == 0 else (state,) * self.directions
            outputs = states
            if self.step_heads and layer == self.num_layers - 1:
                outputs += (ValueKind("float32", (self.hidden_size + self.head_size,)),)  # [h, its head part]
            for direction in ("", "_reverse")[: self.directions]:
                spec = self._cell_type(f"layer{layer}{direction}", (*below, *states), outputs)
                self._cell_types[spec.key] = spec
        self.layer_keys = list(self._cell_types)  # by h_n row: layer * directions + direction
        if self.head_size is not None and not self.step_heads:
            spec = self._cell_type("head", (state,) * self.directions, (ValueKind("float32", (self.head_size,)),))
            self._cell_types[spec.key] = spec
            self.head_key = spec.key
        finals = range(self.final_rows)
        self.final_names = {name: tuple(f"{name}_n{i}" for i in finals) for name in self.state_names}
        self.top = (self.num_layers - 1) * self.directions  # the last layer's forward direction in h_n
        self.plan_cache = PlanCache()  # by length, padded length (and the initial states given, if any)
        self._step_names: dict[int, tuple[tuple[str, ...], ...]] = {}  # per_step results by length

    @property
    def cell_types(self) -> dict[str, CellTypeSpec]:
        return self._cell_types

    @property
    def final_rows(self) -> int:
        """Rows of h_n (and of h0): one per layer and direction."""
        return self.num_layers * self.directions

    def describe(self) -> dict[str, Any]:
        def f32(*shape: int) -> dict[str, Any]:
            return {"dtype": "float32", "shape": list(shape)}

        if self.vocab_size is None:
            inputs = {"x": {**f32(-1, self.embedding_size), "max_length": self.max_length}}
        else:
            inputs = {"tokens": {"dtype": "int64", "shape": [-1], "max_length": self.max_length}}
        states = f32(self.final_rows, self.hidden_size)
        inputs.update({f"{name}0": {**states, "optional": True} for name in self.state_names})
        outputs = {name: f32(self.hidden_size) for name in self.state_names}
        outputs.update({f"{name}_n": states for name in self.state_names})
        if self.per_step:
            outputs["y"] = f32(-1, self.hidden_size * self.directions)
        if self.head_size is not None:
            outputs["logits"] = f32(-1, self.head_size) if self.per_step else f32(self.head_size)
        sizes = {"vocab_size": self.vocab_size} if self.vocab_size is not None else {"input_size": self.input_size}
        return {"kind": self.kind, "inputs": inputs, "outputs": outputs, **sizes}

    can_pad = True

    def unfold(self, inputs: Any) -> CellGraph:
        rows = self.input_rows(inputs)
        return self._unfold(rows, None, self.initial_states(inputs), self._padding)

    def unfold_padded(self, inputs: Any, bucket_width: int) -> CellGraph:
        rows = self.input_rows(inputs)
        return self._unfold(rows, padded_length(len(rows), bucket_width), self.initial_states(inputs), self._padding)

    def plan(self, inputs: Any) -> Unfolded:
        return self._planned(self.input_rows(inputs), None, inputs)

    def plan_padded(self, inputs: Any, bucket_width: int) -> Unfolded:
        rows = self.input_rows(inputs)
        return self._planned(rows, padded_length(len(rows), bucket_width), inputs)

    def input_rows(self, inputs: Any) -> np.ndarray:
        """The request's sequence: its token ids, or its vectors `x` (float32 [T, input_size])."""
        if self.vocab_size is not None:
            return token_ids(inputs, "tokens", self.vocab_size, self.max_length)
        if not isinstance(inputs, dict):
            raise RequestError(BAD_REQUEST, "inputs must be a map")
        if "x" not in inputs:
            raise RequestError(BAD_REQUEST, "inputs lack 'x'")
        return float_rows(inputs["x"], "x", self.embedding_size, max_rows=self.max_length)

    def initial_states(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        """The initial states the request gives (`h0`, `c0`), by state name: float32 [layers * directions, H]."""
        if "h0" not in inputs and "c0" not in inputs:
            return {}
        if "c0" in inputs and "c" not in self.state_names:
            raise RequestError(
                INVALID_INPUT, f"c0 is an LSTM's initial cell state; model {self.name!r} is a {self.kind} and has none"
            )
        return {
            name: float_rows(inputs[f"{name}0"], f"{name}0", self.hidden_size, rows=self.final_rows)
            for name in self.state_names
            if f"{name}0" in inputs
        }

    def _planned(self, rows: np.ndarray, padded: int | None, inputs: dict[str, Any]) -> Unfolded:
        """The cached plan of this shape with the request's input rows (then the padding row, when
        the padded length exceeds the length) and initial states as its externals. The plan's state
        is the length: `outputs` assembles per-step results of this many steps."""
        length = len(rows)
        if padded is not None and padded > length:
            rows = np.concatenate([rows, np.asarray(self._padding, rows.dtype)[None]])
        if "h0" not in inputs and "c0" not in inputs:  # the common case: one plan per length, nothing to gather
            plan = self.plan_cache.get((length, padded), lambda: self._compile(length, padded, ())[0])
            return Unfolded(plan, {self.input_kind: rows}, length)
        initial = self.initial_states(inputs)
        given = tuple(initial)
        plan, order = self.plan_cache.get((length, padded, given), lambda: self._compile(length, padded, given))
        states = np.concatenate(list(initial.values()))
        if self.input_kind == self.state_kind:
            return Unfolded(plan, {self.state_kind: np.concatenate([rows, states])[order]}, length)
        return Unfolded(plan, {self.input_kind: rows, self.state_kind: states[order - len(rows)]}, length)

    def _compile(self, length: int, padded: int | None, given: tuple[str, ...]) -> tuple[Plan, np.ndarray]:
        """The plan of a length, padded length and initial states given (requests differ only in their
        external values), and the order in which it reads the external rows of the state kind, as
        indices into the input rows (the padding row included) followed by the initial states' rows:
        the plan is compiled from rows that hold their own index."""
        labels = labelled(self.input_kind, 0, length + 1)
        count = length + (padded is not None and padded > length)
        initial = {
            name: labelled(self.state_kind, count + i * self.final_rows, self.final_rows)
            for i, name in enumerate(given)
        }
        unfolded = compile_graph(
            self._unfold(labels[:length], padded, initial, labels[length]), self.cell_types, self.name
        )
        read = unfolded.externals[self.input_kind]
        if self.input_kind != self.state_kind and not np.array_equal(read.reshape(count, -1)[:, 0], np.arange(count)):
            raise AssertionError("a chain's plan reads its input rows in order: requests give them as they are")
        states = unfolded.externals.get(self.state_kind, np.zeros((0, self.hidden_size)))
        return unfolded.plan, states.reshape(-1, self.hidden_size)[:, 0].astype(np.int64)

    def _unfold(
        self, rows: np.ndarray, padded_length: int | None, initial: dict[str, np.ndarray], padding: Any
    ) -> CellGraph:
        """Layers of steps over the input rows, then padding steps on the `padding` row up to `padded_length`.

        The forward direction's padding continues its chain after the last step; the reverse
        direction's would come first in its scan, so it runs as a chain of its own from zeros that
        nothing the answer reads depends on. Written for speed: benchmarks unfold every request."""
        graph = CellGraph()
        graph.externals = rows.tolist()
        length = graph.state = len(rows)
        below: list[tuple[Any, ...]] = [(External(i),) for i in range(length)]
        pads: list[tuple[Any, ...]] = []
        if padded_length is not None and padded_length > length:
            graph.externals.append(padding)
            pads = [(External(length),)] * (padded_length - length)
        first_state = len(graph.externals)
        for values in initial.values():
            graph.externals.extend(values)
        zeros = (ZERO,) * len(self.state_names)
        for layer in range(self.num_layers):
            outputs, padded_outputs = [], []
            for direction in range(self.directions):
                row = layer * self.directions + direction
                key = self.layer_keys[row]
                out, final = self._scan(graph, key, below, self._start(row, initial, first_state), direction)
                for name, value in zip(self.state_names, final):
                    graph.results[self.final_names[name][row]] = value
                padded_out, _ = self._scan(graph, key, pads, zeros if direction else final, direction)
                if direction == 0:
                    graph.last_padding = len(graph.nodes) - 1  # the last layer's is the deepest padding node
                outputs.append(out)
                padded_outputs.append(padded_out)
            below, pads = list(zip(*outputs)), list(zip(*padded_outputs))
        self._add_outputs(graph, below)
        if padded_length is None:
            graph.last_padding = None
        else:
            graph.padded_length = padded_length
        return graph

    def _scan(
        self, graph: CellGraph, key: str, inputs: list[tuple[Any, ...]], state: tuple[Any, ...], reverse: int
    ) -> tuple[list[Any], tuple[Any, ...]]:
        """One direction of one layer over `inputs` (from the last step when `reverse`): each step's h
        by step, and the final state."""
        nodes = graph.nodes
        ports = range(len(self.state_names))
        outputs: list[Any] = [None] * len(inputs)
        for step in range(len(inputs) - 1, -1, -1) if reverse else range(len(inputs)):
            node = len(nodes)
            nodes.append(NodeSpec(key, (*inputs[step], *state)))
            state = tuple([NodeOutput(node, port) for port in ports])
            outputs[step] = state[0]
        return outputs, state

    def _add_outputs(self, graph: CellGraph, top: list[tuple[Any, ...]]) -> None:
        """Results beyond the final states: the last layer's output at every step and the head."""
        if self.per_step:
            names = self.step_names(len(top))
            port = len(self.state_names) if self.step_heads else 0  # [h, head part] or h
            for direction in range(self.directions):
                graph.results.update(zip(names[direction], [NodeOutput(step[direction].node, port) for step in top]))
        elif self.head_size is not None:
            finals = [graph.results[name] for name in self.final_names["h"][self.top :]]
            graph.results["logits"] = NodeOutput(graph.add_node(self.head_key, *finals))

    def _start(self, row: int, initial: dict[str, np.ndarray], first_state: int) -> tuple[Any, ...]:
        """The initial state of h_n row `row`: the given initial states' external rows, else zeros."""
        if not initial:
            return (ZERO,) * len(self.state_names)
        given = {name: External(first_state + i * self.final_rows + row) for i, name in enumerate(initial)}
        return tuple(given.get(name, ZERO) for name in self.state_names)

    def step_names(self, length: int) -> tuple[tuple[str, ...], ...]:
        """The per-step results (`per_step`), made once per length: the last layer's output of each
        direction at every step (beside that direction's part of the head when there is one)."""
        names = self._step_names.get(length)
        if names is None:
            prefixes = ("y", "y_reverse")[: self.directions]
            names = self._step_names[length] = tuple(
                tuple(f"{prefix}{t}" for t in range(length)) for prefix in prefixes
            )
        return names

    def outputs(self, graph: CellGraph | Unfolded, results: dict[str, np.ndarray]) -> dict[str, Any]:
        """`h` (and `c`): the last layer's final (forward) state; `h_n` (and `c_n`): every layer's and
        direction's, as nn.LSTM orders them; with `per_step`, `y`: nn.LSTM's `output`; with a head, `logits`."""
        reply: dict[str, Any] = {}
        for name, finals in self.final_names.items():
            rows = [results[key] for key in finals]
            reply[name] = rows[self.top]
            reply[f"{name}_n"] = np.array(rows)  # rows of one shape: np.stack's checks cost more than the copy
        if self.per_step:
            reply.update(self._step_rows(graph.state, results, 0, graph.state))
        elif self.head_size is not None:
            reply["logits"] = results["logits"]
        return reply

    def _step_rows(self, length: int, results: dict[str, np.ndarray], start: int, end: int) -> dict[str, np.ndarray]:
        """`y` (and the head's `logits`: the sum of the directions' parts) of steps `start` to `end` - 1,
        from their per-step results."""
        columns = [np.stack([results[key] for key in names[start:end]]) for names in self.step_names(length)]
        hidden = self.hidden_size
        y = [column[:, :hidden] for column in columns]
        rows = {"y": np.ascontiguousarray(y[0]) if self.directions == 1 else np.concatenate(y, axis=1)}
        if self.step_heads:
            logits = rows["logits"] = columns[0][:, hidden:].copy()
            for column in columns[1:]:
                logits += column[:, hidden:]
        return rows

    @property
    def can_stream(self) -> bool:  # type: ignore[override]
        return self.per_step

    def partial_outputs(
        self, graph: CellGraph | Unfolded, results: dict[str, np.ndarray], start: int
    ) -> dict[str, Any] | None:
        """With `per_step`: the rows of `y` (and `logits`) from `start` up to the first step not yet final. A
        step's row is final once all its results are read: both directions' outputs (with their head parts); a
        bidirectional model's first rows wait for the reverse direction to reach them."""
        length = graph.state
        columns = self.step_names(length)
        end = start
        while end < length and all(names[end] in results for names in columns):
            end += 1
        return self._step_rows(length, results, start, end) if end > start else None


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
