"""The Open Inference Protocol over gRPC, called with tritonclient.grpc against a real server: Triton's
GRPCInferenceService methods, raw and typed tensors, sequences, streaming, and each error's status code."""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from oip_server import TREE, Door, close
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from batchmaker.common.models.seq2seq import decoding_mismatch


def client(door: Door) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(door.grpc)


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    item = grpcclient.InferInput(
        name, list(array.shape), {np.dtype("int64"): "INT64", np.dtype("float32"): "FP32"}[array.dtype]
    )
    item.set_data_from_numpy(array)
    return item


def test_health_and_metadata(door: Door):
    triton = client(door)
    assert triton.is_server_live() and triton.is_server_ready()
    assert (
        triton.is_model_ready("lstm")
        and not triton.is_model_ready("missing")
        and not triton.is_model_ready("lstm", "9")
    )
    server = triton.get_server_metadata(as_json=True)
    assert server["name"] == "batchmaker" and {"sequence", "model_repository"} <= set(server["extensions"])
    tree = triton.get_model_metadata("tree", as_json=True)
    assert [(i["name"], i["datatype"]) for i in tree["inputs"]] == [("tree.tokens", "INT64"), ("tree.parents", "INT64")]
    with pytest.raises(InferenceServerException) as unknown:
        triton.get_model_metadata("missing")
    assert unknown.value.status() == "StatusCode.NOT_FOUND"


def test_model_config_and_statistics_are_unimplemented(door: Door):
    for call in (lambda t: t.get_model_config("lstm"), lambda t: t.get_inference_statistics("lstm")):
        with pytest.raises(InferenceServerException) as refused:
            call(client(door))
        assert refused.value.status() == "StatusCode.UNIMPLEMENTED"


def test_every_model_kind_equals_its_reference(door: Door):
    triton = client(door)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 200, size=10).astype(np.int64)
    c0 = rng.standard_normal((1, 64)).astype(np.float32)
    lstm = triton.infer(
        "lstm", [tensor("tokens", tokens), tensor("c0", c0)], outputs=[grpcclient.InferRequestedOutput("h")]
    )
    assert close(lstm.as_numpy("h"), door.reference("lstm", {"tokens": tokens.tolist(), "c0": c0})["h"])
    assert lstm.as_numpy("c") is None  # only the outputs asked for come back

    tagged = triton.infer("tagger", [tensor("tokens", tokens)])
    assert close(tagged.as_numpy("logits"), door.reference("tagger", {"tokens": tokens.tolist()})["logits"])
    x = rng.standard_normal((5, 6)).astype(np.float32)
    assert close(triton.infer("vectors", [tensor("x", x)]).as_numpy("h_n"), door.reference("vectors", {"x": x})["h_n"])
    assert close(
        triton.infer("elman", [tensor("tokens", tokens)]).as_numpy("h"),
        door.reference("elman", {"tokens": tokens.tolist()})["h"],
    )
    tree = triton.infer(
        "tree", [tensor(f"tree.{key}", np.array(values, dtype=np.int64)) for key, values in TREE.items()]
    )
    assert close(tree.as_numpy("h"), door.reference("tree", {"tree": TREE})["h"])
    decoded = triton.infer("seq2seq", [tensor("tokens", tokens)])
    assert decoding_mismatch(decoded.as_numpy("tokens"), door.reference("seq2seq", {"tokens": tokens.tolist()})) is None


def test_typed_contents_are_read_as_raw_ones(door: Door):
    """A client that fills `contents` rather than `raw_input_contents` (tritonclient always sends raw): Triton's
    own messages, as tritonclient ships them."""
    with grpc.insecure_channel(door.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="elman", id="typed")
        request.inputs.add(name="tokens", datatype="INT64", shape=[3]).contents.int64_contents.extend([4, 5, 6])
        reply = stub.ModelInfer(request)
    assert reply.id == "typed" and [o.name for o in reply.outputs] == ["h"]
    h = np.frombuffer(reply.raw_output_contents[0], dtype="<f4")
    assert close(h, door.reference("elman", {"tokens": [4, 5, 6]})["h"])


