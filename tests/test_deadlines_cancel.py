"""Deadlines and cancellation: the request ends with its error code, other requests are unaffected, slots are freed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import SMALL_LSTM, start_server, stop_server, wait_idle, wait_until, wait_until_async, write_config

from batchmaker.clients import AsyncClient, ServerError
from batchmaker.common.config import load_config
from batchmaker.common.protocol import CANCELLED, DEADLINE_EXCEEDED

# A request that takes a second or two on a small idle CPU: the tests below end it long before it could finish.
MAX_LENGTH = 20000
LONG = [1 + i % 999 for i in range(MAX_LENGTH)]


@pytest.fixture(scope="module", params=["manager", "worker"])
def long_lstm_server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """A server that has planned a request of MAX_LENGTH tokens once (planning a new length takes a
    while on a busy machine): a deadline then counts the request's running, not its planning. The
    module's tests share it: each counts what happened since it started (`before`). Served twice: with
    the manager deciding each step, and with the worker running its own batch (`running_batch`)."""
    directory = tmp_path_factory.mktemp("deadlines")
    models = SMALL_LSTM.replace("max_length = 200", f"max_length = {MAX_LENGTH}")
    config = write_config(directory, models, scheduler=f'running_batch = "{request.param}"')
    # A running batch takes all the rows of a request's tokens when it admits it: its arenas must hold LONG's.
    config.path.write_text(config.path.read_text().replace("arena_rows = 4096", f"arena_rows = {MAX_LENGTH + 1024}"))
    config = load_config(config.path)
    server = start_server(config, workers=1)
    with server.client(timeout=120) as client:  # run once, so planned by the manager and by the worker alike
        assert client.infer("lstm", {"tokens": LONG}).outputs["h"].shape == (64,)
    yield server
    stop_server(server)


@pytest.fixture
def before(long_lstm_server) -> dict:
    """The server's stats once idle and with its worker registered (a worker lost in an earlier test
    has been replaced), before the test: the earlier tests' requests and the planning one counted."""
    with long_lstm_server.client() as client:
        wait_until(lambda: client.health()["status"] == "ready", "the server's worker registered")
        return wait_idle(client)


def held(stats: dict) -> int:
    """What the worker still holds for requests: arena slots of tasks (the manager's steps) and requests routed
    to its running batch."""
    [worker] = stats["workers"].values()
    return worker["slots_in_use"] + sum(stats["routed"]["by_worker"].values())


def outcomes_since(before: dict, stats: dict) -> dict[str, int]:
    return {code: count - before["requests"].get(code, 0) for code, count in stats["requests"].items()}


def started(stats: dict, before: dict) -> bool:
    """Whether the requests sent since `before` are at the worker: the manager has submitted a task since
    (the manager's steps), or routed them whole (the worker's running batch).

    The task count never goes down, so the first holds even if the request has ended since. With an idle
    worker, the manager submits a request's first task in the loop turn that admits it: a deadline
    would have to pass within that one turn to end the request while still queued. A request routed whole
    goes to the worker in the turn that admits it (the manager queues none) and stays routed until it ends.
    """
    return stats["tasks"] > before["tasks"] or bool(stats["routed"]["by_worker"])


async def wait_running(client: AsyncClient, before: dict) -> None:
    """Until the one request sent so far is at the worker."""

    async def running() -> bool:
        return started(await client.stats(), before)

    await wait_until_async(running, "the long request starting")


def infer_message(request_id, tokens, **extra):
    return {"id": request_id, "model": "lstm", "inputs": {"tokens": tokens}, **extra}


def test_expired_deadline_while_queued(long_lstm_server, before):
    with long_lstm_server.client() as client:
        with pytest.raises(ServerError) as error:
            client.call(infer_message("late", [1, 2, 3], deadline_ms=0))
        assert error.value.code == DEADLINE_EXCEEDED and error.value.request_id == "late"
        assert client.infer("lstm", {"tokens": [1, 2, 3]}).outputs["h"].shape == (64,)
        assert held(wait_idle(client)) == 0


def test_deadline_ends_a_long_request_mid_flight(long_lstm_server, before):
    async def run():
        async with AsyncClient(long_lstm_server.address, timeout=60) as client:
            long = asyncio.create_task(client.call(infer_message("long", LONG, deadline_ms=500)))
            await wait_running(client, before)  # started within its deadline: it expires mid-flight, not in the queue
            short = [client.infer("lstm", {"tokens": [1, 2, 3, 4]}) for _ in range(20)]
            return await asyncio.gather(long, *short, return_exceptions=True)

    long, *short = asyncio.run(run())
    assert isinstance(long, ServerError) and long.code == DEADLINE_EXCEEDED
    assert all(reply.outputs["h"].shape == (64,) for reply in short)
    with long_lstm_server.client() as client:
        stats = wait_idle(client)
    assert outcomes_since(before, stats).get(DEADLINE_EXCEEDED) == 1
    assert held(stats) == 0


def test_cancel_a_long_request_mid_flight_is_idempotent(long_lstm_server, before):
    async def run():
        async with AsyncClient(long_lstm_server.address, timeout=60) as client:
            long = asyncio.create_task(client.call(infer_message("long", LONG)))
            await wait_running(client, before)
            others = asyncio.gather(*(client.infer("lstm", {"tokens": [5] * n}) for n in range(1, 30)))
            first = await client.cancel("long")
            results = await asyncio.gather(long, others, return_exceptions=True)
            second = await client.cancel("long")
            return first, second, results

    first, second, (long, others) = asyncio.run(run())
    assert isinstance(long, ServerError) and long.code == CANCELLED and long.request_id == "long"
    assert first["ok"] and first["cancelled"] is True
    assert second["ok"] and second["cancelled"] is False
    assert len(others) == 29 and all(np.isfinite(r.outputs["h"]).all() for r in others)
    with long_lstm_server.client() as client:
        stats = wait_idle(client)
    assert outcomes_since(before, stats).get(CANCELLED) == 1
    assert held(stats) == 0


def test_requests_of_a_client_that_disconnects_are_cancelled(long_lstm_server, before):
    import msgpack
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(long_lstm_server.address)
    for i in range(20):
        socket.send(msgpack.packb(infer_message(i, LONG)))
    with long_lstm_server.client() as client:

        def all_running() -> bool:
            stats = client.stats()
            return stats["requests_in_flight"] == 20 and started(stats, before)

        wait_until(all_running, "the 20 long requests starting")
        socket.close()  # gone without reading a reply
        stats = wait_idle(client)
        assert outcomes_since(before, stats).get(CANCELLED) == 20  # all were still in flight
        assert held(stats) == 0
        assert client.infer("lstm", {"tokens": [1, 2]}).outputs["h"].shape == (64,)
