"""Streamed replies (`stream: true`) from a real server: partials, then the final reply, equal to the
unstreamed answer and to the reference; error paths; cancel, deadline and a reader that reads late."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from conftest import (
    ROOT,
    SMALL_LSTM,
    SMALL_SEQ2SEQ,
    RunningServer,
    start_server,
    stop_server,
    wait_idle,
    wait_until,
    wait_until_async,
    write_config,
)

from batchmaker.clients import AsyncClient, Partial, Reply, ServerError
from batchmaker.clients.cli import main as cli_main
from batchmaker.common.models import build_model
from batchmaker.common.models.base import save_weights
from batchmaker.common.models.seq2seq import decoding_mismatch
from batchmaker.common.protocol import BAD_REQUEST, CANCELLED, DEADLINE_EXCEEDED, INVALID_INPUT

LONG_DECODE = 30000  # decoder steps of a request that runs until cancelled: seconds at tens of µs a step
MODELS = SMALL_SEQ2SEQ.replace("max_decode_length = 60", f"max_decode_length = {LONG_DECODE}") + SMALL_LSTM
NEAR_TIE = 1e-4


RUNNING_BATCH = ["manager", "worker"]  # who decides each step: the manager's batching core, or each worker


@pytest.fixture(scope="module", params=RUNNING_BATCH)
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[RunningServer, object, dict]]:
    """A Seq2Seq model (and an LSTM, which cannot stream) served by one worker, with the model and weights."""
    scheduler = f'running_batch = "{request.param}"'
    config = write_config(tmp_path_factory.mktemp("streaming"), MODELS, scheduler=scheduler)
    server = start_server(config, workers=1)
    model = build_model(config.models["seq2seq"])
    yield server, model, model.load_weights()
    stop_server(server)


def sources(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"tokens": rng.integers(0, 1000, size=int(rng.integers(1, 30))).tolist(), "max_len": int(rng.integers(1, 50))}
        for _ in range(count)
    ]


def joined(partials: list[Partial]) -> np.ndarray:
    """The tokens of a stream's partials, in order (none of these streams restarts)."""
    assert partials and not any(p.restarted for p in partials)
    return np.concatenate([p.outputs["tokens"] for p in partials]).astype(np.int64)


def test_streamed_tokens_add_up_to_the_final_and_unstreamed_reply(served):
    server, model, state = served
    with server.client() as client:
        sent_before, received = client.stats()["partial_replies"], 0
        for inputs in sources(12, seed=3):
            *partials, final = client.stream("seq2seq", inputs)
            received += len(partials)
            assert isinstance(final, Reply) and all(isinstance(p, Partial) for p in partials)
            tokens = final.outputs["tokens"]
            unstreamed = client.infer("seq2seq", inputs).outputs["tokens"]
            assert np.array_equal(tokens, unstreamed)
            assert decoding_mismatch(tokens, model.reference(state, inputs), NEAR_TIE) is None
            if len(tokens):
                assert np.array_equal(joined(partials), tokens)
            assert set(final.timing) == {"queue_us", "compute_us", "total_us"}
        assert received and client.stats()["partial_replies"] - sent_before == received


def test_many_streams_at_once_on_the_async_client(served):
    """Streamed and unstreamed requests batched together: every stream adds up to its unstreamed answer."""
    server, _, _ = served
    requests = sources(40, seed=8)

    async def stream(client: AsyncClient, inputs: dict) -> list:
        return [item async for item in client.stream("seq2seq", inputs)]

    async def run() -> tuple[list, list]:
        async with AsyncClient(server.address, timeout=120) as client:
            streams = [stream(client, inputs) for inputs in requests]
            plain = [client.infer("seq2seq", inputs) for inputs in requests]
            results = await asyncio.gather(*streams, *plain)
            return results[: len(requests)], results[len(requests) :]

    streamed, plain = asyncio.run(run())
    for (*partials, final), reply in zip(streamed, plain):
        assert np.array_equal(final.outputs["tokens"], reply.outputs["tokens"])
        if len(reply.outputs["tokens"]):
            assert np.array_equal(joined(partials), reply.outputs["tokens"])


@pytest.mark.parametrize(
    "fields, code, words",
    [
        ({"model": "lstm", "inputs": {"tokens": [1, 2]}, "stream": True}, INVALID_INPUT, "cannot stream"),
        (
            {"model": "seq2seq", "inputs": {"tokens": [1, 2]}, "stream": "yes"},
            BAD_REQUEST,
            "'stream' must be true or false",
        ),
        (
            {"model": "seq2seq", "inputs": {"tokens": [1, 2]}, "stream": 1},
            BAD_REQUEST,
            "'stream' must be true or false",
        ),
        ({"model": "seq2seq", "inputs": {"tokens": []}, "stream": True}, INVALID_INPUT, "empty"),
    ],
)
def test_a_stream_that_cannot_be_served_is_refused_and_disturbs_nothing(served, fields, code, words):
    server, _, _ = served
    with server.client() as client:
        with pytest.raises(ServerError) as error:
            client.call({"op": "infer", **fields})
        assert error.value.code == code and words in error.value.message
        *_, final = client.stream("seq2seq", {"tokens": [4, 5, 6]})
        assert np.array_equal(final.outputs["tokens"], client.infer("seq2seq", {"tokens": [4, 5, 6]}).outputs["tokens"])


