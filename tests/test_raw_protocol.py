"""The client wire protocol (docs/protocol.md) spoken by hand against a real server.

The client here is written only from the design document, with raw pyzmq, msgpack and
numpy: a DEALER socket that sends one msgpack-map frame per request and reads one
msgpack-map frame per reply. Nothing from clients/, common/, manager/ or worker/ is used,
so these tests check the wire format itself rather than our own client library.

Correctness is checked against an independent reference: torch.nn.Embedding +
torch.nn.LSTM loaded straight from the served weights file.

Here: malformed frames, missing and ill-typed fields, and the introspection ops. Invalid inputs,
tensor-map tokens and pipelined requests are in tests/test_raw_protocol_inputs.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

RECV_TIMEOUT_MS = 10_000
MODEL = "lstm"
VOCAB_SIZE = 1000
HIDDEN = 64

BAD_REQUEST = "BAD_REQUEST"
UNKNOWN_MODEL = "UNKNOWN_MODEL"
INVALID_INPUT = "INVALID_INPUT"


# -- a client written from docs/protocol.md --------------------------------------------------------


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


class RawClient:
    """A DEALER socket speaking protocol version 1 with nothing but pyzmq and msgpack."""

    def __init__(self, address: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, message: Any) -> None:
        self.send_bytes(pack(message))

    def send_bytes(self, frame: bytes) -> None:
        self.socket.send(frame)

    def recv(self, timeout_ms: int = RECV_TIMEOUT_MS) -> dict[str, Any]:
        """One reply: exactly one frame holding a msgpack map. Fails instead of hanging."""
        if not self.socket.poll(timeout_ms, zmq.POLLIN):
            pytest.fail(f"no reply from the server within {timeout_ms / 1000:.0f} s")
        frames = self.socket.recv_multipart(zmq.NOBLOCK)
        assert len(frames) == 1, f"a reply must be one frame, got {len(frames)}"
        reply = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        assert isinstance(reply, dict), f"a reply must be a msgpack map, got {type(reply).__name__}"
        return reply

    def recv_many(self, count: int) -> dict[Any, dict[str, Any]]:
        """`count` replies keyed by id (replies may come in any order); ids must be distinct."""
        replies: dict[Any, dict[str, Any]] = {}
        for _ in range(count):
            reply = self.recv()
            assert "id" in reply, f"reply without an id: {reply}"
            assert reply["id"] not in replies, f"two replies carry id {reply['id']!r}"
            replies[reply["id"]] = reply
        return replies

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        return self.recv()

    def assert_quiet(self, timeout_ms: int = 200) -> None:
        """No reply is pending: the server did not answer one request twice."""
        assert not self.socket.poll(timeout_ms, zmq.POLLIN), f"unexpected extra reply: {self.recv()}"


@pytest.fixture(scope="module")
def lstm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """conftest's `lstm_server` (1 CPU worker, SMALL_LSTM), started once for this module.

    Starting a server costs seconds, so every test here shares one; each test gets its own
    DEALER connection. Only `.address` and the configured weights path are used.
    """
    from conftest import SMALL_LSTM, start_server, stop_server, write_config

    server = start_server(write_config(tmp_path_factory.mktemp("raw-protocol"), SMALL_LSTM), workers=1)
    yield server
    stop_server(server)


@pytest.fixture
def client(lstm_server) -> Iterator[RawClient]:
    raw = RawClient(lstm_server.address)
    yield raw
    raw.close()


def assert_error(reply: dict[str, Any], code: str, request_id: Any = ..., allowed: tuple[str, ...] = ()) -> None:
    """An error reply: ok false, the expected code, a human message, and the request's id echoed."""
    assert reply.get("ok") is False, f"expected an error reply, got {reply}"
    error = reply.get("error")
    assert isinstance(error, dict), f"error must be a map: {reply}"
    codes = (code, *allowed)
    assert error.get("code") in codes, f"expected code {' or '.join(codes)}, got {reply}"
    message = error.get("message")
    assert isinstance(message, str) and message.strip(), f"error message must be non-empty text: {reply}"
    assert "id" in reply, f"an error reply carries an id (nil when unknown): {reply}"
    if request_id is not ...:
        assert reply["id"] == request_id and type(reply["id"]) is type(request_id), (
            f"reply must echo id {request_id!r}, got {reply['id']!r}"
        )


# -- independent reference ---------------------------------------------------------------------------


