"""Strict requests through a real server: an input its model does not declare (`describe()["inputs"]`)
is INVALID_INPUT and a field its op does not read is BAD_REQUEST, each naming what was sent and what
is allowed, for every built-in model kind and a user model; the connection and the other requests of
the same burst are served as if nothing happened."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import SMALL_GRU, SMALL_LSTM, SMALL_SEQ2SEQ, RunningServer, start_server, stop_server, write_config
from test_custom_model import ELMAN
from test_tree_models import TREE_MODELS

from batchmaker.common.config import ConfigError, load_config
from batchmaker.common.models import build_model
from batchmaker.common.models.base import build_planner
from batchmaker.common.protocol import BAD_REQUEST, INVALID_INPUT, decode, decode_outputs, encode

RECV_TIMEOUT_MS = 30_000
VECTORS = (  # an LSTM over float vectors `x`, with a head at every step
    SMALL_LSTM.replace("[models.lstm]", "[models.sensor]")
    .replace('"lstm.pt"', '"sensor.pt"')
    .replace("vocab_size = 1000\nembedding_size = 32\n", "input_size = 4\nper_step = true\nhead_size = 3\n")
)
UNDECLARED = """
from examples.elman import ElmanModel


class Undeclared(ElmanModel):
    def describe(self):
        return {"kind": self.kind, "outputs": {}}


def build(config):
    return Undeclared(config)
"""
STATES = np.full((1, 64), 0.25, np.float32).tolist()
GRU_STATES = np.full((2, 64), -0.5, np.float32).tolist()

# Per model: the inputs it declares, in order, and a valid request's inputs using every one of them.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "lstm": ("tokens, h0, c0", {"tokens": [5, 6, 7], "h0": STATES, "c0": STATES}),
    "gru": ("tokens, h0", {"tokens": [5, 6, 7], "h0": GRU_STATES}),
    "sensor": ("x, h0, c0", {"x": [[0.5, -1.0, 0.25, 2.0]] * 3, "h0": STATES, "c0": STATES}),
    "seq2seq": ("tokens, max_len", {"tokens": [5, 6, 7], "max_len": 3}),
    "bin": ("tree", {"tree": {"tokens": [-1, 3, -1, 4, 5], "parents": [-1, 0, 0, 2, 2]}}),  # a binary TreeLSTM
    "cs": ("tree", {"tree": {"tokens": [7, 3, 4, 5], "parents": [-1, 0, 0, 0]}}),
    "elman": ("tokens", {"tokens": [5, 6, 7]}),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, dict[str, Any]]]:
    """Every built-in model kind and the user model of examples/elman.py, with each one's model and weights."""
    config = write_config(
        tmp_path_factory.mktemp("strict"), SMALL_LSTM + SMALL_GRU + SMALL_SEQ2SEQ + TREE_MODELS + VECTORS + ELMAN
    )
    server = start_server(config, workers=1)
    models = {}
    for name, model_config in config.models.items():
        model = build_model(model_config)
        models[name] = (model, model.load_weights())
    yield server, models
    stop_server(server)


@pytest.fixture
def connection(served: tuple[RunningServer, dict[str, Any]]) -> Iterator[zmq.Socket]:
    """One DEALER connection to the server, spoken to in raw protocol messages."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(served[0].address)
    yield socket
    socket.close()
    context.term()


def replies(socket: zmq.Socket, count: int) -> dict[Any, dict[str, Any]]:
    """`count` replies by id (they may come in any order)."""
    answered = {}
    for _ in range(count):
        assert socket.poll(RECV_TIMEOUT_MS), "no reply from the server"
        reply = decode(socket.recv())
        answered[reply["id"]] = reply
    return answered


def call(socket: zmq.Socket, message: dict[str, Any]) -> dict[str, Any]:
    socket.send(encode(message))
    return replies(socket, 1)[message["id"]]


def assert_refused(reply: dict[str, Any], code: str, message: str) -> None:
    assert reply["ok"] is False, reply
    assert reply["error"] == {"code": code, "message": message}


def assert_reference(
    served: tuple[RunningServer, dict[str, Any]], name: str, inputs: dict[str, Any], reply: dict
) -> None:
    """The reply equals the model's unbatched reference for these inputs (which may say more, as
    Seq2Seq's decoding margins)."""
    assert reply["ok"] is True, reply
    model, state = served[1][name]
    expected = model.reference(state, inputs)
    outputs = decode_outputs(reply["outputs"])
    assert outputs and outputs.keys() <= expected.keys()
    for key, value in outputs.items():
        np.testing.assert_allclose(value, np.asarray(expected[key]), atol=1e-5, err_msg=f"{name}: {key}")


