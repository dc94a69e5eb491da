"""The clients' retries against a real server at its expected-wait bound (`max_queue_delay_ms`): what it
refuses with OVERLOADED (and its `retry_after_ms`) the default clients send again after a backoff, so
every request of a burst is answered, with the reference model's result; with retries off, the caller
gets the OVERLOADED. And a request over the server's max_message_bytes, which the clients learn from its
`health`, is refused before it is sent. The bursts run beside processes that keep both cores busy, as on
a machine where something else runs: the clients' budget is their timeout, not a count of quick resends.
Nothing here is timed: the tests wait for what the clients and the server report."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import SMALL_LSTM, start_server, stop_server, wait_until, write_config

from batchmaker.clients import AsyncClient, Client, Reply, RequestTooLarge, ServerError
from batchmaker.common.models import build_model
from batchmaker.common.protocol import OVERLOADED, decode, encode

LIMIT_MS = 20
BURST = 200
LARGE_BURST = 1_500
SYNC_THREADS = 30  # sync clients side by side, one each, for part of the large burst
SYNC_REQUESTS = 300  # of the large burst, sent by the sync clients; the async client sends the rest
BUSY_PROCESSES = 2  # CPU-bound processes beside the server: as many as the machine's cores here
MESSAGE_LIMIT = 64 * 1024  # the server's max_message_bytes, below the clients' default


def sentences(rng: np.random.Generator, count: int) -> list[list[int]]:
    return [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(30, 70, count)]


class Flood:
    """A raw DEALER socket that keeps the server at its bound: it sends bursts and reads their replies."""

    def __init__(self, address: str):
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        for option in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self.socket.setsockopt(option, 0)
        self.socket.connect(address)
        self.sent = 0

    def send(self, burst: list[list[int]]) -> None:
        for tokens in burst:
            self.sent += 1
            self.socket.send(encode({"id": self.sent, "model": "lstm", "inputs": {"tokens": tokens}}))

    def replies(self) -> list[dict[str, Any]]:
        """The replies that came in so far."""
        replies = []
        while self.socket.poll(0):
            replies.append(decode(self.socket.recv()))
        return replies

    def close(self) -> None:
        self.socket.close()


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    settings = f"max_queue_delay_ms = {LIMIT_MS}\nmax_message_bytes = {MESSAGE_LIMIT}"
    config = write_config(tmp_path_factory.mktemp("bounded"), SMALL_LSTM, server=settings)
    model = build_model(config.models["lstm"])
    server = start_server(config, workers=1)
    yield server, model, model.load_weights()
    stop_server(server)


@pytest.fixture
def busy_machine() -> Iterator[None]:
    """Processes that spin for as long as the test runs, so that the server shares its cores."""
    spin = "while True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(BUSY_PROCESSES)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def check_outputs(model: Any, state: Any, tokens: list[int], reply: Reply) -> None:
    expected = model.reference(state, {"tokens": tokens})
    for name in ("h", "c"):
        assert np.abs(reply.outputs[name] - expected[name]).max() <= 1e-5, name


def test_the_async_client_gets_every_request_of_a_burst_answered(bounded: Any, busy_machine: None) -> None:
    server, model, state = bounded
    burst = sentences(np.random.default_rng(11), BURST)

    async def run() -> tuple[list[Reply], int]:
        async with AsyncClient(server.address) as client:
            replies = await asyncio.gather(*(client.infer("lstm", {"tokens": tokens}) for tokens in burst))
            return replies, client.retries

    replies, retries = asyncio.run(run())
    assert retries > 0, "the burst was never refused: the server was not at its bound"
    for tokens, reply in zip(burst, replies):
        check_outputs(model, state, tokens, reply)


def test_the_sync_client_gets_its_requests_answered_while_a_flood_holds_the_server_at_its_bound(bounded: Any) -> None:
    server, model, state = bounded
    rng = np.random.default_rng(12)
    flood = Flood(server.address)
    try:
        with Client(server.address) as client:

            def refused_and_answered() -> bool:
                flood.send(sentences(rng, BURST))
                tokens = sentences(rng, 1)[0]
                check_outputs(model, state, tokens, client.infer("lstm", {"tokens": tokens}))
                return client.retries > 0

            wait_until(refused_and_answered, "a request of the sync client refused, retried and answered")
        # The flood was refused too (so the server was at its bound), with the server's estimate to retry after.
        refusals = [r["error"] for r in flood.replies() if not r["ok"]]
        assert refusals and all(error["code"] == OVERLOADED for error in refusals)
        assert any(isinstance(error.get("retry_after_ms"), int) and error["retry_after_ms"] > 0 for error in refusals)
    finally:
        flood.close()


def test_a_large_burst_through_the_default_clients_is_answered_on_a_busy_machine(
    bounded: Any, busy_machine: None
) -> None:
    """One async client and sync clients (one per thread) send a burst between them, side by side: every request
    is answered with the reference's result within the default timeout, however often it was refused."""
    server, model, state = bounded
    burst = sentences(np.random.default_rng(15), LARGE_BURST)
    by_sync, by_async = burst[:SYNC_REQUESTS], burst[SYNC_REQUESTS:]
    started = threading.Barrier(SYNC_THREADS + 1)

    async def run_async() -> tuple[list[Reply], int]:
        async with AsyncClient(server.address) as client:
            calls = [client.infer("lstm", {"tokens": tokens}) for tokens in by_async]
            await asyncio.to_thread(started.wait)
            return await asyncio.gather(*calls), client.retries

    def run_sync(part: list[list[int]]) -> tuple[list[Reply], int]:
        with Client(server.address) as client:
            started.wait()
            return [client.infer("lstm", {"tokens": tokens}) for tokens in part], client.retries

    parts = [by_sync[i::SYNC_THREADS] for i in range(SYNC_THREADS)]
    with ThreadPoolExecutor(SYNC_THREADS) as pool:
        synced = pool.map(run_sync, parts)
        replies, retries = asyncio.run(run_async())
        synced = list(synced)
    assert retries + sum(count for _, count in synced) > 0, "no request was refused: the server was not at its bound"
    for tokens, reply in zip(by_async, replies):
        check_outputs(model, state, tokens, reply)
    for part, (answers, _) in zip(parts, synced):
        for tokens, reply in zip(part, answers):
            check_outputs(model, state, tokens, reply)


