"""/healthz and /readyz beside /metrics: unit checks of the values, and a served manager that drains."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from conftest import SMALL_LSTM, free_port, start_server, stop_server, wait_until, write_config

from batchmaker.common.protocol import decode, encode
from batchmaker.manager.observability.metrics import Metrics


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics(["lstm"], ["lstm/layer0"], liveness_timeout_s=5.0)
    yield m
    m.close()


def test_readiness_follows_workers_and_draining(metrics: Metrics) -> None:
    port = metrics.serve("127.0.0.1", 0)
    assert probe(port, "/readyz") == (503, "0 of 1 workers registered\n")
    metrics.set_readiness(1, 2, False)
    assert probe(port, "/readyz") == (503, "1 of 2 workers registered\n")
    metrics.set_readiness(2, 2, False)
    assert probe(port, "/readyz") == (200, "ready\n")
    metrics.set_readiness(2, 2, True)
    status, body = probe(port, "/readyz")
    assert status == 503 and body.startswith("draining")
    metrics.set_readiness(0, 0, False)
    assert probe(port, "/readyz")[0] == 503  # a server without workers serves nothing


def test_liveness_goes_stale_when_the_loop_stops_turning(metrics: Metrics) -> None:
    port = metrics.serve("127.0.0.1", 0)
    assert probe(port, "/healthz") == (200, "ok\n")
    metrics.set_liveness(time.monotonic() - 6.0)
    status, body = probe(port, "/healthz")
    assert status == 503 and "has not turned for 6." in body
    metrics.set_liveness(time.monotonic())
    assert probe(port, "/healthz") == (200, "ok\n")
    status, text = probe(port, "/metrics")
    assert status == 200 and "batchmaker_requests_total" in text
    assert probe(port, "/nothing-here")[0] == 200  # prometheus_client serves the metrics on any other path


def test_served_manager_is_ready_then_not_while_draining(tmp_path: Path) -> None:
    port = free_port()
    server_toml = f"""
    metrics_address = "127.0.0.1:{port}"
    heartbeat_timeout_ms = 120000
    hang_timeout_ms = 120000
    drain_timeout_ms = 120000
    """
    server = start_server(write_config(tmp_path, SMALL_LSTM, server=server_toml), workers=1)
    worker = server.supervisor.slots[0].process
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    client = server.client()
    try:
        wait_until(
            lambda: probe(port, "/readyz") == (200, "ready\n"), "readiness once the worker registered", 30.0, 0.02
        )
        assert probe(port, "/healthz") == (200, "ok\n")

        os.kill(worker.pid, signal.SIGSTOP)  # keeps the request below in flight, so the drain lasts
        socket.connect(server.address)
        socket.send(encode({"id": 1, "model": "lstm", "inputs": {"tokens": [5, 6, 7]}}))
        wait_until(lambda: client.stats()["requests_in_flight"] == 1, "the request to be in flight", 30.0, 0.02)
        os.kill(server.supervisor.manager.pid, signal.SIGTERM)
        wait_until(lambda: probe(port, "/readyz")[0] == 503, "not ready while draining", 30.0, 0.02)
        assert probe(port, "/readyz")[1].startswith("draining")
        assert probe(port, "/healthz") == (200, "ok\n")  # draining, yet its loop turns

        os.kill(worker.pid, signal.SIGCONT)
        assert socket.poll(60_000), "the accepted request was not answered during the drain"
        assert decode(socket.recv())["ok"] is True
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        socket.close()
        client.close()
        stop_server(server)