def test_the_protocol_docs_streaming_example_runs(served, tmp_path: Path):
    server, _, _ = served
    section = (ROOT / "docs" / "protocol.md").read_text().split("\n## Streaming\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    example = tmp_path / "example.py"
    example.write_text(code.replace("tcp://127.0.0.1:5555", server.address))
    subprocess.run([sys.executable, example], cwd=ROOT, check=True, timeout=120)


def test_the_models_reply_says_which_models_stream(served):
    server, _, _ = served
    with server.client() as client:
        models = client.models()["models"]
    assert models["seq2seq"]["stream"] is True and "stream" not in models["lstm"]


def start_endless(directory: Path, workers: int, running_batch: str) -> RunningServer:
    """Seq2Seq whose projection never picks EOS: every request decodes its whole `max_len`."""
    config = write_config(directory, MODELS, scheduler=f'running_batch = "{running_batch}"')
    model = build_model(config.models["seq2seq"])
    state = model.load_weights()
    state["decoder.projection.bias"][model.eos_id] = -1e4
    save_weights(state, config.models["seq2seq"].weights)
    return start_server(config, workers=workers)


@pytest.fixture(params=RUNNING_BATCH)
def endless(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    server = start_endless(tmp_path, 1, request.param)
    yield server
    stop_server(server)


def raw_socket(address: str, small_queue: bool = False) -> zmq.Socket:
    """A DEALER without the client library; `small_queue`: one whose queue and buffer fill at once."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if small_queue:
        socket.setsockopt(zmq.RCVHWM, 10)
        socket.setsockopt(zmq.RCVBUF, 4096)
    socket.connect(address)
    return socket


def receive(socket: zmq.Socket) -> dict:
    assert socket.poll(60_000), "no reply"
    return msgpack.unpackb(socket.recv(), raw=False)


def outcomes(server: RunningServer) -> dict[str, int]:
    with server.client() as client:
        return wait_idle(client)["requests"]


def test_cancel_mid_stream_ends_it_with_cancelled(endless):
    """After the first partial, a cancel ends the stream: its last reply is CANCELLED, short of max_len."""
    socket = raw_socket(endless.address)
    try:
        socket.send(
            msgpack.packb(
                {"id": "s", "model": "seq2seq", "inputs": {"tokens": [1, 2, 3], "max_len": LONG_DECODE}, "stream": True}
            )
        )
        first = receive(socket)
        assert first["partial"] is True and first["ok"] is True
        socket.send(msgpack.packb({"id": "c", "op": "cancel", "target": "s"}))
        streamed, final, cancel = len(first["outputs"]["tokens"]["data"]) // 8, None, None
        while final is None or cancel is None:
            reply = receive(socket)
            if reply["id"] == "c":
                cancel = reply
            elif reply.get("partial"):
                streamed += len(reply["outputs"]["tokens"]["data"]) // 8
            else:
                final = reply
        assert final["ok"] is False and final["error"]["code"] == CANCELLED
        assert cancel["cancelled"] is True
        assert 0 < streamed < LONG_DECODE
    finally:
        socket.close()
    assert outcomes(endless).get(CANCELLED) == 1


def test_leaving_a_stream_early_cancels_it(endless):
    with endless.client() as client:
        for item in client.stream("seq2seq", {"tokens": [7, 8], "max_len": LONG_DECODE}):
            assert isinstance(item, Partial)
            break
        assert outcomes(endless).get(CANCELLED) == 1
        *_, final = client.stream("seq2seq", {"tokens": [7, 8], "max_len": 5})  # the client goes on
        assert len(final.outputs["tokens"]) == 5


def test_leaving_an_async_stream_early_cancels_it(endless):
    async def run() -> None:
        async with AsyncClient(endless.address, timeout=60) as client:
            async with contextlib.aclosing(
                client.stream("seq2seq", {"tokens": [7, 8], "max_len": LONG_DECODE})
            ) as stream:
                async for item in stream:
                    assert isinstance(item, Partial)
                    break

            async def cancelled() -> bool:
                return (await client.stats())["requests"].get(CANCELLED) == 1

            await wait_until_async(cancelled, "the stream left early being cancelled")

    asyncio.run(run())


def test_a_deadline_ends_a_stream_mid_flight(endless):
    async def run() -> list:
        items = []
        async with AsyncClient(endless.address, timeout=60) as client:
            with pytest.raises(ServerError) as error:
                async for item in client.stream("seq2seq", {"tokens": [1], "max_len": LONG_DECODE}, deadline_ms=300):
                    items.append(item)
            assert error.value.code == DEADLINE_EXCEEDED
        return items

    items = asyncio.run(run())
    assert sum(len(p.outputs["tokens"]) for p in items) < LONG_DECODE
    assert outcomes(endless).get(DEADLINE_EXCEEDED) == 1


def test_a_reader_that_reads_late_gets_every_partial_once(served):
    """Hundreds of streams from a client that reads nothing until all are answered (far more replies
    than the sockets' queues hold): each stream's partials arrive in order and add up to its answer."""
    server, _, _ = served
    requests = sources(300, seed=21)
    socket = raw_socket(server.address, small_queue=True)
    try:
        with server.client() as client:
            before = client.stats()["requests"].get("ok", 0)
            for i, inputs in enumerate(requests):
                socket.send(msgpack.packb({"id": i, "model": "seq2seq", "inputs": inputs, "stream": True}))
            wait_until(
                lambda: client.stats()["requests"].get("ok", 0) - before == len(requests), "every stream answered", 300
            )
            tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
            finals: dict[int, list[int]] = {}
            while len(finals) < len(requests):
                reply = receive(socket)
                assert reply["ok"] is True and reply["id"] not in finals
                values = np.frombuffer(reply["outputs"]["tokens"]["data"], np.int64).tolist()
                if reply.get("partial"):
                    assert "restarted" not in reply
                    tokens[reply["id"]] += values
                else:
                    finals[reply["id"]] = values
            assert socket.poll(200) == 0
            assert all(tokens[i] == finals[i] for i in finals)
            assert client.stats()["unreachable_clients"] == 0
    finally:
        socket.close()


def test_cli_stream_prints_tokens_as_they_arrive(served, capsys):
    server, _, _ = served
    assert cli_main(["infer", "--address", server.address, "--model", "seq2seq", "--tokens", "4 5 6", "--stream"]) == 0
    lines = capsys.readouterr().out.splitlines()
    with server.client() as client:
        want = client.infer("seq2seq", {"tokens": [4, 5, 6]}).outputs["tokens"].tolist()
    partials = [line.removeprefix("partial tokens: ") for line in lines if line.startswith("partial tokens: ")]
    assert partials and " ".join(partials).split() == [str(t) for t in want]
    assert any(line.startswith("tokens: int64") for line in lines)


def test_cli_stream_json_prints_a_json_object_a_line(served, capsys):
    server, _, _ = served
    assert cli_main(
        ["infer", "--address", server.address, "--model", "seq2seq", "--tokens", "4 5 6", "--stream", "--json"]
    ) == 0
    *partials, final = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert partials and all(p["partial"] is True and p["restarted"] is False for p in partials)
    assert [t for p in partials for t in p["outputs"]["tokens"]] == final["outputs"]["tokens"]
    assert "partial" not in final and set(final["timing"]) == {"queue_us", "compute_us", "total_us"}


def test_cli_stream_refuses_a_model_that_cannot_stream(served, capsys):
    server, _, _ = served
    assert cli_main(["infer", "--address", server.address, "--model", "lstm", "--tokens", "4 5", "--stream"]) == 1
    assert "INVALID_INPUT" in capsys.readouterr().err


@pytest.mark.parametrize("running_batch", RUNNING_BATCH)
def test_a_stream_replayed_after_its_worker_is_lost_restarts_and_says_so(tmp_path: Path, running_batch: str):
    """The worker holding a stream's values is killed after its first partial: the request is replayed
    on the other worker, and its next partial says `restarted`; what follows adds up to the answer."""
    server = start_endless(tmp_path, 2, running_batch)
    try:
        with server.client(timeout=120) as client:
            stream = client.stream("seq2seq", {"tokens": [3, 1, 4], "max_len": LONG_DECODE})
            assert isinstance(next(stream), Partial)
            stats = client.stats()
            routed = stats["routed"]["by_worker"]  # a request routed whole holds no slot of the manager's
            holding = [w for i, w in stats["workers"].items() if w["slots_in_use"] > 0 or routed.get(i, 0) > 0]
            victim = holding[0]["pid"]
            os.kill(victim, signal.SIGKILL)
            *partials, final = stream
            restarts = [i for i, p in enumerate(partials) if p.restarted]
            assert len(restarts) == 1
            after = partials[restarts[0] :]
            assert np.array_equal(np.concatenate([p.outputs["tokens"] for p in after]), final.outputs["tokens"])
            assert len(final.outputs["tokens"]) == LONG_DECODE
            assert client.stats()["replayed_requests"] == 1
    finally:
        stop_server(server)
