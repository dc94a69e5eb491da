"""Chain models' vector inputs x, linear heads and bidirectional layers, in-process and in every
combination with each other and with the features of tests/test_chain_features.py: replies equal
torch.nn.LSTM / torch.nn.GRU, padding feeds nothing the answer reads, weights are named as torch.nn
names them, and bad vectors and configs are refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_chain_features import (
    KINDS,
    TOLERANCE,
    VOCAB,
    assert_replies_equal_reference,
    chain,
    mixed_requests,
    model_config,
)

from batchmaker.common.config import ConfigError
from batchmaker.common.graph import External, NodeOutput
from batchmaker.common.protocol import BAD_REQUEST, INVALID_INPUT, RequestError, tensor_to_map

COMBINATIONS = [
    {"num_layers": layers, **inputs, **direction, **steps, **head}
    for layers in (1, 2)
    for inputs in ({}, {"input_size": 5})
    for direction in ({}, {"bidirectional": True})
    for steps in ({}, {"per_step": True})
    for head in ({}, {"head_size": 3})
]


def label(params: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("params", COMBINATIONS, ids=label)
def test_every_combination_equals_torch(kind: str, params: dict[str, Any]):
    model = chain(kind, **params)
    requests = mixed_requests(model, seed=len(label(params)), count=8)
    assert_replies_equal_reference(model, requests)
    assert_replies_equal_reference(model, requests, bucket_width=4)


@pytest.mark.parametrize("kind", KINDS)
def test_three_bidirectional_layers_over_vectors_as_wide_as_the_state(kind: str):
    """input_size = hidden_size: inputs and initial states share one value kind (and one externals array)."""
    model = chain(kind, input_size=8, num_layers=3, bidirectional=True, per_step=True, head_size=2)
    assert model.input_kind == model.state_kind
    requests = mixed_requests(model, seed=4)
    assert_replies_equal_reference(model, requests)
    assert_replies_equal_reference(model, requests, bucket_width=6)


def test_bidirectional_reply_layout_matches_torch():
    model = chain("lstm", num_layers=2, bidirectional=True, per_step=True)
    reply = model.reference(model.init_weights(5), {"tokens": [1, 2, 3, 4]})
    assert reply["h_n"].shape == reply["c_n"].shape == (4, 8)
    assert reply["y"].shape == (4, 16)
    assert np.array_equal(reply["h"], reply["h_n"][2])  # the last layer's forward direction
    assert np.array_equal(reply["y"][-1, :8], reply["h_n"][2])
    assert np.array_equal(reply["y"][0, 8:], reply["h_n"][3])


def test_head_over_the_final_state_and_over_every_step():
    final = chain("gru", bidirectional=True, head_size=3)
    state = final.init_weights(5)
    reply = final.reference(state, {"tokens": [4, 2, 7]})
    weight, bias = state["head.weight"].numpy(), state["head.bias"].numpy()
    both = np.concatenate([reply["h_n"][0], reply["h_n"][1]])
    assert reply["logits"].shape == (3,)
    assert np.abs(reply["logits"] - (weight @ both + bias)).max() <= TOLERANCE
    per_step = chain("gru", bidirectional=True, head_size=3, per_step=True).reference(state, {"tokens": [4, 2, 7]})
    assert per_step["logits"].shape == (3, 3)
    assert np.abs(per_step["logits"] - (per_step["y"] @ weight.T + bias)).max() <= TOLERANCE


def test_heads_of_many_requests_run_as_one_cell_type():
    model = chain("lstm", bidirectional=True, head_size=3)
    plan = model.plan({"tokens": [1, 2, 3, 4]}).plan
    assert plan.lane_cells == ("m/layer0", "m/layer0_reverse", "m/head")
    assert model.cell_types["m/head"].inputs == (model.state_kind, model.state_kind)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_head_at_every_step_rides_on_the_last_layers_cells(layers: int):
    """A per-step head costs no node of its own: a request of T steps runs 2 T cells a layer, and the
    last layer's cells emit [h, their part of the head]."""
    model = chain("lstm", num_layers=layers, bidirectional=True, head_size=3, per_step=True)
    graph = model.unfold({"tokens": [1, 2, 3, 4]})
    assert len(graph.nodes) == 4 * 2 * layers
    assert "m/head" not in model.cell_types
    top = [model.cell_types[key] for key in model.layer_keys[-2:]]
    assert [spec.outputs[-1].shape for spec in top] == [(model.hidden_size + 3,)] * 2


