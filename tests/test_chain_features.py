"""Chain models' optional features, in-process: final states h_n/c_n, initial states h0/c0 and
per-step outputs y. Vector inputs x, a linear head, bidirectional layers and every combination of
the features are in tests/test_chain_combinations.py.

Every reply of plans batched together (tests/plan_runner.py) equals torch.nn.LSTM / torch.nn.GRU
run on that request alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from plan_runner import run_plans

from batchmaker.common.config import CellTypeConfig, ConfigError, ModelConfig
from batchmaker.common.models.chain_cells import ChainModel, GRUModel, LSTMModel
from batchmaker.common.protocol import INVALID_INPUT, RequestError, map_to_tensor, tensor_to_map

TOLERANCE = 1e-5
VOCAB = 50
KINDS = {"lstm": LSTMModel, "gru": GRUModel}


def chain(kind: str, **params: Any) -> ChainModel:
    """A small chain: tokens through an embedding unless `input_size` is given."""
    defaults = {"hidden_size": 8, "max_length": 40}
    if "input_size" not in params:
        defaults.update(vocab_size=VOCAB, embedding_size=6)
    return KINDS[kind](model_config({**defaults, **params}))


def model_config(params: dict[str, Any]) -> ModelConfig:
    return ModelConfig("m", "unused:build", Path("unused.pt"), params, CellTypeConfig((1, 2, 4, 8), 0), {})


def initial(model: ChainModel, rng: np.random.Generator) -> dict[str, Any]:
    """Random initial states as tensor maps."""
    shape = (model.final_rows, model.hidden_size)
    return {f"{name}0": tensor_to_map(rng.standard_normal(shape).astype(np.float32)) for name in model.state_names}


def mixed_requests(model: ChainModel, seed: int, count: int = 12) -> list[dict[str, Any]]:
    """Requests of mixed lengths, some with initial states (all, some, as lists or tensor maps), some without."""
    rng = np.random.default_rng(seed)
    requests = []
    for index in range(count):
        length = int(rng.integers(1, 15))
        request = sequence(model, rng, length, as_list=index % 2 == 0)
        states = initial(model, rng)
        if index % 3 == 1:
            request.update(states)
        elif index % 3 == 2:
            request["h0"] = map_to_tensor(states["h0"]).tolist()
        requests.append(request)
    return requests


def sequence(model: ChainModel, rng: np.random.Generator, length: int, as_list: bool = True) -> dict[str, Any]:
    """A request's sequence: tokens, or vectors x (nested lists or a tensor map)."""
    if model.vocab_size is not None:
        return {"tokens": rng.integers(0, VOCAB, size=length).tolist()}
    x = rng.standard_normal((length, model.embedding_size)).astype(np.float32)
    return {"x": x.tolist() if as_list else tensor_to_map(x)}


def assert_replies_equal_reference(model: ChainModel, requests: list[dict[str, Any]], bucket_width: int | None = None):
    state = model.init_weights(5)
    if bucket_width is None:
        planned = [model.plan(request) for request in requests]
    else:
        planned = [model.plan_padded(request, bucket_width) for request in requests]
    replies = run_plans(model, model.make_cells(state), planned)
    for reply, request in zip(replies, requests):
        expected = model.reference(state, request)
        assert reply.keys() == expected.keys()
        for name, value in expected.items():
            assert reply[name].dtype == np.float32
            assert reply[name].shape == value.shape, name
            assert np.abs(reply[name] - value).max() <= TOLERANCE, name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layers", [1, 3])
