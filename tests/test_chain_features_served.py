"""Chain models' optional features through a real server (supervisor, manager, worker processes):
concurrent mixed requests batched together each equal torch.nn run on that request alone, and
bad inputs get INVALID_INPUT without disturbing the others."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import start_server, stop_server, wait_idle, write_config
from torch import nn

from batchmaker.clients import AsyncClient, Client, ServerError
from batchmaker.common.config import ConfigError
from batchmaker.common.models import build_model
from batchmaker.common.protocol import tensor_to_map
from batchmaker.manager.commands.preflight import check_weights

TOLERANCE = 1e-5
VOCAB = 100

LSTM = 'builder = "batchmaker.common.models.lstm:build"'
GRU = 'builder = "batchmaker.common.models.gru:build"'
MODELS = {
    "lstm2": f"{LSTM}\nnum_layers = 2",
    "gru2": f"{GRU}\nnum_layers = 2",
    "lstm_steps": f"{LSTM}\nper_step = true",
    "gru3_steps": f"{GRU}\nnum_layers = 3\nper_step = true",
    "lstm_bi_tagger": f"{LSTM}\nnum_layers = 2\nbidirectional = true\nper_step = true\nhead_size = 5",
    "gru_bi_classifier": f"{GRU}\nnum_layers = 2\nbidirectional = true\nhead_size = 3",
    "lstm_x": f"{LSTM}\ninput_size = 16\nbidirectional = true\nhead_size = 4",
    "gru_x_steps": f"{GRU}\ninput_size = 7\nnum_layers = 2\nper_step = true",
}


def model_tables() -> str:
    common = "hidden_size = 16\nmax_length = 30\nbatch_sizes = [1, 2, 4, 8, 16]"
    tokens = f"vocab_size = {VOCAB}\nembedding_size = 12\n"
    return "".join(
        f'\n[models.{name}]\nweights = "{name}.pt"\n{body}\n{"" if "input_size" in body else tokens}{common}\n'
        for name, body in MODELS.items()
    )


@pytest.fixture(scope="module", params=["cellular", "padded"])
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[Any, dict[str, Any]]]:
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
    """A sequence of a random length (tokens, or vectors as a tensor map or lists), with initial states
    (tensor maps, as the reference reads them) half of the time."""
    length = int(rng.integers(1, 31))
    if model.vocab_size is None:
        x = rng.standard_normal((length, model.embedding_size)).astype(np.float32)
        request: dict[str, Any] = {"x": tensor_to_map(x) if rng.random() < 0.5 else x.tolist()}
    else:
        request = {"tokens": rng.integers(0, VOCAB, size=length).tolist()}
    if rng.random() < 0.5:
        for name in model.state_names:
            request[f"{name}0"] = tensor_to_map(
                rng.standard_normal((model.final_rows, model.hidden_size)).astype(np.float32)
            )
    return request


def test_concurrent_mixed_requests_equal_the_reference(served):
    server, models = served
    rng = np.random.default_rng(11)
    requests = [(name, random_request(models[name][0], rng)) for name in list(MODELS) * 6]

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
    # float64 goes as float32
    ("lstm2", {"c0": np.zeros((2, 16), np.float16)}, "c0 must be a float32 tensor [2, 16], got float16"),
    ("lstm2", {"h0": [[0.0] * 16, [float("nan")] * 16]}, "h0[1][0] = nan is not a finite float32"),
    ("gru2", {"c0": np.zeros((2, 16), np.float32)}, "unknown input 'c0' for model 'gru2'; it takes: tokens, h0"),
    ("lstm_x", {"x": np.zeros((0, 16), np.float32)}, "x is empty; send at least one row"),
    ("lstm_x", {"x": np.zeros((31, 16), np.float32)}, "x has 31 rows; this model accepts at most 30"),
    ("lstm_x", {"x": np.zeros((3, 15), np.float32)}, "x must have shape [T, 16], got [3, 15]"),
    ("gru_x_steps", {"x": [[0.5] * 7, [float("inf")] * 7]}, "x[1][0] = inf is not a finite float32"),
    ("lstm_bi_tagger", {"h0": np.zeros((2, 16), np.float32)}, "h0 must have shape [4, 16], got [2, 16]"),
]


@pytest.mark.parametrize(("name", "extra", "message"), BAD)
def test_bad_inputs_are_invalid_input_and_disturb_nothing(served, name: str, extra: dict[str, Any], message: str):
    server, models = served
    with Client(server.address, timeout=60) as client:
        model, state = models[name]
        good = {"tokens": [1, 2, 3]} if model.vocab_size is not None else {"x": [[0.25] * model.embedding_size] * 3}
        with pytest.raises(ServerError) as caught:
            client.infer(name, {**good, **extra})
        assert caught.value.code == "INVALID_INPUT"
        assert message in caught.value.message
        reply = client.infer(name, good)
        assert np.abs(reply.outputs["h_n"] - model.reference(state, good)["h_n"]).max() <= TOLERANCE


def test_the_models_reply_describes_each_config(served):
    server, models = served
    with Client(server.address, timeout=60) as client:
        described = client.models()["models"]
    for name, (model, _) in models.items():
        assert {key: described[name][key] for key in model.describe()} == model.describe()
    assert described["lstm_bi_tagger"]["outputs"]["logits"]["shape"] == [-1, 5]
    assert described["lstm_x"]["inputs"]["x"]["shape"] == [-1, 16]


def test_a_torch_nn_state_dict_is_checked_and_served_as_torch_runs_it(tmp_path: Path):
    """A bidirectional tagger over vectors trained as docs/models.md shows: the start-up weights check
    accepts its state_dict, and the server answers as the module itself computes; a config that
    asks for more layers than the file holds is refused, counting the missing tensors."""
    torch.manual_seed(0)
    module = nn.Module()
    module.lstm = nn.LSTM(7, 16, 2, bidirectional=True)
    module.head = nn.Linear(32, 4)
    torch.save(module.state_dict(), tmp_path / "tagger.pt")
    table = (
        '[models.tagger]\nbuilder = "batchmaker.common.models.lstm:build"\nweights = "tagger.pt"\n'
        "input_size = 7\nhidden_size = 16\nbatch_sizes = [1, 2, 4]\n"
    )
    config = write_config(tmp_path, table + "num_layers = 2\nbidirectional = true\nper_step = true\nhead_size = 4\n")
    check_weights(config)
    x = torch.randn(9, 7)
    with torch.inference_mode():
        y, (h_n, c_n) = module.lstm(x)
        logits = module.head(y)
    server = start_server(config, workers=1)
    try:
        with server.client() as client:
            reply = client.infer("tagger", {"x": x.numpy()}).outputs
    finally:
        stop_server(server)
    for name, expected in {"y": y, "h_n": h_n, "c_n": c_n, "logits": logits}.items():
        assert np.abs(reply[name] - expected.numpy()).max() <= TOLERANCE, name
    deeper = write_config(tmp_path, table + "num_layers = 3\nbidirectional = true\nhead_size = 4\n")
    with pytest.raises(ConfigError) as caught:
        check_weights(deeper)
    assert "lacks 8 of the 26 tensors model 'tagger'" in str(caught.value)