@pytest.mark.parametrize("layers", [1, 3])
def test_padding_feeds_nothing_the_answer_reads(layers: int):
    """Every node a result depends on reads real inputs only, in both directions of every layer."""
    model = chain("lstm", num_layers=layers, bidirectional=True, per_step=True, head_size=2)
    graph = model.unfold_padded({"tokens": [1, 2, 3]}, 8)
    padding = len(graph.externals) - 1
    assert graph.padded_length == 8 and len(graph.nodes) == 8 * 2 * layers
    needed = {ref.node for ref in graph.results.values()}
    pending = list(needed)
    while pending:
        for ref in graph.nodes[pending.pop()].inputs:
            if isinstance(ref, NodeOutput) and ref.node not in needed:
                needed.add(ref.node)
                pending.append(ref.node)
    for node in needed:
        assert External(padding) not in graph.nodes[node].inputs
    padding_nodes = set(range(len(graph.nodes))) - needed
    assert len(padding_nodes) == 5 * 2 * layers
    assert graph.last_padding in padding_nodes


def test_the_default_chain_keeps_its_cells_and_plan():
    """Tokens, one direction, no head: the cell types and the graph are as they always were."""
    model = chain("lstm", num_layers=2)
    assert list(model.cell_types) == ["m/layer0", "m/layer1"]
    graph = model.unfold({"tokens": [1, 2, 3]})
    assert [node.cell_type for node in graph.nodes] == ["m/layer0"] * 3 + ["m/layer1"] * 3
    assert set(graph.results) == {"h_n0", "h_n1", "c_n0", "c_n1"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "params", [{"num_layers": 2, "bidirectional": True, "head_size": 3}, {"input_size": 5, "head_size": 2}]
)
def test_weights_are_named_and_shaped_as_torch_nn_names_them(kind: str, params: dict[str, Any]):
    import torch

    model = chain(kind, **params)
    rnn = model.reference_rnn()
    expected = {f"{model.rnn_name}.{key}": tuple(value.shape) for key, value in rnn.state_dict().items()}
    head = torch.nn.Linear(8 * model.directions, params["head_size"])
    expected.update({f"head.{key}": tuple(value.shape) for key, value in head.state_dict().items()})
    if "input_size" not in params:
        expected["embedding.weight"] = (VOCAB, 6)
    assert model.weight_shapes() == expected
    assert {key: tuple(value.shape) for key, value in model.init_weights(1).items()} == expected
    cells = model.make_cells(model.init_weights(1))
    assert set(cells) == set(model.cell_types) == set(model.torch_nn_cells(model.init_weights(1)))


def test_describe_names_what_each_config_takes_and_returns():
    plain = chain("gru").describe()
    assert plain["inputs"].keys() == {"tokens", "h0"} and plain["outputs"].keys() == {"h", "h_n"}
    full = chain("lstm", input_size=5, num_layers=2, bidirectional=True, per_step=True, head_size=3).describe()
    assert full["input_size"] == 5 and "vocab_size" not in full
    assert full["inputs"]["x"] == {"dtype": "float32", "shape": [-1, 5], "max_length": 40}
    assert full["inputs"]["c0"] == {"dtype": "float32", "shape": [4, 8], "optional": True}
    assert full["outputs"]["y"] == {"dtype": "float32", "shape": [-1, 16]}
    assert full["outputs"]["logits"] == {"dtype": "float32", "shape": [-1, 3]}
    assert full["outputs"]["c_n"] == {"dtype": "float32", "shape": [4, 8]}
    assert chain("lstm", head_size=3).describe()["outputs"]["logits"] == {"dtype": "float32", "shape": [3]}


