"""Chain models' optional features through a real server (supervisor, manager, worker processes):
concurrent mixed requests batched together each equal torch.nn run on that request alone, and
bad inputs get INVALID_INPUT without disturbing the others."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import start_server, stop_server, wait_idle, write_config

from clients import AsyncClient, Client, ServerError
from common.models import build_model
from common.protocol import tensor_to_map

TOLERANCE = 1e-5
VOCAB = 100

LSTM = 'builder = "common.models.lstm:build"'
GRU = 'builder = "common.models.gru:build"'
MODELS = {
    "lstm2": f"{LSTM}\nnum_layers = 2",
    "gru2": f"{GRU}\nnum_layers = 2",
    "lstm_steps": f"{LSTM}\nper_step = true",
    "gru3_steps": f"{GRU}\nnum_layers = 3\nper_step = true",
}


def model_tables() -> str:
    common = f"vocab_size = {VOCAB}\nembedding_size = 12\nhidden_size = 16\nmax_length = 30\nbatch_sizes = [1, 2, 4, 8, 16]"
    return "".join(f'\n[models.{name}]\nweights = "{name}.pt"\n{body}\n{common}\n' for name, body in MODELS.items())


@pytest.fixture(scope="module", params=["cellular", "padded"])
def served(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[tuple[Any, dict[str, Any]]]:
    """One server of every feature combination under each policy, with each model and its weights to
    check answers against."""
    scheduler = f'policy = "{request.param}"\nbucket_width = 8'
    config = write_config(tmp_path_factory.mktemp("chains"), model_tables(), scheduler=scheduler)
    server = start_server(config, workers=2)
    models = {}
    for name in MODELS:
        model = build_model(config.models[name])
        models[name] = (model, model.load_weights())
    yield server, models
    stop_server(server)


def random_request(model: Any, rng: np.random.Generator) -> dict[str, Any]:
    """Tokens of a random length, with initial states (tensor maps, as the reference reads them) half of the time."""
    request: dict[str, Any] = {"tokens": rng.integers(0, VOCAB, size=int(rng.integers(1, 31))).tolist()}
    if rng.random() < 0.5:
        for name in model.state_names:
            request[f"{name}0"] = tensor_to_map(rng.standard_normal((model.final_rows, model.hidden_size)).astype(np.float32))
    return request


def test_concurrent_mixed_requests_equal_the_reference(served):
    server, models = served
    rng = np.random.default_rng(11)
    requests = [(name, random_request(models[name][0], rng)) for name in list(MODELS) * 10]

    async def run() -> list[Any]:
        async with AsyncClient(server.address, timeout=120) as client:
            return await asyncio.gather(*(client.infer(name, inputs) for name, inputs in requests))

    replies = asyncio.run(run())
    for (name, inputs), reply in zip(requests, replies):
        model, state = models[name]
        expected = model.reference(state, inputs)
        assert reply.outputs.keys() == expected.keys()
        for key, value in expected.items():
            assert reply.outputs[key].dtype == np.float32
            assert reply.outputs[key].shape == value.shape, (name, key)
            assert np.abs(reply.outputs[key] - value).max() <= TOLERANCE, (name, key)
    with server.client() as client:
        assert wait_idle(client)["requests"]["ok"] == len(requests)


BAD = [
    ("lstm2", {"h0": np.zeros((1, 16), np.float32)}, "h0 must have shape [2, 16], got [1, 16]"),
    ("lstm2", {"c0": np.zeros((2, 16), np.float64)}, "c0 must be a float32 tensor [2, 16], got float64"),
    ("lstm2", {"h0": [[0.0] * 16, [float("nan")] * 16]}, "h0[1][0] = nan is not a finite float32"),
    ("gru2", {"c0": np.zeros((2, 16), np.float32)}, "c0 is an LSTM's initial cell state"),
]


@pytest.mark.parametrize(("name", "extra", "message"), BAD)
def test_bad_inputs_are_invalid_input_and_disturb_nothing(served, name: str, extra: dict[str, Any], message: str):
    server, models = served
    with Client(server.address, timeout=60) as client:
        with pytest.raises(ServerError) as caught:
            client.infer(name, {"tokens": [1, 2, 3], **extra})
        assert caught.value.code == "INVALID_INPUT"
        assert message in caught.value.message
        model, state = models[name]
        reply = client.infer(name, {"tokens": [1, 2, 3]})
        assert np.abs(reply.outputs["h_n"] - model.reference(state, {"tokens": [1, 2, 3]})["h_n"]).max() <= TOLERANCE
