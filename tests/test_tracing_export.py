"""Spans exported by a real server process over OTLP to a receiver in the test (HTTP and gRPC), decoded
with the collector's own protobuf messages; a collector that is down under a burst; and start-up with
and without the OpenTelemetry packages installed."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import ROOT, SMALL_LSTM, free_port, start_server, stop_server, wait_idle, wait_until, write_config
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from batchmaker.clients import AsyncClient, Client
from batchmaker.common.models import build_model
from batchmaker.manager.commands.launcher import stop_server as stop_process
from batchmaker.manager.commands.launcher import wait_until_ready
from batchmaker.manager.observability.tracing import SPAN_NAME

TOLERANCE = 1e-5
RUNNING_BATCH = ["manager", "worker"]  # who decides each step: the manager's tasks, or the worker's running batch
CALLER = trace.get_tracer("test-caller", tracer_provider=TracerProvider())


class Receiver:
    """The spans a collector received, by (service name, span) as decoded from ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def take(self, payload: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(payload)
        with self._lock:
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope_spans.spans]

    def requests(self) -> list[tuple[str, object]]:
        with self._lock:
            return [(service, span) for service, span in self.spans if span.name == SPAN_NAME]


def http_receiver(receiver: Receiver) -> tuple[str, object]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
            receiver.take(self.rfile.read(int(self.headers["Content-Length"])))
            body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1/traces", server.shutdown


def grpc_receiver(receiver: Receiver) -> tuple[str, object]:
    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            receiver.take(request.SerializeToString())
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return f"http://127.0.0.1:{port}", lambda: server.stop(None)


@pytest.fixture(params=["http/protobuf", "grpc"])
def collector(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Receiver]]:
    receiver = Receiver()
    endpoint, stop = (http_receiver if request.param == "http/protobuf" else grpc_receiver)(receiver)
    yield request.param, endpoint, receiver
    stop()


def check_lstm(config, tokens: list[int], outputs: dict) -> None:
    model = build_model(config.models["lstm"])
    expected = model.reference(model.load_weights(), {"tokens": tokens})
    for name in ("h", "c"):
        assert float(np.abs(outputs[name] - expected[name]).max()) <= TOLERANCE


@pytest.mark.parametrize("running_batch", RUNNING_BATCH)
def test_spans_reach_the_collector_as_children_of_the_callers(tmp_path: Path, collector, running_batch: str):
    """At sample_rate 0 only the request whose caller sampled its span is traced, and its span is that span's child.
    Its own children are the tasks that carried its cells; a request routed whole to a worker's running batch has
    none, and its span names that worker."""
    protocol, endpoint, receiver = collector
    tracing = f'[tracing]\nendpoint = "{endpoint}"\nprotocol = "{protocol}"\nservice_name = "tracing-test"\n'
    config = write_config(tmp_path, SMALL_LSTM + tracing, scheduler=f'running_batch = "{running_batch}"')
    server = start_server(config, workers=1)
    try:
        with server.client() as client:
            worker_id = client.health()["workers"][0]["id"]
            untraced = client.infer("lstm", {"tokens": [1, 2, 3]})
            with CALLER.start_as_current_span("caller") as caller:
                traced = client.infer("lstm", {"tokens": [4, 5, 6, 7]})
            [(service, span)] = wait_until(receiver.requests, "the request's span at the collector")
            stats = client.stats()["tracing"]
        check_lstm(config, [1, 2, 3], untraced.outputs)
        check_lstm(config, [4, 5, 6, 7], traced.outputs)
        context = caller.get_span_context()
        assert service == "tracing-test"
        assert int.from_bytes(span.trace_id, "big") == context.trace_id
        assert int.from_bytes(span.parent_span_id, "big") == context.span_id
        attributes = {a.key: a.value for a in span.attributes}
        assert attributes["batchmaker.model"].string_value == "lstm"
        assert attributes["batchmaker.queue_us"].int_value == traced.timing["queue_us"]
        assert attributes["batchmaker.compute_us"].int_value == traced.timing["compute_us"]

        def children() -> list:
            return [s for _, s in receiver.spans if s.parent_span_id == span.span_id]

        if running_batch == "manager":
            assert attributes["batchmaker.request.cells"].int_value == 4
            tasks = wait_until(children, "the task spans")
            assert (
                sum(next(a.value.int_value for a in t.attributes if a.key == "batchmaker.task.cells") for t in tasks)
                == 4
            )
        else:  # task spans would have ended, and been queued for export, before the request's span
            assert "batchmaker.request.cells" not in attributes and children() == []
            assert attributes["batchmaker.worker.id"].int_value == worker_id
        assert stats == {"sample_rate": 0.0, "requests_traced": 1, "spans_queued": 0, "max_queued_spans": 2048,
                         "spans_dropped": 0}  # fmt: skip
    finally:
        stop_server(server)


