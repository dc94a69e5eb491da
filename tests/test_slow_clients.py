"""Replies wait for clients that read slowly: none is dropped while the client is connected."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import zmq
from conftest import SMALL_LSTM, start_server, stop_server, write_config

REQUESTS = 9000


def stats(server) -> dict:
    with server.client(timeout=10) as client:
        return client.stats()


def answered(server) -> int:
    return sum(count for outcome, count in stats(server)["requests"].items() if outcome != "received")


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_client_that_reads_late_gets_every_reply_once(tmp_path: Path):
    """A raw client with default socket options sends thousands of requests and reads nothing until the
    server has answered them all (far more than the socket's high-water mark); then every reply arrives."""
    config = write_config(tmp_path, SMALL_LSTM)
    server = start_server(config, workers=1)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    try:
        socket.connect(config.server.address)
        for i in range(REQUESTS):
            socket.send(msgpack.packb({"id": i, "model": "lstm", "inputs": {"tokens": [i % 1000, 7, 9]}}))
        assert wait_until(lambda: answered(server) >= REQUESTS, timeout=300)
        ids = []
        while len(ids) < REQUESTS and socket.poll(30_000):
            reply = msgpack.unpackb(socket.recv(), raw=False)
            assert reply["ok"], reply
            ids.append(reply["id"])
        assert sorted(ids) == list(range(REQUESTS))  # each exactly once
        assert socket.poll(500) == 0
    finally:
        socket.close(linger=0)
        context.term()
        stop_server(server)


def test_a_client_that_never_reads_is_taken_for_gone(tmp_path: Path):
    """Past `unreachable_client_ms` without reading, the client's replies are dropped and its
    requests cancelled; other clients are served all along."""
    config = write_config(tmp_path, SMALL_LSTM, server="unreachable_client_ms = 1000")
    server = start_server(config, workers=1)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.RCVHWM, 10)
    socket.setsockopt(zmq.RCVBUF, 4096)
    try:
        socket.connect(config.server.address)
        for i in range(30000):  # more replies than its queue, the socket buffers and the server's queue hold
            socket.send(msgpack.packb({"id": i, "model": "lstm", "inputs": {"tokens": [1, 2, 3]}}))
        assert wait_until(lambda: answered(server) >= 30000, timeout=300)
        with server.client(timeout=30) as other:
            assert other.infer("lstm", {"tokens": [1, 2, 3]}).outputs["h"].dtype == "float32"
        # The stuck client's backlog is dropped once it has not moved for a second.
        assert wait_until(lambda: stats(server)["unreachable_clients"] == 1, timeout=60)
        assert stats(server)["requests_in_flight"] == 0
    finally:
        socket.close(linger=0)
        context.term()
        stop_server(server)
