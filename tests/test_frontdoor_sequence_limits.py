"""Sequences and ModelStreamInfer streams at their limits, with tritonclient (and gRPC's own client where
tritonclient would read what must stay unread) against a real server: a sequence id whose session expired is lost
to a continuation and starts again; a unary continuation that arrives while its sequence's start runs waits for it;
a stream past its requests in flight or its unread replies ends with RESOURCE_EXHAUSTED while another goes on; the
bounds' config."""

from __future__ import annotations

import queue
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import SMALL_LSTM, stop_server, wait_idle, wait_until
from oip_server import Door, close, start_door
from prometheus_client.parser import text_string_to_metric_families
from test_frontdoor_sequences import grpc_tokens, http_tokens
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from batchmaker.common.config import ConfigError, load_config
from batchmaker.common.protocol import CANCELLED

MAX_LENGTH = 4000  # a worker's running batch holds each token in a row: fewer than the tests' arena_rows (4096)
LONG = [1 + i % 999 for i in range(MAX_LENGTH - 10)]  # runs for seconds, with room for a continuation of a few tokens
LONG_LSTM = SMALL_LSTM.replace("max_length = 200", f"max_length = {MAX_LENGTH}").replace(
    "hidden_size = 64", "hidden_size = 1024"
)
STEPS = """
[models.steps]
builder = "batchmaker.common.models.lstm:build"
weights = "steps.pt"
vocab_size = 100
embedding_size = 8
hidden_size = 64
per_step = true
max_length = 300
batch_sizes = [1, 2, 4, 8]
"""
STEP_TOKENS = 256  # a `steps` reply's y is 256 x 64 floats: 64 KiB, a flow control window's worth
MAX_STREAM_REQUESTS = 4
MAX_STREAM_REPLIES = 4


@pytest.fixture(scope="module", params=["manager", "worker"])
def limited(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Door]:
    """Served twice: with the manager deciding each step, and with the worker running its own batch."""
    door = start_door(
        tmp_path_factory.mktemp("sequence-limits"),
        LONG_LSTM + STEPS,
        server="session_ttl_ms = 1000",
        scheduler=f'running_batch = "{request.param}"',
        grpc_extra=f"max_stream_requests = {MAX_STREAM_REQUESTS}\nmax_stream_replies = {MAX_STREAM_REPLIES}",
    )
    yield door
    stop_server(door.server)


def stats(door: Door) -> dict[str, Any]:
    with door.server.client() as client:
        return client.stats()


def running_since(door: Door, before: dict[str, Any]) -> bool:
    """One request in flight, and steps run since `before`: the manager's tasks, or the worker's running batch's."""
    now = stats(door)
    return now["requests_in_flight"] == 1 and now["steps"] > before["steps"]


def h_n(door: Door, tokens: list[int]) -> np.ndarray:
    return np.asarray(door.reference("lstm", {"tokens": tokens})["h_n"])


LONG_REFERENCES: dict[str, dict[str, Any]] = {}  # by server: LONG's reference takes seconds


def long_reference(door: Door) -> dict[str, Any]:
    if door.http not in LONG_REFERENCES:
        LONG_REFERENCES[door.http] = door.reference("lstm", {"tokens": LONG})
    return LONG_REFERENCES[door.http]


def exhausted_streams(door: Door) -> float:
    """The front door's count of gRPC errors RESOURCE_EXHAUSTED (streams past their bounds), from /metrics."""
    with urllib.request.urlopen(f"http://{door.http}/metrics") as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "batchmaker_frontdoor_errors_total"
        and sample.labels == {"protocol": "grpc", "code": "RESOURCE_EXHAUSTED"}
    )


def test_an_expired_sequence_id_is_lost_to_its_continuation_and_starts_again(limited: Door):
    http = httpclient.InferenceServerClient(limited.http)
    http.infer("lstm", http_tokens([1, 2]), sequence_id=55, sequence_start=True)
    wait_until(lambda: stats(limited)["sessions"] == 0, "the idle sequence expiring")
    for end in (False, True):
        with pytest.raises(InferenceServerException) as lost:
            http.infer("lstm", http_tokens([3]), sequence_id=55, sequence_end=end)
        assert lost.value.status() == "404" and "SESSION_LOST" in lost.value.message()
        assert "expired" in lost.value.message() and "session_start" in lost.value.message()
    triton = grpcclient.InferenceServerClient(limited.grpc)
    first = triton.infer("lstm", grpc_tokens([3, 4]), sequence_id=55, sequence_start=True).as_numpy("h_n")
    last = http.infer("lstm", http_tokens([5]), sequence_id=55, sequence_end=True).as_numpy("h_n")
    assert close(first, h_n(limited, [3, 4])) and close(last, h_n(limited, [3, 4, 5]))
    assert stats(limited)["sessions"] == 0


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_unary_continuation_that_arrives_while_its_start_runs_waits_for_it(limited: Door, transport: str):
    before = wait_idle(limited.server.client())
    if transport == "grpc":
        triton = grpcclient.InferenceServerClient(limited.grpc)

        def send(tokens: list[int], **sequence: Any) -> Any:
            reply: queue.Queue = queue.Queue()
            callback = lambda result, error: reply.put(error or result)
            triton.async_infer("lstm", grpc_tokens(tokens), callback, **sequence)
            return reply

        def answer(call: Any) -> np.ndarray:
            return call.get(timeout=120).as_numpy("h_n")
    else:
        client = httpclient.InferenceServerClient(limited.http, concurrency=2, network_timeout=120)

        def send(tokens: list[int], **sequence: Any) -> Any:
            return client.async_infer("lstm", http_tokens(tokens), **sequence)

        def answer(call: Any) -> np.ndarray:
            return call.get_result().as_numpy("h_n")

    sequence_id = f"long-{transport}"
    start = send(LONG, sequence_id=sequence_id, sequence_start=True)
    wait_until(lambda: running_since(limited, before), "the long start running")
    end = send([5, 6], sequence_id=sequence_id, sequence_end=True)
    wait_until(lambda: stats(limited)["requests_waiting_for_their_session"] == 1, "the continuation waiting")
    first, last = answer(start), answer(end)
    whole = long_reference(limited)  # LONG, then [5, 6] from its final states: the reference of LONG + [5, 6]
    continued = limited.reference("lstm", {"tokens": [5, 6], "h0": whole["h_n"], "c0": whole["c_n"]})
    assert close(first, whole["h_n"]) and close(last, continued["h_n"])