def test_final_and_initial_states_equal_torch(kind: str, layers: int):
    model = chain(kind, num_layers=layers)
    requests = mixed_requests(model, seed=layers)
    assert_replies_equal_reference(model, requests)
    reply = model.reference(model.init_weights(5), requests[0])
    assert reply[f"{model.state_names[0]}_n"].shape == (layers, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_final_and_initial_states_under_padding(kind: str):
    model = chain(kind, num_layers=2)
    assert_replies_equal_reference(model, mixed_requests(model, seed=9), bucket_width=4)


def test_initial_states_change_the_answer_and_zeros_do_not():
    model = chain("lstm", num_layers=2)
    state = model.init_weights(5)
    cells = model.make_cells(state)
    tokens = [3, 1, 4, 1, 5]
    zeros = {"h0": np.zeros((2, 8), np.float32).tolist(), "c0": np.zeros((2, 8), np.float32).tolist()}
    given = initial(model, np.random.default_rng(1))
    plain, with_zeros, with_states = run_plans(
        model,
        cells,
        [
            model.plan({"tokens": tokens}),
            model.plan({"tokens": tokens, **zeros}),
            model.plan({"tokens": tokens, **given}),
        ],
    )
    assert np.array_equal(plain["h_n"], with_zeros["h_n"])
    assert np.abs(plain["h_n"] - with_states["h_n"]).max() > 1e-3


def test_plans_are_cached_by_length_and_the_initial_states_given():
    model = chain("lstm", num_layers=2)
    rng = np.random.default_rng(2)
    states = initial(model, rng)
    model.plan({"tokens": [1, 2, 3]})
    model.plan({"tokens": [4, 5, 6]})
    assert model.plan_cache.misses == 1
    with_h0 = model.plan({"tokens": [1, 2, 3], "h0": states["h0"]})
    assert model.plan_cache.misses == 2
    assert with_h0.plan is model.plan({"tokens": [7, 8, 9], "h0": map_to_tensor(states["h0"]).tolist()}).plan
    model.plan({"tokens": [1, 2, 3], **states})
    model.plan({"tokens": [1, 2, 3], "c0": states["c0"]})
    assert model.plan_cache.misses == 4


def test_the_unfolded_graph_reads_the_initial_states():
    model = chain("gru", num_layers=2)
    h0 = initial(model, np.random.default_rng(3))["h0"]
    graph = model.unfold({"tokens": [1, 2], "h0": h0})
    assert set(graph.results) == {"h_n0", "h_n1"}
    assert np.array_equal(np.stack(graph.externals[2:]), map_to_tensor(h0))


BAD_STATES = [
    ({"h0": np.zeros((1, 8), np.float32)}, "h0 must have shape [2, 8], got [1, 8]"),
    ({"h0": np.zeros((2, 7), np.float32)}, "h0 must have shape [2, 8], got [2, 7]"),
    ({"c0": np.zeros((3, 8), np.float32)}, "c0 must have shape [2, 8], got [3, 8]"),
    ({"h0": np.zeros((2, 8), np.float64)}, "h0 must be a float32 tensor [2, 8], got float64"),
    ({"h0": np.zeros((2, 8, 1), np.float32)}, "h0 must have 2 dimension(s)"),
    ({"h0": [[0.0] * 8, [float("nan")] + [0.0] * 7]}, "h0[1][0] = nan is not a finite float32"),
    ({"c0": [[0.0] * 8, [0.0] * 7 + [float("inf")]]}, "c0[1][7] = inf is not a finite float32"),
    ({"h0": [[0.0] * 8, [1e39] * 8]}, "h0[1][0] = inf is not a finite float32"),
    ({"h0": [[0.0] * 8, [0.0] * 7]}, "h0 must be a [2, 8] list of equally long rows of numbers"),
    ({"h0": [["a"] * 8] * 2}, "h0 must be a [2, 8] list of rows of numbers"),
    ({"h0": [[True] * 8] * 2}, "h0 must be a [2, 8] list of rows of numbers"),
    ({"h0": [0.0] * 8}, "h0 must be a [2, 8] list of rows of numbers"),
    ({"h0": []}, "h0 must have shape [2, 8], got [0, 0]"),
    ({"h0": "zeros"}, "h0 must be a [2, 8] float32 tensor map or a list of rows of numbers"),
]


@pytest.mark.parametrize(("states", "message"), BAD_STATES)
def test_bad_initial_states_are_invalid_input(states: dict[str, Any], message: str):
    model = chain("lstm", num_layers=2)
    given = {k: tensor_to_map(v) if isinstance(v, np.ndarray) else v for k, v in states.items()}
    for plan in (model.plan, model.unfold, lambda request: model.plan_padded(request, 4)):
        with pytest.raises(RequestError) as caught:
            plan({"tokens": [1, 2, 3], **given})
        assert caught.value.code == INVALID_INPUT
        assert message in caught.value.message


def test_c0_on_a_gru_is_invalid_input():
    model = chain("gru")
    with pytest.raises(RequestError) as caught:
        model.plan({"tokens": [1, 2], "c0": [[0.0] * 8]})
    assert caught.value.code == INVALID_INPUT
    assert "c0 is an LSTM's initial cell state" in caught.value.message


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layers", [1, 2])
def test_per_step_outputs_equal_torch(kind: str, layers: int):
    model = chain(kind, num_layers=layers, per_step=True)
    requests = mixed_requests(model, seed=20 + layers)
    assert_replies_equal_reference(model, requests)
    assert_replies_equal_reference(model, requests, bucket_width=5)
    reply = model.reference(model.init_weights(5), requests[0])
    assert reply["y"].shape == (len(requests[0]["tokens"]), 8)
    assert np.array_equal(reply["y"][-1], reply["h"])


def test_per_step_results_are_copied_only_when_asked():
    assert set(chain("gru").plan({"tokens": [1, 2, 3]}).plan.results) == {"h_n0"}
    per_step = chain("gru", per_step=True).plan({"tokens": [1, 2, 3]}).plan
    assert set(per_step.results) == {"h_n0", "y0", "y1", "y2"}


def test_per_step_must_be_true_or_false():
    with pytest.raises(ConfigError, match="per_step must be true or false, got 1"):
        chain("lstm", per_step=1)
