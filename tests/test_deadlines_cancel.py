"""Deadlines and cancellation: the request ends with its error code, other requests are unaffected, slots are freed."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from conftest import wait_idle

from clients import AsyncClient, ServerError
from common.protocol import CANCELLED, DEADLINE_EXCEEDED

LONG = list(range(1, 201))  # the longest request the small test model accepts


def infer_message(request_id, tokens, **extra):
    return {"id": request_id, "model": "lstm", "inputs": {"tokens": tokens}, **extra}


def test_expired_deadline_while_queued(lstm_server):
    with lstm_server.client() as client:
        with pytest.raises(ServerError) as error:
            client.call(infer_message("late", [1, 2, 3], deadline_ms=0))
        assert error.value.code == DEADLINE_EXCEEDED and error.value.request_id == "late"
        assert client.infer("lstm", {"tokens": [1, 2, 3]}).outputs["h"].shape == (64,)
        assert wait_idle(client)["workers"]["0"]["slots_in_use"] == 0


def test_deadline_ends_a_long_request_mid_flight(lstm_server):
    async def run():
        async with AsyncClient(lstm_server.address, timeout=60) as client:
            long = asyncio.create_task(client.call(infer_message("long", LONG * 1, deadline_ms=5)))
            short = [client.infer("lstm", {"tokens": [1, 2, 3, 4]}) for _ in range(20)]
            return await asyncio.gather(long, *short, return_exceptions=True)

    long, *short = asyncio.run(run())
    assert isinstance(long, ServerError) and long.code == DEADLINE_EXCEEDED
    assert all(reply.outputs["h"].shape == (64,) for reply in short)
    with lstm_server.client() as client:
        stats = wait_idle(client)
    assert stats["requests"].get(DEADLINE_EXCEEDED) == 1
    assert stats["workers"]["0"]["slots_in_use"] == 0


def test_cancel_a_long_request_mid_flight_is_idempotent(lstm_server):
    async def run():
        async with AsyncClient(lstm_server.address, timeout=60) as client:
            long = asyncio.create_task(client.call(infer_message("long", LONG)))
            others = asyncio.gather(*(client.infer("lstm", {"tokens": [5] * n}) for n in range(1, 30)))
            await asyncio.sleep(0.005)
            first = await client.cancel("long")
            results = await asyncio.gather(long, others, return_exceptions=True)
            second = await client.cancel("long")
            return first, second, results

    first, second, (long, others) = asyncio.run(run())
    assert isinstance(long, ServerError) and long.code == CANCELLED and long.request_id == "long"
    assert first["ok"] and first["cancelled"] is True
    assert second["ok"] and second["cancelled"] is False
    assert len(others) == 29 and all(np.isfinite(r.outputs["h"]).all() for r in others)
    with lstm_server.client() as client:
        stats = wait_idle(client)
    assert stats["requests"].get(CANCELLED) == 1
    assert stats["workers"]["0"]["slots_in_use"] == 0


def test_requests_of_a_client_that_disconnects_are_cancelled(lstm_server):
    import msgpack
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(lstm_server.address)
    for i in range(20):
        socket.send(msgpack.packb(infer_message(i, LONG)))
    time.sleep(0.05)
    socket.close()  # gone without reading a reply
    with lstm_server.client() as client:
        stats = wait_idle(client)
        assert stats["requests"].get(CANCELLED, 0) >= 1  # the long requests still running were cancelled
        assert stats["requests"].get("ok", 0) + stats["requests"].get(CANCELLED, 0) == 20
        assert stats["workers"]["0"]["slots_in_use"] == 0
        assert client.infer("lstm", {"tokens": [1, 2]}).outputs["h"].shape == (64,)
