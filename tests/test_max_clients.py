"""`server.max_clients`: a connection beyond the cap is closed when accepted and never served, while
the connections within it keep being answered; a freed place is taken by the next client."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from conftest import SMALL_LSTM, start_server, stop_server, wait_until, write_config
from zmq.utils.monitor import recv_monitor_message

TOKENS = [5, 7, 9]


def ask(socket: zmq.Socket, message: dict) -> dict:
    """Send one request on a raw DEALER and wait for its reply (event-based: the poll ends with the reply)."""
    socket.send(msgpack.packb(message))
    assert socket.poll(60_000), f"no reply to {message}"
    return msgpack.unpackb(socket.recv(), raw=False)


def dealer(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


def output_h(reply: dict) -> np.ndarray:
    assert reply["ok"], reply
    h = reply["outputs"]["h"]
    return np.frombuffer(h["data"], dtype=h["dtype"]).reshape(h["shape"])


@pytest.fixture
def capped(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM, server="max_clients = 2")
    server = start_server(config, workers=1)
    context = zmq.Context()
    try:
        yield server, context
    finally:
        context.destroy(linger=0)
        stop_server(server)


def test_a_connection_beyond_max_clients_is_closed_and_never_served(capped):
    server, context = capped
    first, second = dealer(context, server.address), dealer(context, server.address)
    expected = output_h(ask(first, {"id": 1, "op": "infer", "model": "lstm", "inputs": {"tokens": TOKENS}}))
    assert ask(second, {"id": 1, "op": "health"})["ok"]

    third = dealer(context, server.address)
    closed = third.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    third.send(msgpack.packb({"id": "refused", "op": "infer", "model": "lstm", "inputs": {"tokens": TOKENS}}))
    assert closed.poll(60_000), "the third connection was not closed"
    assert recv_monitor_message(closed)["event"] == zmq.EVENT_DISCONNECTED

    for i in range(2, 6):  # the two within the cap are answered, correctly, all along
        assert np.array_equal(output_h(ask(first, {"id": i, "model": "lstm", "inputs": {"tokens": TOKENS}})), expected)
        assert np.array_equal(output_h(ask(second, {"id": i, "model": "lstm", "inputs": {"tokens": TOKENS}})), expected)
    health = ask(first, {"id": "probe", "op": "health"})
    assert health["ok"] and health["id"] == "probe"
    stats = ask(second, {"id": "stats", "op": "stats"})
    assert stats["client_connections"] == 2 and stats["refused_connections"] >= 1
    assert stats["requests"]["received"] == 1 + 8  # the refused client's infer never reached the server
    calls = {"models": 0, "health": 2, "stats": 1, "cancel": 0, "load": 0, "unload": 0, "reload": 0}
    assert stats["control_calls"] == calls
    assert third.poll(0) == 0

    third.disable_monitor()
    closed.close()
    third.close()  # before a place frees: its reconnections would compete for it
    first.close()
    wait_until(
        lambda: ask(second, {"id": "n", "op": "stats"})["client_connections"] == 1, "the first client's departure"
    )
    with server.client(timeout=60) as newcomer:
        assert np.array_equal(newcomer.infer("lstm", {"tokens": TOKENS}).outputs["h"], expected)
    second.close()


def test_a_refused_client_is_told_why_it_got_no_reply(capped):
    server, context = capped
    first, second = dealer(context, server.address), dealer(context, server.address)
    assert ask(first, {"id": 1, "op": "health"})["ok"] and ask(second, {"id": 1, "op": "health"})["ok"]
    with server.client(timeout=3) as refused, pytest.raises(TimeoutError, match="closed the connection .*max_clients"):
        refused.health()
    first.close()
    second.close()