class Reference:
    """torch.nn.Embedding + torch.nn.LSTM loaded from the served weights file."""

    def __init__(self, weights_path):
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
        vocab, embedding_size = state["embedding.weight"].shape
        hidden = state["lstm.weight_hh_l0"].shape[1]
        layers = sum(1 for key in state if key.startswith("lstm.weight_ih_l"))
        self.embedding = torch.nn.Embedding(vocab, embedding_size)
        self.embedding.load_state_dict({"weight": state["embedding.weight"]})
        self.lstm = torch.nn.LSTM(embedding_size, hidden, num_layers=layers)
        self.lstm.load_state_dict({k[len("lstm.") :]: v for k, v in state.items() if k.startswith("lstm.")})

    def __call__(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        with torch.no_grad():
            _, (h, c) = self.lstm(self.embedding(torch.tensor(tokens, dtype=torch.int64)))
        return h[-1].numpy(), c[-1].numpy()


@pytest.fixture(scope="module")
def reference(lstm_server) -> Reference:
    return Reference(lstm_server.config.models[MODEL].weights)


def wire_tensor(reply_value: Any, name: str) -> np.ndarray:
    """Decode a float32 [HIDDEN] tensor map from a reply, checking it field by field."""
    assert isinstance(reply_value, dict), f"{name} must be a tensor map, got {type(reply_value).__name__}"
    assert set(reply_value) >= {"dtype", "shape", "data"}, f"{name} lacks tensor-map fields: {reply_value.keys()}"
    assert reply_value["dtype"] == "float32", f"{name} dtype: {reply_value['dtype']!r}"
    assert reply_value["shape"] == [HIDDEN], f"{name} shape: {reply_value['shape']!r}"
    data = reply_value["data"]
    assert isinstance(data, bytes), f"{name} data must be msgpack bin, got {type(data).__name__}"
    assert len(data) == HIDDEN * 4, f"{name} has {len(data)} bytes, expected {HIDDEN * 4}"
    return np.frombuffer(data, dtype="<f4").reshape(HIDDEN)


def assert_correct(reply: dict[str, Any], tokens: list[int], reference: Reference, request_id: Any) -> None:
    assert reply.get("ok") is True, f"request {request_id!r} failed: {reply}"
    assert reply["id"] == request_id and type(reply["id"]) is type(request_id)
    outputs = reply.get("outputs")
    assert isinstance(outputs, dict) and {"h", "c"} <= set(outputs), f"outputs: {outputs!r}"
    h = wire_tensor(outputs["h"], "h")
    c = wire_tensor(outputs["c"], "c")
    want_h, want_c = reference(tokens)
    np.testing.assert_allclose(h, want_h, rtol=0, atol=1e-5)
    np.testing.assert_allclose(c, want_c, rtol=0, atol=1e-5)
    timing = reply.get("timing")
    assert isinstance(timing, dict), f"timing: {timing!r}"
    for key in ("queue_us", "compute_us", "total_us"):
        value = timing.get(key)
        assert isinstance(value, int) and not isinstance(value, bool), f"timing {key} must be an int: {timing}"
        assert value >= 0, f"timing {key} is negative: {timing}"


def infer(request_id: Any, tokens: Any, model: str = MODEL) -> dict[str, Any]:
    return {"op": "infer", "id": request_id, "model": model, "inputs": {"tokens": tokens}}


# -- malformed frames -----------------------------------------------------------------------------


def test_bytes_that_are_not_msgpack_are_bad_request(client: RawClient) -> None:
    # 0xc1 is the one byte msgpack never uses; the rest is a truncated map header.
    for garbage in (b"\xc1", b"not msgpack at all \xc1\xff", b"\x82\xa2id"):
        client.send_bytes(garbage)
        assert_error(client.recv(), BAD_REQUEST)
    client.assert_quiet()


def test_msgpack_value_that_is_not_a_map_is_bad_request(client: RawClient) -> None:
    for value in ([1, 2, 3], "infer", 42, None, [{"id": 1, "model": MODEL, "inputs": {"tokens": [1]}}]):
        client.send(value)
        assert_error(client.recv(), BAD_REQUEST)
    client.assert_quiet()


def test_multi_frame_message_is_bad_request(client: RawClient, reference: Reference) -> None:
    # The ROUTER sees [identity, f1, f2]: a request is exactly one frame, even when both parts are valid maps.
    client.socket.send_multipart([pack(infer(1, [5, 6])), pack(infer(2, [7, 8]))])
    reply = client.recv()
    assert_error(reply, BAD_REQUEST)
    assert reply["id"] in (None, 1, 2)
    client.assert_quiet()
    # An empty delimiter frame (a REQ-style envelope) is not one frame either.
    client.socket.send_multipart([b"", pack(infer(3, [9]))])
    assert_error(client.recv(), BAD_REQUEST)
    client.assert_quiet()
    # The connection still works.
    assert_correct(client.call(infer(4, [5, 6])), [5, 6], reference, 4)


# -- missing and ill-typed fields ------------------------------------------------------------------


def test_missing_model_is_bad_request(client: RawClient) -> None:
    assert_error(client.call({"op": "infer", "id": 11, "inputs": {"tokens": [1, 2]}}), BAD_REQUEST, 11)
    # op defaults to "infer".
    assert_error(client.call({"id": "no-model", "inputs": {"tokens": [1, 2]}}), BAD_REQUEST, "no-model")


def test_missing_inputs_is_bad_request(client: RawClient) -> None:
    assert_error(client.call({"op": "infer", "id": 12, "model": MODEL}), BAD_REQUEST, 12)
    assert_error(client.call({"id": "no-inputs", "model": MODEL}), BAD_REQUEST, "no-inputs")


def test_missing_id_is_bad_request(client: RawClient) -> None:
    reply = client.call({"op": "infer", "model": MODEL, "inputs": {"tokens": [1, 2]}})
    assert_error(reply, BAD_REQUEST)
    assert reply["id"] is None, f"there was no id to echo, got {reply['id']!r}"
    for op in ("models", "health", "stats"):
        reply = client.call({"op": op})
        assert_error(reply, BAD_REQUEST)
        assert reply["id"] is None
    client.assert_quiet()


@pytest.mark.parametrize("bad_id", [1.5, [1], {"a": 1}, True, None, b"bytes"], ids=repr)
def test_ill_typed_id_is_bad_request(client: RawClient, bad_id: Any) -> None:
    # An id is an int or a str; anything else is refused, and cannot be echoed.
    reply = client.call({"op": "infer", "id": bad_id, "model": MODEL, "inputs": {"tokens": [1]}})
    assert_error(reply, BAD_REQUEST)
    assert reply["id"] is None or (reply["id"] == bad_id and not isinstance(bad_id, (list, dict))), reply


def test_ill_typed_model_and_inputs_are_bad_request(client: RawClient) -> None:
    assert_error(client.call({"id": 21, "model": 7, "inputs": {"tokens": [1]}}), BAD_REQUEST, 21)
    assert_error(client.call({"id": 22, "model": MODEL, "inputs": [1, 2, 3]}), BAD_REQUEST, 22)
    assert_error(client.call({"id": 23, "model": MODEL, "inputs": "1 2 3"}), BAD_REQUEST, 23)


def test_unknown_op_is_bad_request(client: RawClient) -> None:
    assert_error(client.call({"op": "explode", "id": 31, "model": MODEL, "inputs": {"tokens": [1]}}), BAD_REQUEST, 31)
    assert_error(client.call({"op": 5, "id": "op-int"}), BAD_REQUEST, "op-int")
    assert_error(client.call({"op": "INFER", "id": 32, "model": MODEL, "inputs": {"tokens": [1]}}), BAD_REQUEST, 32)


def test_cancel_without_target_is_bad_request(client: RawClient) -> None:
    assert_error(client.call({"op": "cancel", "id": 41}), BAD_REQUEST, 41)


def test_unknown_model_is_unknown_model(client: RawClient) -> None:
    assert_error(client.call(infer(51, [1, 2, 3], model="gru")), UNKNOWN_MODEL, 51)
    assert_error(client.call(infer("s-52", [1, 2, 3], model="LSTM")), UNKNOWN_MODEL, "s-52")
    assert_error(client.call(infer(53, [1], model="")), UNKNOWN_MODEL, 53, allowed=(BAD_REQUEST,))


# -- introspection ops ---------------------------------------------------------------------------------


def test_models_op_describes_the_lstm(client: RawClient) -> None:
    reply = client.call({"op": "models", "id": "m"})
    assert reply.get("ok") is True and reply["id"] == "m", reply
    models = reply.get("models")
    assert isinstance(models, dict) and MODEL in models, reply
    lstm = models[MODEL]
    assert isinstance(lstm.get("kind"), str) and lstm["kind"], lstm
    assert lstm.get("vocab_size") == VOCAB_SIZE, lstm
    inputs, outputs = lstm.get("inputs"), lstm.get("outputs")
    assert isinstance(inputs, dict) and "tokens" in inputs, lstm
    for name, spec in inputs.items():
        assert isinstance(spec.get("dtype"), str) and isinstance(spec.get("shape"), list), (name, spec)
    assert isinstance(outputs, dict) and {"h", "c"} <= set(outputs), lstm
    for name in ("h", "c"):
        assert outputs[name]["dtype"] == "float32", outputs
        assert outputs[name]["shape"] == [HIDDEN], outputs


def test_health_op_is_ready_with_workers(client: RawClient) -> None:
    reply = client.call({"op": "health", "id": 77})
    assert reply.get("ok") is True and reply["id"] == 77, reply
    assert reply.get("status") == "ready", reply
    workers = reply.get("workers")
    assert isinstance(workers, list) and len(workers) == 1, reply


def test_stats_op_is_ok(client: RawClient, reference: Reference) -> None:
    assert_correct(client.call(infer(1, [4, 5, 6])), [4, 5, 6], reference, 1)
    reply = client.call({"op": "stats", "id": "st"})
    assert reply.get("ok") is True and reply["id"] == "st", reply
    assert "error" not in reply
