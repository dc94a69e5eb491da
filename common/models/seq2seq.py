"""Seq2Seq with a "feed previous" greedy decoder (the paper's section 7.4).

Two cell types with separate weights:
* `encoder`: source token, h, c -> h, c (embedding + LSTM cell);
* `decoder`: previous token, h, c -> h, c, next token (embedding + LSTM cell +
  projection to the target vocabulary + argmax, all on the device).

With `num_layers = L` > 1 each side stacks L LSTM layers, each its own cell type (`encoder_l1`,
`decoder_l1`, ...): layer l reads layer l-1's h, the decoder's layer l starts from the encoder's
final state of layer l (as stacked torch.nn.LSTMs would), and the top decoder layer projects and
takes the argmax. With `attention = "luong"` the top decoder layer also reads every encoder
output of its request (the top encoder layer's h at each source step) on a ragged input port:
Luong et al.'s global attention with the "general" score and no input feeding,

    s = enc @ (W_a h_t)    a = softmax(s)    ctx = a @ enc    h~ = tanh(W_c [ctx; h_t])

and the projection and argmax apply to h~, while h_t goes on to the next step. The port takes
each request's own source length, so decoder steps of requests with different source lengths
share one task; the encoder outputs stay in their registers until the last decoder step.

The first decoder step reads the GO token and the encoder's final state; each later
step reads the previous step's argmax straight from the device arena, so decoder
steps are issued ahead of time like encoder steps. The graph is unfolded up to the
request's maximum decoding length. The top decoder layer declares its stop (EOS on
its token output), which the worker applies on the device: a lane past its EOS keeps
its state and repeats EOS, with no host sync. The host learns of it from each step's
token, copied back and observed: at EOS the request is answered while steps already
issued past it finish and free their slots.

Weights file keys: `encoder.embedding.weight` [src_vocab, emb], `encoder.lstm.*_l0`
and `decoder.lstm.*_l0` (torch.nn.LSTM names: weight_ih_l0, weight_hh_l0, bias_ih_l0,
bias_hh_l0), `decoder.embedding.weight` [tgt_vocab, emb], `decoder.projection.weight`
[tgt_vocab, hidden], `decoder.projection.bias` [tgt_vocab]; layers above the first have
`*.lstm.*_l1`, ... with a [4 hidden, hidden] weight_ih; attention adds `decoder.attention.weight`
[hidden, hidden] (W_a) and `decoder.combine.weight` [hidden, 2 hidden] (W_c), without biases.

This module is the planner (numpy); the cells are in common/models/seq2seq_cells.py, where
workers serve the kernels of common/models/kernels.py: both cells read a token, so both fold
their embedding into their input projection; `torch_nn_cells` are the plain cells.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchmaker.common.config import ConfigError, ModelConfig
from batchmaker.common.graph import ZERO, CellGraph, CellTypeSpec, NodeOutput, Ragged, Stop, ValueKind
from batchmaker.common.models.base import (
    FOLD_KEY,
    Model,
    PlanCache,
    Planner,
    check_params,
    int_param,
    model_named,
    padded_length,
    token_ids,
)
from batchmaker.common.plan import Plan, Unfolded, compile_graph
from batchmaker.common.protocol import INVALID_INPUT, RequestError

TOKEN = ValueKind("int64", ())
ATTENTION_KINDS = ("luong",)
MEMORY_PORT = 3  # the attention decoder's ragged input: its request's encoder outputs


class Decoded:
    """What a request has decoded so far; steps may be observed out of order, tokens are kept in order."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.seen: dict[int, int] = {}
        self.tokens: list[int] = []
        self.finished = False