def test_malformed_raw_or_typed_contents_are_invalid_argument(door: Door):
    with grpc.insecure_channel(door.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        two_raw = pb.ModelInferRequest(model_name="elman", raw_input_contents=[b"", b""])
        two_raw.inputs.add(name="tokens", datatype="INT64", shape=[0])
        half = pb.ModelInferRequest(model_name="elman")
        half.inputs.add(name="h0", datatype="FP16", shape=[1, 16]).contents.fp32_contents.extend([0.0] * 16)
        for request, words in (
            (two_raw, "2 raw_input_contents for 1 inputs"),
            (half, "FP16' needs raw_input_contents"),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()


def test_a_sequence_over_several_requests_equals_one_request(door: Door):
    triton = client(door)
    chunks = [[3, 4], [5, 6, 7], [8]]
    for index, chunk in enumerate(chunks):
        reply = triton.infer(
            "lstm",
            [tensor("tokens", np.array(chunk, dtype=np.int64))],
            sequence_id=90210,
            sequence_start=index == 0,
            sequence_end=index == len(chunks) - 1,
        )
    assert close(reply.as_numpy("h_n"), door.reference("lstm", {"tokens": [3, 4, 5, 6, 7, 8]})["h_n"])
    with pytest.raises(InferenceServerException) as lost:  # ended: continuing it is continuing nothing
        triton.infer("lstm", [tensor("tokens", np.array([1], dtype=np.int64))], sequence_id=90210)
    assert lost.value.status() == "StatusCode.NOT_FOUND" and "SESSION_LOST" in lost.value.message()


@pytest.mark.parametrize(
    ("model", "inputs", "code", "words"),
    [
        ("missing", {"tokens": np.array([1], dtype=np.int64)}, "NOT_FOUND", "UNKNOWN_MODEL"),
        ("lstm", {"tokens": np.array([5000], dtype=np.int64)}, "INVALID_ARGUMENT", "INVALID_INPUT"),
        ("lstm", {"tokens": np.array([1.0], dtype=np.float32)}, "INVALID_ARGUMENT", "integer"),
        ("lstm", {"h9": np.zeros((1, 64), dtype=np.float32)}, "INVALID_ARGUMENT", "h9"),
    ],
)
def test_errors_get_their_status_codes(door: Door, model: str, inputs: dict, code: str, words: str):
    with pytest.raises(InferenceServerException) as refused:
        client(door).infer(model, [tensor(name, array) for name, array in inputs.items()])
    assert refused.value.status() == f"StatusCode.{code}" and words in refused.value.message()


def test_an_expired_timeout_is_deadline_exceeded(door: Door):
    with pytest.raises(InferenceServerException) as late:
        client(door).infer("lstm", [tensor("tokens", np.array([1, 2], dtype=np.int64))], timeout=0)
    assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"


def stream(door: Door, requests: list[tuple[str, dict, str]]) -> list:
    """Send requests on one ModelStreamInfer call; every response (or error) until each request's final one."""
    responses: queue.Queue = queue.Queue()
    triton = client(door)
    triton.start_stream(callback=lambda result, error: responses.put(error or result))
    try:
        for model, inputs, request_id in requests:
            triton.async_stream_infer(
                model, [tensor(name, array) for name, array in inputs.items()], request_id=request_id
            )
        got, finals = [], 0
        while finals < len(requests):
            item = responses.get(timeout=60)
            got.append(item)
            final = (
                isinstance(item, InferenceServerException)
                or item.get_response().parameters["triton_final_response"].bool_param
            )
            finals += final
        return got
    finally:
        triton.stop_stream()


def test_a_stream_sends_seq2seq_tokens_as_they_are_decoded_then_the_final_reply(door: Door):
    source = np.array([12, 7, 401, 9, 33, 8, 2, 71], dtype=np.int64)
    got = stream(door, [("seq2seq", {"tokens": source, "max_len": np.array([40], dtype=np.int64)}, "s1")])
    *partials, final = got
    assert partials and all(not p.get_response().parameters["triton_final_response"].bool_param for p in partials)
    assert all(p.get_response().id == "s1" for p in got)
    tokens = np.concatenate([p.as_numpy("tokens") for p in partials])
    assert tokens.tolist() == final.as_numpy("tokens").tolist()
    assert decoding_mismatch(tokens, door.reference("seq2seq", {"tokens": source.tolist(), "max_len": 40})) is None


def test_a_stream_sends_a_taggers_rows_as_they_are_computed(door: Door):
    tokens = np.random.default_rng(4).integers(0, 300, size=30).astype(np.int64)
    *partials, final = stream(door, [("tagger", {"tokens": tokens}, "t")])
    expected = door.reference("tagger", {"tokens": tokens.tolist()})
    assert close(np.concatenate([p.as_numpy("y") for p in partials]), expected["y"])
    assert close(final.as_numpy("y"), expected["y"]) and close(final.as_numpy("logits"), expected["logits"])


def test_a_stream_answers_each_of_its_requests_and_their_errors(door: Door):
    tokens = np.array([4, 5, 6], dtype=np.int64)
    got = stream(
        door,
        [("lstm", {"tokens": tokens}, "a"), ("missing", {"tokens": tokens}, "b"), ("elman", {"tokens": tokens}, "c")],
    )
    results = {item.get_response().id: item for item in got if not isinstance(item, InferenceServerException)}
    [error] = [item for item in got if isinstance(item, InferenceServerException)]
    assert "UNKNOWN_MODEL" in error.message()
    assert set(results) == {"a", "c"}
    assert close(results["a"].as_numpy("h"), door.reference("lstm", {"tokens": [4, 5, 6]})["h"])
    assert close(results["c"].as_numpy("h"), door.reference("elman", {"tokens": [4, 5, 6]})["h"])