def stream_answer(triton: grpcclient.InferenceServerClient, replies: queue.Queue, tokens: list[int]) -> np.ndarray:
    triton.async_stream_infer("lstm", grpc_tokens(tokens))
    return replies.get(timeout=60).as_numpy("h_n")


def test_a_stream_past_its_requests_in_flight_ends_resource_exhausted_and_others_go_on(limited: Door):
    """The stream's long start runs; the requests of its sequence sent behind it wait in the front door, in flight,
    until one more than the bound arrives."""
    before = wait_idle(limited.server.client())
    errors: queue.Queue = queue.Queue()
    crowded = grpcclient.InferenceServerClient(limited.grpc)
    crowded.start_stream(callback=lambda result, error: errors.put(error or result))
    answers: queue.Queue = queue.Queue()
    other = grpcclient.InferenceServerClient(limited.grpc)
    other.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        assert close(stream_answer(other, answers, [7, 8]), h_n(limited, [7, 8]))
        crowded.async_stream_infer("lstm", grpc_tokens(LONG), sequence_id=66, sequence_start=True)
        wait_until(lambda: running_since(limited, before), "the long start running")
        for _ in range(MAX_STREAM_REQUESTS):
            crowded.async_stream_infer("lstm", grpc_tokens([1]), sequence_id=66)
        error = errors.get(timeout=60)
        assert isinstance(error, InferenceServerException), error
        assert error.status() == "StatusCode.RESOURCE_EXHAUSTED" and "max_stream_requests" in error.message()
        after = wait_idle(limited.server.client())
        assert after["requests"].get(CANCELLED, 0) == before["requests"].get(CANCELLED, 0) + 1  # the long start
        assert close(stream_answer(other, answers, [9]), h_n(limited, [9]))
    finally:
        crowded.stop_stream()
        other.stop_stream()


def steps_request(index: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="steps", id=str(index))
    request.inputs.add(name="tokens", datatype="INT64", shape=[STEP_TOKENS])
    request.raw_input_contents.append((np.arange(STEP_TOKENS, dtype=np.int64) % 100).tobytes())
    return request


def test_a_stream_whose_replies_go_unread_ends_resource_exhausted_and_others_go_on(limited: Door):
    """Its client sends and does not read (gRPC's flow control window kept at 64 KiB, so that the front door holds
    what the window does not take): once the front door holds more than the bound, the stream is closed."""
    outgoing: queue.Queue = queue.Queue()
    channel = grpc.insecure_channel(limited.grpc, options=[("grpc.http2.bdp_probe", 0)])
    unread = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(outgoing.get, None))
    answers: queue.Queue = queue.Queue()
    other = grpcclient.InferenceServerClient(limited.grpc)
    other.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        base, answered = exhausted_streams(limited), stats(limited)["requests"]["ok"]
        for index in range(1, 41):  # paced: each sent once the one before is answered, so few are in flight
            outgoing.put(steps_request(index))

            def answered_or_closed(sent: int = answered + index) -> bool:
                return stats(limited)["requests"]["ok"] >= sent or exhausted_streams(limited) > base

            wait_until(answered_or_closed, "the request answered, or the stream closed")
            if exhausted_streams(limited) > base:
                break
        assert exhausted_streams(limited) == base + 1
        assert close(stream_answer(other, answers, [7, 8]), h_n(limited, [7, 8]))  # while the other stays unread
        with pytest.raises(grpc.RpcError) as ended:
            for _ in unread:  # what the window took, then the error
                pass
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_stream_replies" in ended.value.details()
    finally:
        outgoing.put(None)
        other.stop_stream()
        channel.close()


def test_the_stream_bounds_default_to_1024_and_must_be_positive(tmp_path):
    models = SMALL_LSTM.replace('weights = "lstm.pt"', f'weights = "{tmp_path / "lstm.pt"}"')
    path = tmp_path / "config.toml"
    path.write_text(models + "[grpc]\n")
    grpc_table = load_config(path).grpc
    assert (grpc_table.max_stream_requests, grpc_table.max_stream_replies) == (1024, 1024)
    for key in ("max_stream_requests", "max_stream_replies"):
        path.write_text(models + f"[grpc]\n{key} = 0\n")
        with pytest.raises(ConfigError, match=key):
            load_config(path)