@pytest.mark.parametrize("name", list(CASES))
def test_an_unknown_input_is_refused_naming_it_and_the_inputs_the_model_takes(served, connection, name: str):
    declared, inputs = CASES[name]
    refused = call(connection, {"id": 1, "model": name, "inputs": {**inputs, "bogus": [1]}})
    assert_refused(refused, INVALID_INPUT, f"unknown input 'bogus' for model '{name}'; it takes: {declared}")
    assert_reference(served, name, inputs, call(connection, {"id": 2, "model": name, "inputs": inputs}))


def test_misspelt_optional_inputs_are_refused_instead_of_ignored(served, connection):
    """`max_length` is not seq2seq's `max_len` (it decoded 13 tokens), `h_0` not the LSTM's `h0` (it ran from zeros)."""
    refused = call(connection, {"id": "s", "model": "seq2seq", "inputs": {"tokens": [5, 6, 7], "max_length": 3}})
    assert_refused(refused, INVALID_INPUT, "unknown input 'max_length' for model 'seq2seq'; it takes: tokens, max_len")
    refused = call(
        connection, {"id": "l", "model": "lstm", "inputs": {"tokens": [5, 6, 7], "h_0": STATES, "C0": STATES}}
    )
    assert_refused(refused, INVALID_INPUT, "unknown inputs 'h_0', 'C0' for model 'lstm'; it takes: tokens, h0, c0")
    decoded = call(connection, {"id": "ok", "model": "seq2seq", "inputs": CASES["seq2seq"][1]})
    assert len(decoded["outputs"]["tokens"]["shape"]) == 1 and decoded["outputs"]["tokens"]["shape"][0] <= 3
    assert_reference(served, "seq2seq", CASES["seq2seq"][1], decoded)


def test_an_unknown_request_field_is_refused_naming_it_and_the_ops_fields(served, connection):
    infer_fields = (
        "id, op, model, version, inputs, deadline_ms, priority, stream, session, session_start, session_end, "
        "session_step, traceparent, tracestate"
    )
    refused = call(connection, {"id": 1, "model": "lstm", "inputs": {"tokens": [5]}, "deadline": 100})
    assert_refused(refused, BAD_REQUEST, f"unknown field 'deadline' for op 'infer'; its fields are: {infer_fields}")
    refused = call(connection, {"id": 2, "op": "cancel", "target": 1, "targets": [1], "why": "x"})
    assert_refused(
        refused, BAD_REQUEST, "unknown fields 'targets', 'why' for op 'cancel'; its fields are: id, op, target"
    )
    refused = call(connection, {"id": 3, "op": "models", "verbose": True})
    assert_refused(refused, BAD_REQUEST, "unknown field 'verbose' for op 'models'; its fields are: id, op")
    every_field = {"version": 1, "deadline_ms": 60_000, "priority": 1, "stream": False, "session": "s",
                   "session_start": True, "session_end": True, "session_step": 0,
                   "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                   "tracestate": "a=1"}  # fmt: skip
    inputs = {"tokens": [5, 6, 7]}
    assert_reference(
        served,
        "lstm",
        inputs,
        call(connection, {"id": 4, "op": "infer", "model": "lstm", "inputs": inputs, **every_field}),
    )
    assert call(connection, {"id": 5, "op": "health"})["ok"] is True


def test_refusals_disturb_nothing_else_of_their_burst(served, connection):
    """Good and refused requests sent together, without waiting: each good one gets its reference answer."""
    burst = {
        "gru": {"id": "gru", "model": "gru", "inputs": CASES["gru"][1]},
        "field": {"id": "field", "model": "lstm", "inputs": {"tokens": [1]}, "prio": 3},
        "input": {"id": "input", "model": "seq2seq", "inputs": {"tokens": [1], "max_length": 3}},
        "cs": {"id": "cs", "model": "cs", "inputs": CASES["cs"][1]},
        "elman": {"id": "elman", "model": "elman", "inputs": CASES["elman"][1]},
    }
    for message in burst.values():
        connection.send(encode(message))
    answered = replies(connection, len(burst))
    assert answered["field"]["error"]["code"] == BAD_REQUEST and "'prio'" in answered["field"]["error"]["message"]
    assert (
        answered["input"]["error"]["code"] == INVALID_INPUT and "'max_length'" in answered["input"]["error"]["message"]
    )
    for name in ("gru", "cs", "elman"):
        assert_reference(served, name, burst[name]["inputs"], answered[name])


def test_a_model_that_declares_no_inputs_is_refused_at_start(tmp_path: Path):
    (tmp_path / "undeclared_inputs.py").write_text(UNDECLARED)
    path = tmp_path / "config.toml"
    path.write_text(ELMAN.replace("examples.elman:build", "undeclared_inputs:build"))
    with pytest.raises(
        ConfigError, match=r"\[models.elman\] builder 'undeclared_inputs:build': describe\(\) must map 'inputs'"
    ):
        build_planner(load_config(path).models["elman"])
