"""Streamed per-step chains through a real server: the rows of `y` (and a head's `logits`) arrive as
their steps complete, and add up to the final reply, which equals torch.nn's output; chains without
`per_step` refuse."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import start_server, stop_server, write_config

from batchmaker.clients import AsyncClient, Partial, Reply, ServerError
from batchmaker.clients.cli import main as cli_main
from batchmaker.common.models import build_model
from batchmaker.common.protocol import INVALID_INPUT

TOLERANCE = 1e-5
MODELS = {
    "lstm_steps": 'builder = "batchmaker.common.models.lstm:build"\nnum_layers = 2\nper_step = true',
    "gru_steps": 'builder = "batchmaker.common.models.gru:build"\nper_step = true',
    "tagger": 'builder = "batchmaker.common.models.lstm:build"\nbidirectional = true\nhead_size = 5\nper_step = true',
    "lstm_final": 'builder = "batchmaker.common.models.lstm:build"',
}
COMMON = "vocab_size = 100\nembedding_size = 12\nhidden_size = 16\nmax_length = 60\nbatch_sizes = [1, 2, 4, 8, 16]"


SCHEDULERS = {
    "cellular": 'policy = "cellular"\nbucket_width = 8',
    "running batch": 'policy = "cellular"\nrunning_batch = "worker"',  # each worker decides its steps
    "padded": 'policy = "padded"\nbucket_width = 8',
}


@pytest.fixture(scope="module", params=list(SCHEDULERS))
def served(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[tuple[Any, dict]]:
    tables = "".join(f'\n[models.{name}]\nweights = "{name}.pt"\n{body}\n{COMMON}\n' for name, body in MODELS.items())
    scheduler = SCHEDULERS[request.param]
    config = write_config(tmp_path_factory.mktemp("chains"), tables, scheduler=scheduler)
    server = start_server(config, workers=1)
    models = {name: build_model(config.models[name]) for name in MODELS}
    yield server, {name: (model, model.load_weights()) for name, model in models.items()}
    stop_server(server)


def test_streamed_rows_of_y_add_up_to_the_reply_and_the_reference(served):
    server, models = served
    rng = np.random.default_rng(5)
    requests = [
        (name, {"tokens": rng.integers(0, 100, size=int(rng.integers(1, 61))).tolist()})
        for name in ["lstm_steps", "gru_steps", "tagger"] * 8
    ]

    async def stream(client: AsyncClient, name: str, inputs: dict) -> list[Partial | Reply]:
        return [item async for item in client.stream(name, inputs)]

    async def run() -> list[list[Partial | Reply]]:
        async with AsyncClient(server.address, timeout=120) as client:
            return await asyncio.gather(*(stream(client, name, inputs) for name, inputs in requests))

    for (name, inputs), (*partials, final) in zip(requests, asyncio.run(run())):
        assert partials and not any(p.restarted for p in partials)
        streamed = {"y", "logits"} if name == "tagger" else {"y"}
        assert all(p.outputs.keys() == streamed for p in partials)
        for key in streamed:
            rows = np.concatenate([p.outputs[key] for p in partials])
            assert rows.dtype == np.float32 and np.array_equal(rows, final.outputs[key])
        model, state = models[name]
        expected = model.reference(state, inputs)
        assert final.outputs.keys() == expected.keys()
        assert all(np.abs(final.outputs[key] - value).max() <= TOLERANCE for key, value in expected.items())


def test_a_chain_without_per_step_cannot_stream(served):
    server, _ = served
    with server.client() as client:
        with pytest.raises(ServerError) as error:
            next(client.stream("lstm_final", {"tokens": [1, 2, 3]}))
        assert error.value.code == INVALID_INPUT and "cannot stream" in error.value.message
        models = client.models()["models"]
        assert models["lstm_steps"]["stream"] is True and "stream" not in models["lstm_final"]


def test_cli_stream_prints_a_row_of_y_a_line(served, capsys):
    server, models = served
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    assert cli_main(["infer", "--address", server.address, "--model", "gru_steps",
                     "--tokens", " ".join(map(str, tokens)), "--stream"]) == 0
    rows = [
        line.removeprefix("partial y: ").split()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("partial y: ")
    ]
    model, state = models["gru_steps"]
    expected = model.reference(state, {"tokens": tokens})["y"]
    assert np.abs(np.array(rows, dtype=np.float32) - expected).max() <= 1e-4  # printed with 6 significant digits