def test_with_retries_off_the_caller_gets_the_overloaded(bounded: Any) -> None:
    server, _, _ = bounded
    burst = sentences(np.random.default_rng(13), BURST)

    async def run() -> tuple[list[Any], int]:
        async with AsyncClient(server.address, max_retries=0) as client:
            calls = (client.infer("lstm", {"tokens": tokens}) for tokens in burst)
            return await asyncio.gather(*calls, return_exceptions=True), client.retries

    results, retries = asyncio.run(run())
    refused = [r for r in results if isinstance(r, ServerError)]
    assert retries == 0 and refused and all(error.code == OVERLOADED for error in refused)
    assert all(isinstance(r, (Reply, ServerError)) for r in results)


def test_a_request_over_the_servers_limit_is_refused_before_sending(bounded: Any) -> None:
    server, model, state = bounded
    too_large = {"tokens": np.arange(MESSAGE_LIMIT // 4, dtype=np.int64) % 1000}
    tokens = sentences(np.random.default_rng(14), 1)[0]
    with Client(server.address) as client:
        with pytest.raises(RequestTooLarge, match=rf"limit of {MESSAGE_LIMIT} bytes \(server.max_message_bytes\)"):
            client.infer("lstm", too_large)
        check_outputs(model, state, tokens, client.infer("lstm", {"tokens": tokens}))

    async def run() -> list[Any]:
        async with AsyncClient(server.address) as client:
            calls = [client.infer("lstm", too_large), client.infer("lstm", {"tokens": tokens})]
            return await asyncio.gather(*calls, return_exceptions=True)

    refused, answered = asyncio.run(run())
    assert isinstance(refused, RequestTooLarge) and refused.limit == MESSAGE_LIMIT
    check_outputs(model, state, tokens, answered)
