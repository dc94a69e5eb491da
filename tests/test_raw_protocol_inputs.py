"""The client wire protocol (docs/protocol.md) spoken by hand against a real server: invalid inputs,
tokens as tensor maps, oversize frames, and good requests pipelined with bad ones.

The raw client (pyzmq and msgpack only) and the independent reference (torch.nn.Embedding +
torch.nn.LSTM) are tests/test_raw_protocol.py's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from test_raw_protocol import (
    BAD_REQUEST,
    INVALID_INPUT,
    MODEL,
    UNKNOWN_MODEL,
    VOCAB_SIZE,
    RawClient,
    Reference,
    assert_correct,
    assert_error,
    client,
    infer,
    lstm_server,
    pack,
    reference,
    wire_tensor,
)

__all__ = ["client", "lstm_server", "reference"]  # the fixtures, shared with tests/test_raw_protocol.py

MAX_LENGTH = 200


def int64_tensor(tokens: list[int]) -> dict[str, Any]:
    return {"dtype": "int64", "shape": [len(tokens)], "data": np.asarray(tokens, dtype="<i8").tobytes()}


def tokens_for(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB_SIZE, size=length).tolist()


# -- invalid inputs ----------------------------------------------------------------------------------

INVALID_TOKENS = {
    "empty": [],
    "id-equal-to-vocab-size": [1, 2, VOCAB_SIZE],
    "negative-id": [-1, 2, 3],
    "far-out-of-vocab": [10**9],
    "beyond-int64": [2**64 - 1],
    "strings": ["the", "cat"],
    "numeric-strings": ["1", "2"],
    "floats": [1.0, 2.0],
    "mixed-float": [1, 2.5, 3],
    "bools": [True, False],
    "nested-lists": [[1, 2], [3]],
    "nil-token": [1, None],
    "too-long": [1] * (MAX_LENGTH + 1),
    "not-a-list": 17,
    "a-string": "1 2 3",
}


def test_invalid_tokens_are_invalid_input(client: RawClient, reference: Reference) -> None:
    for index, (name, tokens) in enumerate(INVALID_TOKENS.items()):
        reply = client.call(infer(f"bad-{index}", tokens))
        try:
            assert_error(reply, INVALID_INPUT, f"bad-{index}")
        except AssertionError as exc:
            raise AssertionError(f"tokens case {name!r}: {exc}") from None
    client.assert_quiet()
    # Boundary values that must be accepted: ids 0 and vocab_size-1, exactly max_length tokens.
    good = [0, VOCAB_SIZE - 1]
    assert_correct(client.call(infer("edge-ids", good)), good, reference, "edge-ids")
    longest = tokens_for(7, MAX_LENGTH)
    assert_correct(client.call(infer("max-length", longest)), longest, reference, "max-length")


# -- tensor-map tokens ---------------------------------------------------------------------------------


def test_tokens_as_int64_tensor_map_match_plain_int_array(client: RawClient, reference: Reference) -> None:
    tokens = tokens_for(3, 12)
    client.send(infer("plain", tokens))
    client.send(infer("tensor", int64_tensor(tokens)))
    replies = client.recv_many(2)
    assert_correct(replies["plain"], tokens, reference, "plain")
    assert_correct(replies["tensor"], tokens, reference, "tensor")
    # Same answer either way (not necessarily bit for bit: the two may run in different batches).
    for name in ("h", "c"):
        np.testing.assert_allclose(
            wire_tensor(replies["plain"]["outputs"][name], name),
            wire_tensor(replies["tensor"]["outputs"][name], name),
            rtol=0,
            atol=1e-5,
        )


def test_tensor_map_with_wrong_byte_count_is_refused(client: RawClient) -> None:
    tokens = [1, 2, 3, 4]
    short = int64_tensor(tokens) | {"data": np.asarray(tokens[:3], dtype="<i8").tobytes()}
    long = int64_tensor(tokens) | {"data": np.asarray(tokens + [5], dtype="<i8").tobytes()}
    ragged = int64_tensor(tokens) | {"data": np.asarray(tokens, dtype="<i8").tobytes()[:-1]}
    shape_says_more = {"dtype": "int64", "shape": [5], "data": np.asarray(tokens, dtype="<i8").tobytes()}
    for index, tensor in enumerate((short, long, ragged, shape_says_more)):
        assert_error(client.call(infer(60 + index, tensor)), BAD_REQUEST, 60 + index, allowed=(INVALID_INPUT,))


def test_ill_formed_tensor_maps_are_refused(client: RawClient) -> None:
    data = np.asarray([1, 2], dtype="<i8").tobytes()
    cases = {
        "unknown-dtype": {"dtype": "int128", "shape": [1], "data": data},
        "float-tokens": {"dtype": "float32", "shape": [2], "data": np.asarray([1, 2], dtype="<f4").tobytes()},
        "two-dimensional": {"dtype": "int64", "shape": [1, 2], "data": data},
        "negative-shape": {"dtype": "int64", "shape": [-2], "data": data},
        "shape-not-a-list": {"dtype": "int64", "shape": 2, "data": data},
        "data-as-str": {"dtype": "int64", "shape": [2], "data": "AQAAAAAAAAACAAAAAAAAAA=="},
        "empty": {"dtype": "int64", "shape": [0], "data": b""},
        "out-of-vocab": int64_tensor([1, VOCAB_SIZE]),
        "negative-id": int64_tensor([-1]),
        "too-long": int64_tensor([1] * (MAX_LENGTH + 1)),
    }
    for index, (name, tensor) in enumerate(cases.items()):
        reply = client.call(infer(70 + index, tensor))
        try:
            assert_error(reply, INVALID_INPUT, 70 + index, allowed=(BAD_REQUEST,))
        except AssertionError as exc:
            raise AssertionError(f"tensor case {name!r}: {exc}") from None
    client.assert_quiet()


def test_tensor_map_with_overflowing_shape_is_refused(client: RawClient) -> None:
    # 2**32 * 2**32 elements: a byte count computed in int64 wraps to 0 and "matches" empty data.
    cases = [[2**32, 2**32], [2**64 - 1], [2**63], [2**62, 4]]
    for index, shape in enumerate(cases):
        reply = client.call(infer(90 + index, {"dtype": "int64", "shape": shape, "data": b""}))
        try:
            assert_error(reply, BAD_REQUEST, 90 + index, allowed=(INVALID_INPUT,))
        except AssertionError as exc:
            raise AssertionError(f"shape {shape}: {exc}") from None


def test_ill_typed_optional_fields_are_bad_request(client: RawClient) -> None:
    # deadline_ms and priority are optional, but when given they must be numbers (docs/protocol.md: ill-typed field).
    assert_error(client.call(infer(81, [1, 2]) | {"deadline_ms": "soon"}), BAD_REQUEST, 81)
    assert_error(client.call(infer(82, [1, 2]) | {"deadline_ms": [100]}), BAD_REQUEST, 82)
    assert_error(client.call(infer(83, [1, 2]) | {"priority": "high"}), BAD_REQUEST, 83)
    assert_error(client.call(infer(84, [1, 2]) | {"priority": 2**40}), BAD_REQUEST, 84)  # beyond +-(2**31 - 1)


def test_an_oversize_frame_closes_its_connection_and_disturbs_no_other(
    lstm_server, client: RawClient, reference: Reference
) -> None:
    """A frame over the server's message limit is never buffered: the socket closes its connection
    on reading its size. Other connections are served meanwhile; the sender reconnects and is served."""
    limit = lstm_server.config.server.max_message_bytes
    other = RawClient(lstm_server.address)
    try:
        beside = tokens_for(9, MAX_LENGTH)
        client.send(infer("huge", [1, 2]) | {"padding": b"x" * (limit + 1024)})
        other.send(infer("beside", beside))
        assert_correct(other.recv(), beside, reference, "beside")
        assert client.call({"op": "health", "id": "after"}).get("ok") is True  # on a new connection
    finally:
        other.close()


# -- good requests survive bad ones --------------------------------------------------------------------


def test_pipelined_bad_and_good_requests_interleaved(client: RawClient, reference: Reference) -> None:
    """Bad requests of every kind, each followed by a good one, all sent without waiting."""
    bad_frames: list[tuple[str, bytes | list[bytes], str, Any]] = [
        ("not-msgpack", b"\xc1\xc1garbage", BAD_REQUEST, None),
        ("a-list", pack([1, 2, 3]), BAD_REQUEST, None),
        ("missing-id", pack({"model": MODEL, "inputs": {"tokens": [1]}}), BAD_REQUEST, None),
        ("multi-frame", [pack(infer("mf-a", [1])), pack(infer("mf-b", [2]))], BAD_REQUEST, None),
    ]
    bad_messages: list[tuple[dict[str, Any], str]] = [
        ({"id": "b-model", "inputs": {"tokens": [1]}}, BAD_REQUEST),
        ({"id": "b-inputs", "model": MODEL}, BAD_REQUEST),
        ({"op": "nope", "id": "b-op"}, BAD_REQUEST),
        (infer("b-unknown-model", [1, 2], model="missing"), UNKNOWN_MODEL),
        (infer("b-empty", []), INVALID_INPUT),
        (infer("b-vocab", [VOCAB_SIZE]), INVALID_INPUT),
        (infer("b-negative", [-1]), INVALID_INPUT),
        (infer("b-strings", ["a"]), INVALID_INPUT),
        (infer("b-floats", [0.5]), INVALID_INPUT),
        (infer("b-long", [3] * (MAX_LENGTH + 1)), INVALID_INPUT),
    ]
    good: dict[Any, list[int]] = {}
    expected_anonymous = 0
    sequence = 0

    def send_good() -> None:
        nonlocal sequence
        sequence += 1
        tokens = tokens_for(100 + sequence, 1 + (sequence * 37) % 60)
        request_id = 1000 + sequence if sequence % 2 else f"good-{sequence}"
        payload = int64_tensor(tokens) if sequence % 3 == 0 else tokens
        client.send(infer(request_id, payload))
        good[request_id] = tokens

    send_good()
    for _, frame, _, _ in bad_frames:
        if isinstance(frame, list):
            client.socket.send_multipart(frame)
        else:
            client.send_bytes(frame)
        expected_anonymous += 1
        send_good()
    for message, _ in bad_messages:
        client.send(message)
        send_good()
    client.send({"op": "health", "id": "h"})
    send_good()

    total = expected_anonymous + len(bad_messages) + len(good) + 1
    replies: list[dict[str, Any]] = [client.recv() for _ in range(total)]
    client.assert_quiet()

    by_id: dict[Any, dict[str, Any]] = {}
    anonymous = []
    for reply in replies:
        assert "id" in reply, reply
        # The multi-frame request may or may not echo the id of one of its parts.
        if reply["id"] is None or reply["id"] in ("mf-a", "mf-b"):
            anonymous.append(reply)
            continue
        assert reply["id"] not in by_id, f"two replies carry id {reply['id']!r}"
        by_id[reply["id"]] = reply

    assert len(anonymous) == expected_anonymous, anonymous
    for reply in anonymous:
        assert_error(reply, BAD_REQUEST)
    for message, code in bad_messages:
        assert_error(by_id.pop(message["id"]), code, message["id"])
    health = by_id.pop("h")
    assert health.get("ok") is True and health.get("status") == "ready", health
    for request_id, tokens in good.items():
        assert_correct(by_id.pop(request_id), tokens, reference, request_id)
    assert not by_id, f"replies to requests never sent: {list(by_id)}"


def test_many_pipelined_requests_answered_by_id(client: RawClient, reference: Reference) -> None:
    """Requests of very different lengths sent at once; every reply matches its own request."""
    lengths = [1, MAX_LENGTH, 2, 150, 3, 90, 1, 40, 7, 120, 5, 60, 11, 30, 1, 200]
    requests = {f"r{i}": tokens_for(500 + i, n) for i, n in enumerate(lengths)}
    for request_id, tokens in requests.items():
        client.send(infer(request_id, tokens))
    replies = client.recv_many(len(requests))
    client.assert_quiet()
    assert set(replies) == set(requests)
    for request_id, tokens in requests.items():
        assert_correct(replies[request_id], tokens, reference, request_id)
