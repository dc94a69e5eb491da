"""Prometheus metrics: values as a scraper sees them over HTTP, isolation between instances, port release."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchmaker.manager.observability.metrics import MAX_CONNECTIONS, Metrics


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics(["lstm", "gru"], ["lstm/layer0", "gru/layer0"])
    yield m
    m.close()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:PORT/metrics keyed by (sample name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_scraped_values(metrics: Metrics) -> None:
    metrics.request_finished("lstm", "ok", 0.004, 0.001)
    metrics.request_finished("lstm", "ok", 0.030, 0.0002)
    metrics.request_finished("lstm", "DEADLINE_EXCEEDED", None, None)
    metrics.request_finished("gru", "ok", 3.0, 1.0)
    metrics.request_refused("BAD_REQUEST")
    metrics.request_refused("BAD_REQUEST")
    metrics.partial_sent("lstm")
    metrics.partial_sent("lstm")
    metrics.control_call("stats")
    for size in (1, 3, 32):
        metrics.task_submitted("lstm/layer0", size)
    metrics.set_queue_depth("lstm/layer0", 17)
    metrics.set_worker("0", 4, 7, 1200, 4096)
    metrics.set_worker("1", 2, 3, 10, 4096)
    metrics.remove_worker("1")
    metrics.worker_restarted()
    port = metrics.serve("127.0.0.1", 0)
    samples = scrape(port)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("batchmaker_requests_total", model="lstm", outcome="ok") == 2
    assert value("batchmaker_requests_total", model="lstm", outcome="DEADLINE_EXCEEDED") == 1
    assert value("batchmaker_requests_total", model="gru", outcome="ok") == 1
    assert value("batchmaker_requests_total", model="-", outcome="BAD_REQUEST") == 2
    assert value("batchmaker_requests_total", model="gru", outcome="OVERLOADED") == 0  # present before any event
    assert value("batchmaker_partial_replies_total", model="lstm") == 2
    assert value("batchmaker_partial_replies_total", model="gru") == 0
    assert value("batchmaker_control_calls_total", op="stats") == 1
    assert value("batchmaker_control_calls_total", op="health") == 0  # present before any call

    assert value("batchmaker_request_latency_seconds_count", model="lstm") == 2  # errors are not observed
    assert value("batchmaker_request_latency_seconds_sum", model="lstm") == pytest.approx(0.034)
    assert value("batchmaker_request_latency_seconds_bucket", model="lstm", le="0.005") == 1
    assert value("batchmaker_request_latency_seconds_bucket", model="lstm", le="0.05") == 2
    assert value("batchmaker_request_latency_seconds_bucket", model="gru", le="2.0") == 0
    assert value("batchmaker_request_latency_seconds_bucket", model="gru", le="10.0") == 1
    assert value("batchmaker_request_queue_seconds_bucket", model="lstm", le="0.0005") == 1
    assert value("batchmaker_request_queue_seconds_sum", model="gru") == pytest.approx(1.0)

    assert value("batchmaker_tasks_total", cell_type="lstm/layer0") == 3
    assert value("batchmaker_tasks_total", cell_type="gru/layer0") == 0
    assert value("batchmaker_batch_size_bucket", cell_type="lstm/layer0", le="1.0") == 1
    assert value("batchmaker_batch_size_bucket", cell_type="lstm/layer0", le="4.0") == 2
    assert value("batchmaker_batch_size_bucket", cell_type="lstm/layer0", le="32.0") == 3
    assert value("batchmaker_batch_size_bucket", cell_type="lstm/layer0", le="1024.0") == 3
    assert value("batchmaker_batch_size_sum", cell_type="lstm/layer0") == 36
    assert value("batchmaker_queue_depth_nodes", cell_type="lstm/layer0") == 17

    assert value("batchmaker_worker_tasks_in_flight", worker="0") == 4
    assert value("batchmaker_worker_requests_in_flight", worker="0") == 7
    assert value("batchmaker_arena_rows_in_use", worker="0") == 1200
    assert value("batchmaker_arena_rows_capacity", worker="0") == 4096
    assert not [key for key in samples if ("worker", "1") in key[1]]  # a removed worker leaves no stale series
    assert value("batchmaker_worker_restarts_total") == 1


def test_unknown_model_is_not_a_label(metrics: Metrics) -> None:
    """A model name the server does not serve is counted under "-" rather than creating a series."""
    metrics.request_finished("no-such-model", "UNKNOWN_MODEL", None, None)
    text = metrics.exposition().decode()
    assert "no-such-model" not in text
    assert 'batchmaker_requests_total{model="-",outcome="UNKNOWN_MODEL"} 1.0' in text


def test_instances_do_not_collide() -> None:
    first = Metrics(["lstm"], ["lstm/layer0"])
    second = Metrics(["lstm"], ["lstm/layer0"])
    try:
        first.request_finished("lstm", "ok", 0.01, 0.001)
        first.worker_restarted()
        second.set_queue_depth("lstm/layer0", 5)
        first_port, second_port = first.serve("127.0.0.1", 0), second.serve("127.0.0.1", 0)
        assert first_port != second_port
        a, b = scrape(first_port), scrape(second_port)
        ok = ("batchmaker_requests_total", (("model", "lstm"), ("outcome", "ok")))
        assert (a[ok], b[ok]) == (1, 0)
        assert (a[("batchmaker_worker_restarts_total", ())], b[("batchmaker_worker_restarts_total", ())]) == (1, 0)
        depth = ("batchmaker_queue_depth_nodes", (("cell_type", "lstm/layer0"),))
        assert (a[depth], b[depth]) == (0, 5)
    finally:
        first.close()
        second.close()


def test_close_frees_the_port(metrics: Metrics) -> None:
    port = metrics.serve("127.0.0.1", 0)
    with pytest.raises(RuntimeError):
        metrics.serve("127.0.0.1", 0)
    scrape(port)
    metrics.close()
    metrics.close()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    again = Metrics(["lstm"], [])
    try:
        assert again.serve("127.0.0.1", port) == port  # a restarted manager can take the same port
        scrape(port)
    finally:
        again.close()


def test_serve_binds_the_given_host_only(metrics: Metrics) -> None:
    port = metrics.serve("127.0.0.1", 0)
    listening = [
        c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert listening == ["127.0.0.1"]


def test_idle_connections_are_capped_and_timed_out(metrics: Metrics) -> None:
    """Connections that send nothing hold at most MAX_CONNECTIONS threads, each for CONNECTION_TIMEOUT_S."""
    port = metrics.serve("127.0.0.1", 0)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(MAX_CONNECTIONS)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as extra:
            try:
                extra.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                answer = extra.recv(1024)
            except ConnectionResetError:  # closed before our request arrived
                answer = b""
            assert answer == b"", "a connection beyond the cap was served"
        for connection in idle:  # each closed by the server once its timeout passes
            assert connection.recv(1) == b""
        scrape(port)  # the slots are free again
    finally:
        for connection in idle:
            connection.close()
