"""The front door's limits and lifetimes against a real server: bodies over max_body_bytes (by default the
manager's max_message_bytes) and requests over the manager's frame limit, a client that goes away (its request
is cancelled on the server), refusals under load (429 / UNAVAILABLE), a request that kills
its worker (500 / INTERNAL), and a stop that drains."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import faulty_lstm
import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import SMALL_LSTM, stop_server, wait_idle, wait_until, with_faults
from oip_server import Door, close, start_door
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from batchmaker.clients.errors import ServerError
from batchmaker.clients.messages import check
from batchmaker.common.protocol import CANCELLED, OVERLOADED
from batchmaker.frontdoor.errors import DoorError
from batchmaker.frontdoor.http_server import error_response

MAX_LENGTH = 4000  # a worker's running batch holds each token in a row: fewer than the tests' arena_rows (4096)
LONG = np.array([1 + i % 999 for i in range(MAX_LENGTH)], dtype=np.int64)  # runs for seconds: cancelled or drained
LONG_LSTM = SMALL_LSTM.replace("max_length = 200", f"max_length = {MAX_LENGTH}").replace(
    "hidden_size = 64", "hidden_size = 1024"
)
RUNNING_BATCH = ["manager", "worker"]  # who decides each step: the manager's tasks, or the worker's running batch
MAX_BODY = 400_000
MAX_FRAME = 200_000  # the manager's server.max_message_bytes: LONG's frame fits, a body of MAX_BODY does not


@pytest.fixture(scope="module", params=RUNNING_BATCH)
def limited(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Door]:
    """Served twice: with the manager deciding each step, and with the worker running its own batch."""
    door = start_door(
        tmp_path_factory.mktemp("limits"),
        LONG_LSTM,
        server=f"max_sessions = 1\nmax_message_bytes = {MAX_FRAME}",
        scheduler=f'running_batch = "{request.param}"',
        http_extra=f"max_body_bytes = {MAX_BODY}",
    )
    yield door
    stop_server(door.server)


@pytest.fixture(scope="module")
def defaulted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    """No max_body_bytes: the front door's limit is the manager's max_message_bytes."""
    door = start_door(tmp_path_factory.mktemp("defaulted"), SMALL_LSTM, server=f"max_message_bytes = {MAX_FRAME}")
    yield door
    stop_server(door.server)


def still_serves(door: Door) -> None:
    """A request within the limits is answered, over both transports: a refusal disturbed nothing."""
    tokens = np.array([5, 17, 342], dtype=np.int64)
    expected = door.reference("lstm", {"tokens": tokens.tolist()})["h"]
    for module, address in ((httpclient, door.http), (grpcclient, door.grpc)):
        item = module.InferInput("tokens", [3], "INT64")
        item.set_data_from_numpy(tokens)
        assert close(module.InferenceServerClient(address).infer("lstm", [item]).as_numpy("h"), expected)


def binary_body(tokens: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "tokens",
                    "datatype": "INT64",
                    "shape": [len(tokens)],
                    "parameters": {"binary_data_size": tokens.nbytes},
                }
            ]
        }
    ).encode()
    return header + tokens.tobytes(), {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }


def stats(door: Door) -> dict:
    with door.server.client() as client:
        return client.stats()


def running_since(door: Door, before: dict) -> bool:
    """One request in flight, and steps run since `before`: the manager's tasks, or the worker's running batch's."""
    now = stats(door)
    return now["requests_in_flight"] == 1 and now["steps"] > before["steps"]


def cancelled_since(door: Door, before: dict) -> int:
    with door.server.client() as client:
        return wait_idle(client)["requests"].get(CANCELLED, 0) - before["requests"].get(CANCELLED, 0)


def test_a_body_over_the_limit_gets_413_before_it_is_sent(limited: Door):
    host, port = limited.http.split(":")
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(
            f"POST /v2/models/lstm/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
        )
        answer = connection.recv(65536).decode()  # answered without a byte of the body sent
    assert answer.startswith("HTTP/1.1 413") and "TOO_LARGE" in answer