class Seq2SeqPlanner(Planner):
    """Source tokens in, greedy decoding until EOS or `max_len`: cell types, plans and the stop decision."""

    kind = "seq2seq"

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        params = config.params
        allowed = {
            "src_vocab_size",
            "tgt_vocab_size",
            "embedding_size",
            "hidden_size",
            "max_length",
            "max_decode_length",
            "extra_decode_steps",
            "go_id",
            "eos_id",
            "num_layers",
            "attention",
            FOLD_KEY,
        }
        check_params(params, allowed, self.name)
        self.src_vocab_size = int_param(params, "src_vocab_size", self.name)
        self.tgt_vocab_size = int_param(params, "tgt_vocab_size", self.name)
        self.hidden_size = int_param(params, "hidden_size", self.name)
        self.embedding_size = int_param(params, "embedding_size", self.name, default=self.hidden_size)
        self.max_length = int_param(params, "max_length", self.name, default=400)
        self.max_decode_length = int_param(params, "max_decode_length", self.name, default=200)
        self.extra_decode_steps = int_param(params, "extra_decode_steps", self.name, default=10, minimum=0)
        self.go_id = int_param(params, "go_id", self.name, default=2, minimum=0)
        self.eos_id = int_param(params, "eos_id", self.name, default=3, minimum=0)
        self.num_layers = int_param(params, "num_layers", self.name, default=1)
        self.attention = params.get("attention")
        if self.attention is not None and self.attention not in ATTENTION_KINDS:
            raise ConfigError(
                f"[models.{self.name}] attention must be one of {list(ATTENTION_KINDS)} (or left out for none), "
                f"got {self.attention!r}"
            )
        self._cell_types = {}
        self.encoder_keys = [self._add_layer("encoder", layer) for layer in range(self.num_layers)]
        self.decoder_keys = [self._add_layer("decoder", layer) for layer in range(self.num_layers)]
        self.encoder_key, self.decoder_key = self.encoder_keys[0], self.decoder_keys[-1]
        self.plan_cache = PlanCache()  # by source length, max_len, bucket

    @staticmethod
    def layer_cell(part: str, layer: int) -> str:
        """The cell name of one layer: `encoder`, `encoder_l1`, ... (`decoder`, ... likewise)."""
        return part if layer == 0 else f"{part}_l{layer}"

    def _add_layer(self, part: str, layer: int) -> str:
        """Register the cell type of one layer: the first reads a token, the others the h below; the
        top decoder layer also emits the next token and, with attention, reads the encoder outputs."""
        state = ValueKind("float32", (self.hidden_size,))
        inputs: tuple[ValueKind, ...] = (TOKEN if layer == 0 else state, state, state)
        outputs: tuple[ValueKind, ...] = (state, state)
        ragged: frozenset[int] = frozenset()
        stop = None
        if part == "decoder" and layer == self.num_layers - 1:
            outputs += (TOKEN,)
            stop = Stop(2, self.eos_id)
            if self.attention is not None:
                inputs += (state,)
                ragged = frozenset({MEMORY_PORT})
        spec = self._cell_type(self.layer_cell(part, layer), inputs, outputs, ragged, stop)
        self._cell_types[spec.key] = spec
        return spec.key

    @property
    def cell_types(self) -> dict[str, CellTypeSpec]:
        return self._cell_types

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "inputs": {
                "tokens": {"dtype": "int64", "shape": [-1], "max_length": self.max_length},
                "max_len": {"dtype": "int64", "shape": [], "optional": True, "max": self.max_decode_length},
            },
            "outputs": {"tokens": {"dtype": "int64", "shape": [-1]}},
            "vocab_size": self.src_vocab_size,
            "target_vocab_size": self.tgt_vocab_size,
            "eos_id": self.eos_id,
        }

    def _max_len(self, inputs: dict[str, Any], source_length: int) -> int:
        if "max_len" not in inputs:
            return min(source_length + self.extra_decode_steps, self.max_decode_length)
        max_len = inputs["max_len"]
        if not isinstance(max_len, int) or isinstance(max_len, bool) or not 1 <= max_len <= self.max_decode_length:
            raise RequestError(INVALID_INPUT, f"max_len must be an integer from 1 to {self.max_decode_length}")
        return max_len

    can_pad = True

    def unfold(self, inputs: Any) -> CellGraph:
        return self._unfold(inputs, None)

    def plan(self, inputs: Any) -> Unfolded:
        return self._planned(inputs, None)

    def plan_padded(self, inputs: Any, bucket_width: int) -> Unfolded:
        return self._planned(inputs, bucket_width)

    def _planned(self, inputs: Any, bucket_width: int | None) -> Unfolded:
        """A plan per (source length, decoding length, bucket): requests differ in their tokens only.
        Externals in plan order: the source, the padding token (if padding steps run), GO."""
        source = token_ids(inputs, "tokens", self.src_vocab_size, self.max_length)
        max_len = self._max_len(inputs, len(source))
        plan = self._plan(len(source), max_len, bucket_width)
        padding = [0] if bucket_width is not None and padded_length(len(source), bucket_width) > len(source) else []
        externals = np.concatenate((source, np.array([*padding, self.go_id], np.int64)))
        return Unfolded(plan, {TOKEN: externals}, Decoded(max_len))

    def _plan(self, length: int, max_len: int, bucket_width: int | None) -> Plan:
        def compile_plan() -> Plan:
            graph = self._unfold({"tokens": [0] * length, "max_len": max_len}, bucket_width)
            return compile_graph(graph, self.cell_types, self.name).plan

        return self.plan_cache.get((length, max_len, bucket_width), compile_plan)

    def unfold_padded(self, inputs: Any, bucket_width: int) -> CellGraph:
        return self._unfold(inputs, bucket_width)

    def _unfold(self, inputs: Any, bucket_width: int | None) -> CellGraph:
        """Encoder steps layer by layer, then decoder steps up to max_len. Padded, the encoder runs on
        to the next multiple of `bucket_width` and the decoder starts after the padding ends, from the
        state at the true end of the source (attention reads the true steps' outputs only)."""
        source = token_ids(inputs, "tokens", self.src_vocab_size, self.max_length)
        max_len = self._max_len(inputs, len(source))
        graph = CellGraph(state=Decoded(max_len))
        below: list[Any] = [graph.add_external(token) for token in source]
        if bucket_width is not None:
            graph.padded_length = padded_length(len(source), bucket_width)
            below += [graph.add_external(np.int64(0))] * (graph.padded_length - len(source))
        finals: list[tuple[Any, Any]] = []
        for key in self.encoder_keys:
            h: Any = ZERO
            c: Any = ZERO
            outputs = []
            for step, x in enumerate(below):
                node = graph.add_node(key, x, h, c)
                h, c = NodeOutput(node, 0), NodeOutput(node, 1)
                outputs.append(h)
                if step == len(source) - 1:
                    finals.append((h, c))
            below = outputs
        after: tuple[int, ...] = ()
        if bucket_width is not None:
            graph.last_padding = len(graph.nodes) - 1
            after = (graph.last_padding,)
        memory = (Ragged(tuple(below[: len(source)])),) if self.attention is not None else ()
        top = self.num_layers - 1
        previous: Any = graph.add_external(np.int64(self.go_id))
        for _ in range(max_len):
            x = previous
            for layer, key in enumerate(self.decoder_keys):
                h, c = finals[layer]
                node = graph.add_node(
                    key, x, h, c, *(memory if layer == top else ()), after=after if layer == 0 else ()
                )
                finals[layer] = NodeOutput(node, 0), NodeOutput(node, 1)
                x = finals[layer][0]
            previous = NodeOutput(node, 2)
            graph.watch.append(previous)
            after = ()
        return graph

    def observe(self, graph: CellGraph, watch_index: int, value: np.ndarray) -> bool:
        decoded: Decoded = graph.state
        decoded.seen[watch_index] = int(value)
        while not decoded.finished and len(decoded.tokens) in decoded.seen:
            token = decoded.seen.pop(len(decoded.tokens))
            if token == self.eos_id:
                decoded.finished = True
            else:
                decoded.tokens.append(token)
                decoded.finished = len(decoded.tokens) == decoded.max_len
        return decoded.finished

    def outputs(self, graph: CellGraph, results: dict[str, np.ndarray]) -> dict[str, Any]:
        return {"tokens": np.array(graph.state.tokens, dtype=np.int64)}

    can_stream = True

    def partial_outputs(self, graph: CellGraph, results: dict[str, np.ndarray], start: int) -> dict[str, Any] | None:
        """The tokens decoded in order from `start` on (tokens past a step not yet observed wait for it)."""
        tokens = graph.state.tokens[start:]
        return {"tokens": np.array(tokens, dtype=np.int64)} if tokens else None


def decoding_mismatch(got: np.ndarray, expected: dict[str, Any], near_tie: float = 1e-4) -> str | None:
    """Why served tokens differ from the reference's decoding, or None if they do not.

    Batched and unbatched float32 differ in the last bits, so an argmax at a near-tie can
    flip: a divergence is excused at a step where the reference's top-two logits are
    closer than `near_tie` (its `margins`)."""
    want = np.asarray(expected["tokens"])
    n = min(len(got), len(want))
    diverged = next((i for i in range(n) if got[i] != want[i]), None)
    if diverged is None and len(got) == len(want):
        return None
    step = diverged if diverged is not None else n
    if expected["margins"][step] < near_tie:
        return None
    return f"decoded {np.asarray(got).tolist()} but the reference gives {want.tolist()}"


def planner(config: ModelConfig) -> Seq2SeqPlanner:
    return Seq2SeqPlanner(config)


def build(config: ModelConfig) -> Model:
    return model_named("batchmaker.common.models.seq2seq_cells:Seq2SeqModel", config)