def test_the_protocol_docs_tracing_example_joins_its_trace(tmp_path: Path):
    """The example of docs/protocol.md, "Tracing", run as written: its request is traced (at sample_rate 0,
    only because its span is sampled) as the child of a span of the example's process."""
    receiver = Receiver()
    endpoint, stop = http_receiver(receiver)
    config = write_config(tmp_path, SMALL_LSTM + f'[tracing]\nendpoint = "{endpoint}"\n')
    server = start_server(config, workers=1)
    try:
        section = (ROOT / "docs" / "protocol.md").read_text().split("\n## Tracing\n", 1)[1].split("\n## ", 1)[0]
        (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
        example = tmp_path / "example.py"
        example.write_text(code.replace("tcp://127.0.0.1:5555", server.address))
        subprocess.run([sys.executable, example], cwd=ROOT, check=True, timeout=120)
        [(_, span)] = wait_until(receiver.requests, "the example's span at the collector")
        attributes = {a.key: a.value.string_value for a in span.attributes}
        assert span.parent_span_id and attributes["batchmaker.model"] == "lstm"
        assert attributes["batchmaker.outcome"] == "ok"
    finally:
        stop_server(server)
        stop()


@pytest.mark.parametrize("running_batch", RUNNING_BATCH)
def test_a_collector_that_is_down_costs_spans_never_requests(
    tmp_path: Path, capfd: pytest.CaptureFixture, running_batch: str
):
    """Every request of a burst is traced and answered while nothing listens at the endpoint: the
    processor's queue stays within max_queued_spans, what does not fit is dropped, and the drops are
    logged once, not once a span."""
    tracing = (
        f'[tracing]\nendpoint = "http://127.0.0.1:{free_port()}/v1/traces"\nsample_rate = 1.0\nmax_queued_spans = 16\n'
    )
    config = write_config(tmp_path, SMALL_LSTM + tracing, scheduler=f'running_batch = "{running_batch}"')
    server = start_server(config, workers=1)
    rng = np.random.default_rng(5)
    requests = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(1, 60, size=300)]

    async def burst() -> list:
        async with AsyncClient(server.address, timeout=120) as client:
            return await asyncio.gather(*(client.infer("lstm", {"tokens": tokens}) for tokens in requests))

    try:
        replies = asyncio.run(burst())
        for tokens, reply in zip(requests, replies):
            check_lstm(config, tokens, reply.outputs)
        with server.client() as client:
            stats = wait_idle(client)
        assert stats["requests"]["ok"] == len(requests)
        tracing_stats = stats["tracing"]
        assert tracing_stats["requests_traced"] == len(requests) and tracing_stats["max_queued_spans"] == 16
        # A span per request (and per task that carried its cells, when the manager decides the steps): all dropped
        # but the queue's and the few batches of 16 the exporter took, each retried for seconds.
        assert tracing_stats["spans_queued"] <= 16 and tracing_stats["spans_dropped"] > len(requests) - 4 * 16
    finally:
        stop_server(server)
    assert capfd.readouterr().err.count("Queue full, dropping") == 1


NO_PACKAGE = """
import sys


class Missing:
    \"\"\"Imports of {prefix} fail, as if it were not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == {prefix!r} or name.startswith({prefix!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Missing())
"""


def without(tmp_path: Path, prefix: str) -> dict[str, str]:
    """An environment whose Python processes cannot import `prefix` (a sitecustomize module blocks it)."""
    folder = tmp_path / "blocker"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(NO_PACKAGE.format(prefix=prefix))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def serve(config_path: Path, env: dict[str, str], **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-m", "batchmaker.manager.commands.cli", "serve", str(config_path), "--workers", "1"]
    return subprocess.Popen(command, env=env, **kwargs)


def test_the_server_serves_without_opentelemetry_installed(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    process = serve(config.path, without(tmp_path, "opentelemetry"))
    try:
        wait_until_ready(config.server.address, process, timeout=120)
        with Client(config.server.address, timeout=60) as client:
            check_lstm(config, [9, 8, 7], client.infer("lstm", {"tokens": [9, 8, 7]}).outputs)
            assert "tracing" not in client.stats()
    finally:
        assert stop_process(process) == []


@pytest.mark.parametrize(
    "blocked, protocol, extra",
    [
        ("opentelemetry", "http/protobuf", "batchmaker[tracing]"),
        ("opentelemetry.exporter.otlp.proto.grpc", "grpc", "batchmaker[tracing-grpc]"),
    ],
)
def test_tracing_without_its_packages_fails_start_up_naming_them(
    tmp_path: Path, blocked: str, protocol: str, extra: str
):
    config = write_config(tmp_path, SMALL_LSTM + f'[tracing]\nprotocol = "{protocol}"\n')
    process = serve(
        config.path, without(tmp_path, blocked), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert f"pip install '{extra}'" in output and "[tracing]" in output
