"""Prometheus metrics of the manager, and its health probes, served over HTTP.

The manager's event loop is a single thread, so recording is a dictionary lookup
and one increment or observation on a labelled child cached at first use; the
HTTP endpoint runs in its own daemon threads. Each Metrics owns a CollectorRegistry
(never the process-wide default) so that several managers can share a process.

Beside /metrics, the endpoint answers the probes of a process manager such as
Kubernetes (docs/deploy.md), from values the event loop sets once per watch interval
(one attribute assignment each, so the HTTP threads read them without a lock):

* /healthz: 200 while the event loop turns; 503 once its last turn is older than
  `liveness_timeout_s`.
* /readyz: 200 when every expected worker has registered and the server is not
  draining; 503 otherwise, with the reason in the body.

Series (all prefixed `batchmaker_`):

=========================================  =========  ===================================================
name                                       type       meaning
=========================================  =========  ===================================================
requests_total{model,outcome}              counter    requests answered; outcome is "ok" or an error code;
                                                      model is "-" when the request was refused before
                                                      a served model was known (unreadable frame, ...);
                                                      control calls are counted in control_calls_total
request_latency_seconds{model}             histogram  arrival to reply, successful requests only
request_queue_seconds{model}               histogram  arrival to first task submitted, successful requests only
partial_replies_total{model}               counter    partial replies sent to streamed requests (`stream: true`)
control_calls_total{op}                    counter    calls of models, health, stats, cancel, load, unload and
                                                      reload, answered or refused; never counted in requests_total
batch_size{cell_type}                      histogram  nodes per step of a submitted task or of a worker's running
                                                      batch (buckets 1, 2, 4 ... 1024)
tasks_total{cell_type}                     counter    batched tasks submitted to workers
queue_depth_nodes{cell_type}               gauge      nodes ready to run and not yet submitted
worker_tasks_in_flight{worker}             gauge      tasks submitted to a worker and not yet completed
worker_requests_in_flight{worker}          gauge      requests routed whole to a worker's running batch, not
                                                      answered yet
arena_rows_in_use{worker}                  gauge      arena rows (slots) the manager holds on a worker
arena_rows_capacity{worker}                gauge      arena rows a worker has
worker_restarts_total                      counter    workers that died and were replaced
=========================================  =========  ===================================================

Counters also carry the `_created` series prometheus_client adds by default.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, make_wsgi_app

from batchmaker.common.protocol import CONTROL_OPS, ERROR_CODES

NO_MODEL = "-"
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(11))  # 1 .. 1024
LIVENESS_TIMEOUT_S = 10.0  # an event loop that has not turned for this long is reported dead


MAX_CONNECTIONS = 8  # scrapes and probes served at once; more connections are closed unanswered
CONNECTION_TIMEOUT_S = 5.0  # a connection that sends nothing for this long is closed


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most MAX_CONNECTIONS of them: a peer that opens connections and
    sends nothing cannot pile up threads in the manager's process."""

    daemon_threads = True  # a slow scraper must not keep the manager from exiting

    def server_activate(self) -> None:
        super().server_activate()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Probes arrive every few seconds; logging each would bury the manager's own messages."""