def test_a_chunked_body_that_grows_over_the_limit_gets_413(limited: Door):
    connection = http.client.HTTPConnection(limited.http)
    chunks = iter([b"{" + b" " * (MAX_BODY // 2), b" " * (MAX_BODY // 2), b"}"])  # no Content-Length: read, then cut
    connection.request("POST", "/v2/models/lstm/infer", body=chunks, encode_chunked=True)
    answer = connection.getresponse()
    assert answer.status == 413 and "TOO_LARGE" in json.loads(answer.read())["error"]
    connection.close()


def test_a_request_over_the_servers_frame_limit_is_413_too(limited: Door):
    body, headers = binary_body(np.zeros(MAX_FRAME // 8 + 1000, dtype=np.int64))
    request = urllib.request.Request(
        f"http://{limited.http}/v2/models/lstm/infer", data=body, headers=headers, method="POST"
    )
    assert len(body) < MAX_BODY
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    assert refused.value.code == 413 and "max_message_bytes" in json.loads(refused.value.read())["error"]


def test_by_default_a_body_over_the_servers_frame_limit_gets_413_naming_both_settings(defaulted: Door):
    if shutil.which("curl") is None:
        pytest.skip("curl is not on PATH")
    body = b'{"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1], "data": [' + b" " * MAX_FRAME + b"5]}]}"
    done = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", "--data-binary", "@-", f"http://{defaulted.http}/v2/models/lstm/infer"],
        input=body, capture_output=True, check=True,
    )  # fmt: skip
    answer, _, status = done.stdout.rpartition(b"\n")
    assert status == b"413" and json.loads(answer)["error"] == (
        f"TOO_LARGE: the body is {len(body)} bytes, over the front door's limit of {MAX_FRAME} bytes "
        "([http] max_body_bytes, by default the server's [server] max_message_bytes); it was not read"
    )
    still_serves(defaulted)


def grpc_message_over(door: Door, limit: int) -> None:
    """A message one int64 over `limit` is refused by gRPC before it is parsed; the server goes on."""
    item = grpcclient.InferInput("tokens", [limit // 8 + 1], "INT64")
    item.set_data_from_numpy(np.ones(limit // 8 + 1, dtype=np.int64))
    with pytest.raises(InferenceServerException) as refused:
        grpcclient.InferenceServerClient(door.grpc).infer("lstm", [item])
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "Received message larger than max (" in refused.value.message()  # gRPC's own, before it is parsed
    assert f"vs. {limit})" in refused.value.message()
    still_serves(door)


def test_a_grpc_message_over_the_limit_is_resource_exhausted(limited: Door):
    """With max_body_bytes, gRPC's limit is that."""
    grpc_message_over(limited, MAX_BODY)


def test_by_default_a_grpc_message_over_the_servers_frame_limit_is_resource_exhausted(defaulted: Door):
    """Without max_body_bytes, gRPC's limit is the server's max_message_bytes."""
    grpc_message_over(defaulted, MAX_FRAME)


def test_a_body_within_the_limit_whose_tensors_are_over_the_frame_limit_gets_a_clear_error(defaulted: Door):
    """JSON `0` takes 2 bytes a value, the server's int64 8: the door parses it, and refuses it unsent."""
    count = MAX_FRAME // 6
    json_input = httpclient.InferInput("tokens", [count], "INT64")
    json_input.set_data_from_numpy(np.zeros(count, dtype=np.int64), binary_data=False)
    with pytest.raises(InferenceServerException) as refused:
        httpclient.InferenceServerClient(defaulted.http).infer("lstm", [json_input])
    assert refused.value.status() == "413"
    assert f"over the server's limit of {MAX_FRAME} bytes (server.max_message_bytes)" in refused.value.message()
    assert "oip-" not in refused.value.message()  # the door's own id for it means nothing to the caller
    typed = pb.ModelInferRequest(model_name="lstm")  # typed contents, which tritonclient never sends
    typed.inputs.add(name="tokens", datatype="INT64", shape=[count]).contents.int64_contents.extend([0] * count)
    assert typed.ByteSize() < MAX_FRAME  # a zero takes a byte
    with grpc.insecure_channel(defaulted.grpc) as channel, pytest.raises(grpc.RpcError) as exhausted:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(typed)
    assert exhausted.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"over the server's limit of {MAX_FRAME} bytes" in exhausted.value.details()
    still_serves(defaulted)


def test_an_http_client_that_disconnects_cancels_its_request(limited: Door):
    before = wait_idle(limited.server.client())
    body, headers = binary_body(LONG)
    host, port = limited.http.split(":")
    connection = socket.create_connection((host, int(port)))
    lines = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
    connection.sendall(
        f"POST /v2/models/lstm/infer HTTP/1.1\r\nHost: x\r\n{lines}Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    wait_until(lambda: running_since(limited, before), "the long request running")
    connection.close()
    assert cancelled_since(limited, before) == 1


def test_a_grpc_call_cancelled_by_its_client_is_cancelled_on_the_server(limited: Door):
    before = wait_idle(limited.server.client())
    triton = grpcclient.InferenceServerClient(limited.grpc)
    item = grpcclient.InferInput("tokens", [MAX_LENGTH], "INT64")
    item.set_data_from_numpy(LONG)
    outcome: list = []
    call = triton.async_infer("lstm", [item], callback=lambda result, error: outcome.append(error))
    wait_until(lambda: running_since(limited, before), "the long request running")
    call.cancel()
    assert cancelled_since(limited, before) == 1
    wait_until(lambda: outcome, "the client's callback")
    assert "CANCELLED" in str(outcome[0])


def test_overloaded_is_429_over_http_and_unavailable_over_grpc(limited: Door):
    """A second sequence past `max_sessions = 1` is refused at admission."""
    short = np.array([1, 2], dtype=np.int64)
    http = httpclient.InferenceServerClient(limited.http)
    http_input = httpclient.InferInput("tokens", [2], "INT64")
    http_input.set_data_from_numpy(short)
    http.infer("lstm", [http_input], sequence_id=1, sequence_start=True)
    try:
        with pytest.raises(InferenceServerException) as refused:
            http.infer("lstm", [http_input], sequence_id=2, sequence_start=True)
        assert refused.value.status() == "429" and OVERLOADED in refused.value.message()
        grpc_input = grpcclient.InferInput("tokens", [2], "INT64")
        grpc_input.set_data_from_numpy(short)
        with pytest.raises(InferenceServerException) as unavailable:
            grpcclient.InferenceServerClient(limited.grpc).infer(
                "lstm", [grpc_input], sequence_id=3, sequence_start=True
            )
        assert unavailable.value.status() == "StatusCode.UNAVAILABLE" and OVERLOADED in unavailable.value.message()
    finally:
        http.infer("lstm", [http_input], sequence_id=1, sequence_end=True)


def test_the_servers_retry_estimate_becomes_retry_after():
    response = error_response(DoorError(OVERLOADED, "the expected wait is 900 ms", retry_after_ms=1500))
    assert response.status == 429 and response.headers["Retry-After"] == "2"
    assert json.loads(response.body)["error"] == "OVERLOADED: the expected wait is 900 ms (retry after 1500 ms)"
    assert "Retry-After" not in error_response(DoorError(OVERLOADED, "too many sessions")).headers
    refusal = {"id": 1, "ok": False, "error": {"code": OVERLOADED, "message": "wait", "retry_after_ms": 120}}
    with pytest.raises(ServerError) as refused:  # how the front door's client hands the estimate over
        check(refusal)
    assert refused.value.retry_after_ms == 120
    with pytest.raises(ServerError) as refused:
        check({**refusal, "error": {**refusal["error"], "retry_after_ms": True}})
    assert refused.value.retry_after_ms is None


@pytest.mark.parametrize("running_batch", RUNNING_BATCH)
def test_a_stopping_server_answers_what_its_front_door_accepted(tmp_path: Path, running_batch: str):
    """Two front door processes share the port; a stop drains both: the long request is failed with a code
    (the drain timeout is shorter than the request), never dropped."""
    door = start_door(
        tmp_path,
        LONG_LSTM,
        server="drain_timeout_ms = 300",
        scheduler=f'running_batch = "{running_batch}"',
        http_extra="processes = 2",
    )
    assert len(door.server.supervisor.doors) == 2
    before = wait_idle(door.server.client())
    body, headers = binary_body(LONG)
    answer: list = []

    def send() -> None:
        request = urllib.request.Request(
            f"http://{door.http}/v2/models/lstm/infer", data=body, headers=headers, method="POST"
        )
        try:
            urllib.request.urlopen(request)
        except urllib.error.HTTPError as error:
            answer.append((error.code, json.loads(error.read())))

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_until(lambda: running_since(door, before), "the long request running")
    finally:
        stop_server(door.server)
        sender.join()
    [(status, error)] = answer
    assert status == 503 and error["error"].startswith("UNAVAILABLE")


def test_a_request_that_kills_its_worker_is_500_over_http_and_internal_over_grpc(tmp_path: Path):
    """The faulty LSTM's crash token kills the worker that runs it; with no replays left it fails with INTERNAL."""
    door = start_door(tmp_path, with_faults(tmp_path, SMALL_LSTM), server="max_replays = 0")
    crash = np.array([1, faulty_lstm.CRASH_TOKEN, 2], dtype=np.int64)
    try:
        http = httpclient.InferenceServerClient(door.http)
        item = httpclient.InferInput("tokens", [3], "INT64")
        item.set_data_from_numpy(crash)
        with pytest.raises(InferenceServerException) as failed:
            http.infer("lstm", [item])
        assert failed.value.status() == "500" and "INTERNAL" in failed.value.message()
        wait_until(http.is_server_ready, "the worker restarted", timeout=120)
        triton = grpcclient.InferenceServerClient(door.grpc)
        item = grpcclient.InferInput("tokens", [3], "INT64")
        item.set_data_from_numpy(crash)
        with pytest.raises(InferenceServerException) as failed:
            triton.infer("lstm", [item])
        assert failed.value.status() == "StatusCode.INTERNAL"
    finally:
        stop_server(door.server)