BAD_X = [
    ({"x": np.zeros((0, 5), np.float32)}, "x is empty; send at least one row"),
    ({"x": []}, "x is empty; send at least one row"),
    ({"x": np.zeros((41, 5), np.float32)}, "x has 41 rows; this model accepts at most 40"),
    ({"x": [[0.0] * 5] * 41}, "x has 41 rows; this model accepts at most 40"),
    ({"x": np.zeros((3, 4), np.float32)}, "x must have shape [T, 5], got [3, 4]"),
    ({"x": np.zeros(5, np.float32)}, "x must have 2 dimension(s)"),
    ({"x": np.zeros((3, 5), np.int64)}, "x must be a float32 tensor [T, 5], got int64"),
    ({"x": [[0.0] * 5, [0.0, float("nan"), 0.0, 0.0, 0.0]]}, "x[1][1] = nan is not a finite float32"),
    ({"x": [[0.0] * 5, [0.0] * 4 + [float("-inf")]]}, "x[1][4] = -inf is not a finite float32"),
    ({"x": [[0.0] * 5, [0.0] * 4]}, "x must be a [T, 5] list of equally long rows of numbers"),
    ({"x": [1, 2, 3]}, "x must be a [T, 5] list of rows of numbers"),
    ({"x": "abc"}, "x must be a [T, 5] float32 tensor map or a list of rows of numbers"),
]


@pytest.mark.parametrize(("inputs", "message"), BAD_X)
def test_bad_vectors_are_invalid_input(inputs: dict[str, Any], message: str):
    model = chain("gru", input_size=5, bidirectional=True)
    given = {k: tensor_to_map(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    for plan in (model.plan, model.unfold, lambda request: model.plan_padded(request, 4)):
        with pytest.raises(RequestError) as caught:
            plan(given)
        assert caught.value.code == INVALID_INPUT
        assert message in caught.value.message


def test_a_vector_model_needs_x():
    model = chain("lstm", input_size=5)
    with pytest.raises(RequestError) as caught:
        model.plan({"tokens": [1, 2]})
    assert caught.value.code == BAD_REQUEST and "inputs lack 'x'" in caught.value.message


BAD_CONFIGS = [
    ({"hidden_size": 8}, "give vocab_size (token inputs) or input_size (vector inputs x), not both or neither"),
    ({"hidden_size": 8, "vocab_size": 10, "input_size": 4}, "not both or neither"),
    (
        {"hidden_size": 8, "input_size": 4, "embedding_size": 4},
        "embedding_size applies to token inputs (vocab_size) only",
    ),
    ({"hidden_size": 8, "input_size": 0}, "input_size must be an integer >= 1, got 0"),
    ({"hidden_size": 8, "vocab_size": 10, "bidirectional": "yes"}, "bidirectional must be true or false, got 'yes'"),
    ({"hidden_size": 8, "vocab_size": 10, "head_size": 0}, "head_size must be an integer >= 1, got 0"),
    ({"hidden_size": 8, "vocab_size": 10, "heads": 2}, "unknown key(s) ['heads']"),
]


@pytest.mark.parametrize(("params", "message"), BAD_CONFIGS)
def test_bad_chain_configs_are_config_errors(params: dict[str, Any], message: str):
    for kind in KINDS.values():
        with pytest.raises(ConfigError) as caught:
            kind(model_config(params))
        assert message in str(caught.value)


@pytest.mark.parametrize("kind", KINDS)
def test_served_kernels_equal_the_torch_nn_cells(kind: str):
    """Pair projections (layers above a bidirectional one), vector projections and the head compute
    what the plain torch.nn cells (concatenating, then nn.LSTMCell / nn.GRUCell / nn.Linear) do."""
    import torch

    for params in (
        {"input_size": 5, "num_layers": 2, "bidirectional": True, "head_size": 3},
        {"num_layers": 2, "bidirectional": True},
    ):
        model = chain(kind, **params)
        state = model.init_weights(3)
        served, plain = model.make_cells(state), model.torch_nn_cells(state)
        generator = torch.Generator().manual_seed(0)
        for key, spec in model.cell_types.items():
            args = [
                torch.randint(0, VOCAB, (4,), generator=generator)
                if kind_.dtype == "int64"
                else torch.randn(4, *kind_.shape, generator=generator)
                for kind_ in spec.inputs
            ]
            with torch.inference_mode():
                got, expected = served[key](*args), plain[key](*args)
            got = (got,) if isinstance(got, torch.Tensor) else got
            expected = (expected,) if isinstance(expected, torch.Tensor) else expected
            for a, b in zip(got, expected, strict=True):
                assert (a - b).abs().max() <= TOLERANCE, key
