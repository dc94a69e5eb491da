"""The Open Inference Protocol over HTTP, called with tritonclient.http (and raw HTTP where a client library
would hide what is checked) against a real server; every answer equals the unbatched reference."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from oip_server import TREE, Door, close
from tritonclient.utils import InferenceServerException

from batchmaker.common.models.seq2seq import decoding_mismatch


def client(door: Door) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(door.http)


def tensor(name: str, array: np.ndarray, binary: bool = True) -> httpclient.InferInput:
    item = httpclient.InferInput(
        name, list(array.shape), {np.dtype("int64"): "INT64", np.dtype("float32"): "FP32"}[array.dtype]
    )
    item.set_data_from_numpy(array, binary_data=binary)
    return item


def post(door: Door, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    """A raw POST: status, JSON body, headers (for what tritonclient turns into an exception)."""
    request = urllib.request.Request(f"http://{door.http}{path}", data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


def test_health_and_server_metadata(door: Door):
    triton = client(door)
    assert triton.is_server_live() and triton.is_server_ready()
    metadata = triton.get_server_metadata()
    assert metadata["name"] == "batchmaker"
    assert set(metadata["extensions"]) == {"binary_tensor_data", "sequence", "model_repository"}


def test_model_metadata_lists_the_inputs_and_outputs_of_each_kind(door: Door):
    triton = client(door)
    lstm = triton.get_model_metadata("lstm")
    assert lstm["inputs"][0] == {"name": "tokens", "datatype": "INT64", "shape": [-1]}
    assert {"name": "h0", "datatype": "FP32", "shape": [1, 64]} in lstm["inputs"]
    assert {"name": "h_n", "datatype": "FP32", "shape": [1, 64]} in lstm["outputs"]
    assert triton.get_model_metadata("lstm", "1") == lstm
    assert [i["name"] for i in triton.get_model_metadata("tree")["inputs"]] == ["tree.tokens", "tree.parents"]
    assert {"name": "max_len", "datatype": "INT64", "shape": [1]} in triton.get_model_metadata("seq2seq")["inputs"]
    assert {"name": "y", "datatype": "FP32", "shape": [-1, 32]} in triton.get_model_metadata("tagger")["outputs"]
    assert triton.get_model_metadata("vectors")["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, 6]}
    assert triton.is_model_ready("elman") and triton.is_model_ready("elman", "1")
    assert not triton.is_model_ready("elman", "2") and not triton.is_model_ready("missing")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_chain_lstm_equals_the_reference_in_binary_and_json(door: Door, binary: bool):
    tokens = np.array([5, 17, 342, 8, 9], dtype=np.int64)
    h0 = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in ("h", "c_n")]
    reply = client(door).infer("lstm", [tensor("tokens", tokens, binary), tensor("h0", h0, binary)], outputs=outputs)
    expected = door.reference("lstm", {"tokens": tokens.tolist(), "h0": h0})
    assert close(reply.as_numpy("h"), expected["h"]) and close(reply.as_numpy("c_n"), expected["c_n"])
    assert [output["name"] for output in reply.get_response()["outputs"]] == ["h", "c_n"]


def test_json_outputs_read_back_as_the_binary_outputs_bit_for_bit(door: Door):
    tokens = np.array([5, 17, 242, 8, 9, 3, 77], dtype=np.int64)
    replies = {
        binary: client(door).infer(
            "tagger",
            [tensor("tokens", tokens)],
            outputs=[httpclient.InferRequestedOutput(name, binary_data=binary) for name in ("y", "logits")],
        )
        for binary in (True, False)
    }
    for name in ("y", "logits"):
        as_binary, as_json = replies[True].as_numpy(name), replies[False].as_numpy(name)
        assert as_json.dtype == as_binary.dtype and np.array_equal(as_json, as_binary)


def test_every_model_kind_equals_its_reference(door: Door):
    triton = client(door)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 200, size=12).astype(np.int64)

    tagged = triton.infer("tagger", [tensor("tokens", tokens)])
    expected = door.reference("tagger", {"tokens": tokens.tolist()})
    assert close(tagged.as_numpy("y"), expected["y"]) and close(tagged.as_numpy("logits"), expected["logits"])

    x = rng.standard_normal((7, 6)).astype(np.float32)
    vectors = triton.infer("vectors", [tensor("x", x, binary=False)])
    assert close(vectors.as_numpy("logits"), door.reference("vectors", {"x": x})["logits"])

    elman = triton.infer("elman", [tensor("tokens", tokens)])
    assert close(elman.as_numpy("h"), door.reference("elman", {"tokens": tokens.tolist()})["h"])

    parts = [tensor(f"tree.{key}", np.array(values, dtype=np.int64)) for key, values in TREE.items()]
    tree = triton.infer("tree", parts)
    assert close(tree.as_numpy("logits"), door.reference("tree", {"tree": TREE})["logits"])

    source = tokens[:6]
    decoded = triton.infer("seq2seq", [tensor("tokens", source), tensor("max_len", np.array([9], dtype=np.int64))])
    reference = door.reference("seq2seq", {"tokens": source.tolist(), "max_len": 9})
    assert decoding_mismatch(decoded.as_numpy("tokens"), reference) is None


def test_nested_json_data_and_a_priority_are_taken(door: Door):
    x = np.random.default_rng(5).standard_normal((3, 6)).astype(np.float32)
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 6], "data": x.tolist()}],
        "outputs": [{"name": "logits"}],
        "parameters": {"priority": 2},
    }
    status, answer, _ = post(door, "/v2/models/vectors/infer", json.dumps(body).encode())
    [logits] = answer["outputs"]
    assert status == 200 and logits["shape"] == [4]
    assert close(np.array(logits["data"], dtype=np.float32), door.reference("vectors", {"x": x})["logits"])


def test_many_requests_in_flight_from_several_connections_each_get_their_own_answer(door: Door):
    rng = np.random.default_rng(6)
    sequences = [rng.integers(0, 1000, size=int(rng.integers(1, 60))).astype(np.int64) for _ in range(120)]
    triton = httpclient.InferenceServerClient(door.http, concurrency=12)
    pending = [triton.async_infer("lstm", [tensor("tokens", tokens)]) for tokens in sequences]
    for tokens, call in zip(sequences, pending):
        assert close(call.get_result().as_numpy("h"), door.reference("lstm", {"tokens": tokens.tolist()})["h"])


def test_a_sequence_over_several_requests_equals_one_request(door: Door):
    triton = client(door)
    chunks = [[5, 17, 342], [8, 9], [40, 41, 42, 43]]
    for index, chunk in enumerate(chunks):
        reply = triton.infer(
            "lstm",
            [tensor("tokens", np.array(chunk, dtype=np.int64))],
            sequence_id=4242,
            sequence_start=index == 0,
            sequence_end=index == len(chunks) - 1,
        )
    whole = door.reference("lstm", {"tokens": [token for chunk in chunks for token in chunk]})
    assert close(reply.as_numpy("h_n"), whole["h_n"]) and close(reply.as_numpy("c_n"), whole["c_n"])


def test_a_sequence_the_server_does_not_hold_is_lost_not_restarted(door: Door):
    with pytest.raises(InferenceServerException) as lost:
        client(door).infer("lstm", [tensor("tokens", np.array([1, 2], dtype=np.int64))], sequence_id=777001)
    assert lost.value.status() == "404" and "SESSION_LOST" in lost.value.message()


def test_starting_a_sequence_still_open_starts_it_again_from_zeros(door: Door):
    """As in Triton: the start replaces the sequence of its id, and what follows continues the new one."""
    triton = client(door)
    tokens = [tensor("tokens", np.array([1, 2], dtype=np.int64))]
    first = triton.infer("lstm", tokens, sequence_id="open-one", sequence_start=True).as_numpy("h_n")
    triton.infer("lstm", tokens, sequence_id="open-one")
    again = triton.infer("lstm", tokens, sequence_id="open-one", sequence_start=True).as_numpy("h_n")
    assert close(again, first) and close(first, door.reference("lstm", {"tokens": [1, 2]})["h_n"])
    last = triton.infer("lstm", tokens, sequence_id="open-one", sequence_end=True).as_numpy("h_n")
    assert close(last, door.reference("lstm", {"tokens": [1, 2, 1, 2]})["h_n"])


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v2/models/missing/infer", {"inputs": []}, 404, "UNKNOWN_MODEL"),
        ("/v2/models/lstm/versions/3/infer", {"inputs": []}, 404, "no ready version 3; ready: 1"),
        (
            "/v2/models/lstm/infer",
            {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [2], "data": [1, 2, 3]}]},
            400,
            "needs 2 values",
        ),
        (
            "/v2/models/lstm/infer",
            {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5000]}]},
            400,
            "INVALID_INPUT",
        ),
        (
            "/v2/models/lstm/infer",
            {"inputs": [{"name": "tokenz", "datatype": "INT64", "shape": [1], "data": [5]}]},
            400,
            "tokenz",
        ),
        (
            "/v2/models/lstm/infer",
            {"inputs": [{"name": "tokens", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
            400,
            "BYTES",
        ),
        (
            "/v2/models/lstm/infer",
            {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [1.5]}]},
            400,
            "integers",
        ),
        (
            "/v2/models/lstm/infer",
            {
                "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]}],
                "outputs": [{"name": "q"}],
            },
            400,
            "no output 'q'",
        ),
        (
            "/v2/models/tree/infer",
            {"inputs": [{"name": "tree.leaves", "datatype": "INT64", "shape": [1], "data": [5]}]},
            400,
            "tree.tokens",
        ),
        (
            "/v2/models/lstm/infer",
            {
                "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]}],
                "parameters": {"sequence_start": True},
            },
            400,
            "need a sequence_id",
        ),
        (
            "/v2/models/lstm/infer",
            {
                "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]}],
                "parameters": {"priority": -1},
            },
            400,
            "priority must be",
        ),
        (
            "/v2/models/lstm/infer",
            {
                "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]}],
                "parameters": {"sequence_id": 1.5},
            },
            400,
            "sequence_id must be",
        ),
        (
            "/v2/models/lstm/infer",
            {
                "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]}],
                "parameters": {"sequence_id": 3, "sequence_start": "yes"},
            },
            400,
            "must be booleans",
        ),
        (
            "/v2/models/lstm/infer",
            {
                "inputs": [
                    {"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]},
                    {"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]},
                ]
            },
            400,
            "given twice",
        ),
        ("/v2/models/lstm/infer", {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1]}]}, 400, "neither"),
        (
            "/v2/models/lstm/infer",
            {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]}], "outputs": ["h"]},
            400,
            "'outputs' must be a list",
        ),
        ("/v2/models/lstm/infer", {"inputs": {}}, 400, "'inputs' list"),
        (
            "/v2/models/lstm/infer",
            {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]}], "parameters": []},
            400,
            "must be an object",
        ),
        (
            "/v2/models/seq2seq/infer",
            {
                "inputs": [
                    {"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]},
                    {"name": "max_len", "datatype": "INT64", "shape": [2], "data": [3, 4]},
                ]
            },
            400,
            "is one value",
        ),
    ],
)
def test_bad_requests_get_their_status_and_an_oip_error(door: Door, path: str, body: dict, status: int, words: str):
    got, answer, _ = post(door, path, json.dumps(body).encode())
    assert got == status and set(answer) == {"error"} and words in answer["error"]


def test_a_body_that_is_not_json_or_whose_binary_part_is_wrong_is_refused(door: Door):
    assert post(door, "/v2/models/lstm/infer", b"{not json")[0] == 400
    header = json.dumps(
        {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [2], "parameters": {"binary_data_size": 16}}]}
    ).encode()
    length = {"Inference-Header-Content-Length": str(len(header))}
    status, answer, _ = post(door, "/v2/models/lstm/infer", header + b"\0" * 8, length)
    assert status == 400 and "past the body's end" in answer["error"]
    status, answer, _ = post(door, "/v2/models/lstm/infer", header + b"\0" * 20, length)
    assert status == 400 and "unclaimed" in answer["error"]
    status, answer, _ = post(door, "/v2/models/lstm/infer", header, {"Inference-Header-Content-Length": "99999"})
    assert status == 400 and "Inference-Header-Content-Length" in answer["error"]


def test_an_expired_timeout_is_504(door: Door):
    body = {
        "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [5]}],
        "parameters": {"timeout": 0},
    }
    status, answer, _ = post(door, "/v2/models/lstm/infer", json.dumps(body).encode())
    assert status == 504 and "DEADLINE_EXCEEDED" in answer["error"]


def test_metrics_count_requests_and_errors(door: Door):
    post(door, "/v2/models/missing/infer", b'{"inputs": []}')
    with urllib.request.urlopen(f"http://{door.http}/metrics") as response:
        text = response.read().decode()
    assert 'batchmaker_frontdoor_errors_total{code="UNKNOWN_MODEL",protocol="http"}' in text
    assert 'batchmaker_frontdoor_requests_total{endpoint="/v2/models/{model}/infer",protocol="http"}' in text
    assert "batchmaker_frontdoor_request_latency_seconds_count" in text