class Metrics:
    def __init__(
        self, models: list[str], cell_types: list[str], liveness_timeout_s: float = LIVENESS_TIMEOUT_S
    ) -> None:
        """Declare every series and create the children of the known labels, so they show up as 0 from the start."""
        self.registry = CollectorRegistry()
        self.liveness_timeout_s = liveness_timeout_s
        self._loop_turned_at = time.monotonic()
        self._readiness: tuple[int, int, bool] = (0, 1, False)  # (workers registered, workers expected, draining)
        self._models: frozenset[str] = frozenset()  # the served models' names, the only model label values
        self._requests = Counter(
            "batchmaker_requests", "Requests answered, by model and outcome (ok or an error code).",
            ("model", "outcome"), registry=self.registry,
        )
        self._latency = Histogram(
            "batchmaker_request_latency_seconds", "Time from a request's arrival to its reply (successful requests).",
            ("model",), buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._queue = Histogram(
            "batchmaker_request_queue_seconds",
            "Time from a request's arrival to its first task being submitted (successful requests).",
            ("model",), buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._partials = Counter(
            "batchmaker_partial_replies", "Partial replies sent to streamed requests.", ("model",),
            registry=self.registry,
        )
        self._control_calls = Counter(
            "batchmaker_control_calls",
            "Calls of the ops about the server (models, health, stats, cancel, load, unload, reload).", ("op",),
            registry=self.registry,
        )
        self._batch_size = Histogram(
            "batchmaker_batch_size", "Nodes per step of a task submitted to a worker or of a worker's running batch.",
            ("cell_type",), buckets=BATCH_SIZE_BUCKETS, registry=self.registry,
        )
        self._tasks = Counter(
            "batchmaker_tasks", "Batched tasks submitted to workers.", ("cell_type",), registry=self.registry
        )
        self._queue_depth = Gauge(
            "batchmaker_queue_depth_nodes", "Nodes ready to run and not yet submitted.",
            ("cell_type",), registry=self.registry,
        )
        self._in_flight = Gauge(
            "batchmaker_worker_tasks_in_flight", "Tasks submitted to a worker and not yet completed.",
            ("worker",), registry=self.registry,
        )
        self._routed = Gauge(
            "batchmaker_worker_requests_in_flight", "Requests routed whole to a worker's running batch, not answered.",
            ("worker",), registry=self.registry,
        )
        self._rows_in_use = Gauge(
            "batchmaker_arena_rows_in_use", "Arena rows (slots) held on a worker.", ("worker",), registry=self.registry
        )
        self._rows_capacity = Gauge(
            "batchmaker_arena_rows_capacity", "Arena rows a worker has.", ("worker",), registry=self.registry
        )
        self._restarts = Counter(
            "batchmaker_worker_restarts", "Workers that died and were replaced.", registry=self.registry
        )

        self._request_children = {(NO_MODEL, code): self._requests.labels(NO_MODEL, code) for code in ERROR_CODES}
        self._latency_children: dict[str, tuple] = {}
        self._partial_children: dict[str, Any] = {}
        for model in models:
            self.add_model(model)
        self._control_children = {op: self._control_calls.labels(op) for op in CONTROL_OPS}
        self._cell_children: dict[str, tuple] = {}
        for cell in cell_types:
            self._cell(cell)
        self._worker_children: dict[str, tuple] = {}
        self._metrics_app = make_wsgi_app(self.registry)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- recording (manager thread) -------------------------------------------------------------
    def set_liveness(self, now: float) -> None:
        """The event loop turned at `now` (time.monotonic())."""
        self._loop_turned_at = now

    def set_readiness(self, workers: int, expected_workers: int, draining: bool) -> None:
        self._readiness = (workers, expected_workers, draining)  # one assignment: the HTTP threads see all or none

    def add_model(self, model: str) -> None:
        """A model served from now on (at start, or loaded while the server runs): its labelled children."""
        if model in self._models:
            return
        self._models = self._models | {model}
        outcomes = ("ok", *ERROR_CODES)
        self._request_children.update({(model, outcome): self._requests.labels(model, outcome) for outcome in outcomes})
        self._latency_children[model] = (self._latency.labels(model), self._queue.labels(model))
        self._partial_children[model] = self._partials.labels(model)

    def request_finished(self, model: str, outcome: str, total_s: float | None, queue_s: float | None) -> None:
        """Count an answered request; its latency and queueing time are observed only for outcome "ok"."""
        if model not in self._models:
            model = NO_MODEL  # a name the server does not serve must not become a label value
        child = self._request_children.get((model, outcome))
        if child is None:
            child = self._request_children[(model, outcome)] = self._requests.labels(model, outcome)
        child.inc()
        if outcome == "ok" and model != NO_MODEL:
            latency, queue = self._latency_children[model]
            if total_s is not None:
                latency.observe(total_s)
            if queue_s is not None:
                queue.observe(queue_s)

    def partial_sent(self, model: str) -> None:
        """A streamed request of a served `model` got a partial reply."""
        self._partial_children[model].inc()

    def control_call(self, op: str) -> None:
        """A call of one of CONTROL_OPS."""
        self._control_children[op].inc()

    def request_refused(self, outcome: str) -> None:
        """Count a request refused before it named a served model."""
        self.request_finished(NO_MODEL, outcome, None, None)

    def task_submitted(self, cell_type: str, *step_nodes: int) -> None:
        """A task of the nodes of each of its steps (one, unless it is a multi-step task): each step is a batch."""
        batch, tasks, _ = self._cell(cell_type)
        for nodes in step_nodes:
            batch.observe(nodes)
        tasks.inc()

    def batches_run(self, cell_type: str, nodes: int, steps: int) -> None:
        """`steps` batches of `nodes` nodes a worker's running batch ran (no task)."""
        batch = self._cell(cell_type)[0]
        for _ in range(steps):
            batch.observe(nodes)

    def set_queue_depth(self, cell_type: str, ready_nodes: int) -> None:
        self._cell(cell_type)[2].set(ready_nodes)

    def set_worker(
        self, worker: str, tasks_in_flight: int, requests_in_flight: int, arena_rows_in_use: int,
        arena_rows_capacity: int,
    ) -> None:  # fmt: skip
        gauges = (self._in_flight, self._routed, self._rows_in_use, self._rows_capacity)
        in_flight, routed, in_use, capacity = _labelled(self._worker_children, worker, gauges)
        in_flight.set(tasks_in_flight)
        routed.set(requests_in_flight)
        in_use.set(arena_rows_in_use)
        capacity.set(arena_rows_capacity)

    def remove_worker(self, worker: str) -> None:
        """Drop a departed worker's series so that a scrape does not report stale values for it."""
        if self._worker_children.pop(worker, None) is not None:
            for gauge in (self._in_flight, self._routed, self._rows_in_use, self._rows_capacity):
                gauge.remove(worker)

    def worker_restarted(self) -> None:
        self._restarts.inc()

    def _cell(self, cell_type: str) -> tuple[Histogram, Counter, Gauge]:
        return _labelled(self._cell_children, cell_type, (self._batch_size, self._tasks, self._queue_depth))

    # -- exposition -----------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Serve /metrics, /healthz and /readyz on host:port (0 picks a free port) from daemon threads.

        Returns the bound port.
        """
        if self._server is not None:
            raise RuntimeError(f"metrics are already served on port {self._server.server_port}")
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsServer", (_ThreadingServer,), {"address_family": family})
        self._server = make_server(address[0], port, self._app, server_class, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        return self._server.server_port

    def close(self) -> None:
        """Stop the HTTP endpoint and release its port; safe to call more than once."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def liveness(self) -> tuple[bool, str]:
        stalled = time.monotonic() - self._loop_turned_at
        if stalled > self.liveness_timeout_s:
            return False, f"the event loop has not turned for {stalled:.1f} s"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        workers, expected, draining = self._readiness
        if draining:
            return False, "draining: finishing accepted requests before stopping"
        if workers < max(expected, 1):
            return False, f"{workers} of {expected} workers registered"
        return True, "ready"

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        probe = {"/healthz": self.liveness, "/readyz": self.readiness}.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return self._metrics_app(environ, start_response)
        ok, reason = probe()
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")])
        return [reason.encode() + b"\n"]


def _labelled(cache: dict[str, tuple], label: str, metrics: tuple[Any, ...]) -> tuple:
    """The metrics' children for `label`, made once and kept in `cache`: `labels()` takes a lock and a
    lookup on every call."""
    children = cache.get(label)
    if children is None:
        children = cache[label] = tuple(metric.labels(label) for metric in metrics)
    return children
