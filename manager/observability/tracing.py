"""OpenTelemetry spans of requests: one server span per sampled request, a child span per task that
carried its cells, and events for its replays, partial replies, cancel, deadline and session step.

The manager spends tens of µs per request, so nothing here runs for a request that is not sampled
beyond the sampling decision, and nothing touches the OpenTelemetry SDK until the request ends: a
sampled request keeps a few plain records (`_Trace`, `_TaskRecord`) while it runs, and its spans are
built in one go when it concludes, with the times recorded meanwhile (start_span's start_time,
end's end_time). The spans go to the provider's processors (a BatchSpanProcessor with a bounded
queue in the server, manager/observability/trace_export.py), whose export runs off the event loop.

Sampling is parent-based: a request whose `traceparent` says sampled is traced, one that says not
sampled is not, and one without a valid `traceparent` (a malformed one is ignored, as W3C Trace
Context says) is traced with probability `sample_rate`. The decision is taken here, at admission,
so the provider is built to record every span it is given.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from batchmaker.common.protocol import CANCELLED, DEADLINE_EXCEEDED, RequestError
from batchmaker.manager.batching.outcomes import Answered, Failed, Outcome, Partial, Refused, Replayed
from batchmaker.manager.batching.records import Request, Task
from batchmaker.manager.batching.routed import Routed
from batchmaker.manager.loop.frontend import Incoming

SPAN_NAME = "batchmaker/infer"  # {rpc.service}/{rpc.method}, as the RPC semantic conventions name server spans
MAX_MODEL_CHARS = 256  # a refused request's model name longer than this is not recorded
_PROPAGATOR = TraceContextTextMapPropagator()


class _TaskRecord:
    """A task that carried cells of sampled requests, from its submission to its completion."""

    __slots__ = ("cell_type", "worker_id", "batch_size", "steps", "submitted", "finished", "lost", "traces")

    def __init__(self, task: Task):
        self.cell_type = task.spec.key
        self.worker_id = task.worker_id
        self.batch_size = task.step_sizes[0] if task.step_sizes else task.batch_size
        self.steps = len(task.step_sizes) or 1
        self.submitted = task.submitted
        self.finished: float | None = None
        self.lost: str | None = None  # why its worker was lost with it in flight
        self.traces: list[_Trace] = []


class _Trace:
    """What a sampled request's spans are built from when it concludes (times are perf_counter seconds)."""

    __slots__ = ("parent", "arrival", "attributes", "tasks", "events", "ready")

    def __init__(self, parent: Context | None, arrival: float, attributes: dict[str, Any]):
        self.parent = parent
        self.arrival = arrival
        self.attributes = attributes
        self.tasks: list[tuple[_TaskRecord, int, float]] = []  # each task, the request's cells in it, its wait
        self.events: list[tuple[str, float, dict[str, Any]]] = []
        self.ready = arrival  # since when its next cells may have been waiting for a task


class RequestTracing:
    """The manager's spans. The event loop reports to it only while it is on (one attribute check when
    off), and per task only while some request is sampled (`live`)."""

    def __init__(
        self,
        provider: TracerProvider,
        sample_rate: float,
        server_address: str,
        metrics: InMemoryMetricReader | None = None,
    ):
        """`metrics`: the reader of the span processor's own metrics (queue size, dropped spans), for `stats`."""
        self._provider = provider
        self._tracer = provider.get_tracer("batchmaker.manager")
        self._rate = sample_rate
        self._metrics = metrics
        self._server = _server_attributes(server_address)
        self._traces: dict[tuple[bytes, Any], _Trace] = {}  # by (client, request id), sampled requests only
        self._tasks: dict[int, _TaskRecord] = {}  # by task id, in flight, those that carry a sampled request's cells
        self._epoch_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter to the epoch spans are dated in
        self.traced = 0

    @property
    def live(self) -> bool:
        return bool(self._traces)

    # -- events of the event loop ---------------------------------------------------------------
    def received(self, burst: Sequence[Incoming], results: Sequence[Request | RequestError | None]) -> None:
        """A burst of `infer` requests went through admission: `results` are what was made of each (None: admitted
        without a record yet, waiting for its session or routed whole to a worker)."""
        now = time.perf_counter()
        for incoming, result in zip(burst, results):
            trace_ = self._sample(incoming)
            if trace_ is None:
                continue
            if isinstance(result, RequestError):
                self._end(trace_, now, None, result)
            else:
                self._traces[(incoming.client, incoming.request_id)] = trace_

    def task_submitted(self, task: Task, requests: Sequence[Request]) -> None:
        """A task was sent with cells of `requests` (its rows' requests, in order): the sampled ones note it."""
        record = None
        for request, cells in zip(requests, task.counts.tolist()):
            trace_ = self._traces.get((request.client, request.request_id))
            if trace_ is None:
                continue
            if record is None:
                record = self._tasks[task.task_id] = _TaskRecord(task)
            record.traces.append(trace_)
            trace_.tasks.append((record, cells, max(0.0, task.submitted - trace_.ready)))

    def tasks_finished(self, task_ids: Sequence[int]) -> None:
        """A worker's completion notice: its tasks' spans end now, and their requests' next cells wait from now."""
        now = time.perf_counter()
        for task_id in task_ids:
            record = self._tasks.pop(task_id, None)
            if record is not None:
                record.finished = now
                for trace_ in record.traces:
                    trace_.ready = max(trace_.ready, now)

    def worker_lost(self, worker_id: int, reason: str) -> None:
        """The worker's tasks in flight will never finish: their spans end now, as failed."""
        now = time.perf_counter()
        for task_id in [task_id for task_id, record in self._tasks.items() if record.worker_id == worker_id]:
            record = self._tasks.pop(task_id)
            record.finished, record.lost = now, reason

    def concluded(self, outcome: Outcome) -> None:
        """What the core concluded: an event of a sampled request, or its end, when its spans are built."""
        if not self._traces:
            return
        now = time.perf_counter()
        if isinstance(outcome, Refused):
            key = (outcome.client, outcome.request_id)
        else:
            key = (outcome.request.client, outcome.request.request_id)
        trace_ = self._traces.get(key)
        if trace_ is None:
            return
        if isinstance(outcome, Partial):
            rows = len(next(iter(outcome.outputs.values()))) if outcome.outputs else 0
            trace_.events.append(
                ("partial reply", now, {"batchmaker.partial.rows": rows, "batchmaker.restarted": outcome.restarted})
            )
        elif isinstance(outcome, Replayed):
            trace_.events.append(("replay", now, {"batchmaker.replays": outcome.request.failures}))
        else:
            del self._traces[key]
            if isinstance(outcome, Answered):
                if outcome.session_step is not None:
                    trace_.events.append(("session step", now, {"batchmaker.session.step": outcome.session_step}))
                self._end(trace_, now, outcome.request, None, outcome.timing)
            elif isinstance(outcome, Failed):
                self._end(trace_, now, outcome.request, outcome.error)
            else:
                self._end(trace_, now, None, outcome.error)

    def close(self) -> None:
        """Export what is queued (within the processor's timeout) and stop."""
        self._provider.shutdown()

    def snapshot(self) -> dict[str, Any]:
        """The `tracing` part of the `stats` reply."""
        snapshot: dict[str, Any] = {"sample_rate": self._rate, "requests_traced": self.traced}
        if self._metrics is not None:
            snapshot.update(_processor_metrics(self._metrics))
        return snapshot

    # -- spans ----------------------------------------------------------------------------------
    def _sample(self, incoming: Incoming) -> _Trace | None:
        """The request's records if it is sampled, else None (and nothing is kept of it)."""
        message = incoming.message
        parent = None
        header = message.get("traceparent")
        if isinstance(header, str):
            carrier = {"traceparent": header}
            state = message.get("tracestate")
            if isinstance(state, str):
                carrier["tracestate"] = state
            context = _PROPAGATOR.extract(carrier)
            caller = trace.get_current_span(context).get_span_context()
            if caller.is_valid:
                if not caller.trace_flags.sampled:
                    return None
                parent = context
        if parent is None and not (self._rate and random.random() < self._rate):
            return None
        self.traced += 1
        attributes = {**self._server, "batchmaker.request.id": incoming.request_id}
        model = message.get("model")
        if isinstance(model, str) and len(model) <= MAX_MODEL_CHARS:
            attributes["batchmaker.model"] = model
        for field, name in (("version", "batchmaker.model.version"), ("session", "batchmaker.session"),
                            ("priority", "batchmaker.priority"), ("stream", "batchmaker.stream")):  # fmt: skip
            value = message.get(field)
            if isinstance(value, (str, int)) and not (isinstance(value, str) and len(value) > MAX_MODEL_CHARS):
                attributes[name] = value
        return _Trace(parent, incoming.arrival, attributes)

    def _end(
        self, trace_: _Trace, now: float, request: Request | Routed | None, error: RequestError | None,
        timing: dict[str, int] | None = None,
    ) -> None:  # fmt: skip
        """Build the request's span and its tasks' spans, and hand them to the processors. A request routed whole
        to a worker's running batch has no tasks: its span names the worker that ran it."""
        attributes = trace_.attributes
        if isinstance(request, Request):
            attributes["batchmaker.request.cells"] = request.unfolded.plan.nodes
        elif request is not None:
            attributes["batchmaker.worker.id"] = request.worker_id
        if request is not None:
            attributes["batchmaker.replays"] = request.failures
        if timing is not None:
            attributes["batchmaker.queue_us"] = timing["queue_us"]
            attributes["batchmaker.compute_us"] = timing["compute_us"]
        attributes["batchmaker.outcome"] = "ok" if error is None else error.code
        if error is not None:
            attributes["error.type"] = error.code
            if error.code in (CANCELLED, DEADLINE_EXCEEDED):
                name = "cancel" if error.code == CANCELLED else "deadline"
                trace_.events.append((name, now, {"batchmaker.reason": error.message}))
        span = self._tracer.start_span(
            SPAN_NAME,
            context=trace_.parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self._ns(trace_.arrival),
        )
        for name, at, event in trace_.events:
            span.add_event(name, event, self._ns(at))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{error.code}: {error.message}"))
        context = trace.set_span_in_context(span)
        for record, cells, wait in trace_.tasks:
            task = self._tracer.start_span(
                f"task {record.cell_type}",
                context=context,
                kind=SpanKind.INTERNAL,
                start_time=self._ns(record.submitted),
                attributes={
                    "batchmaker.cell_type": record.cell_type,
                    "batchmaker.task.batch_size": record.batch_size,
                    "batchmaker.task.steps": record.steps,
                    "batchmaker.task.cells": cells,
                    "batchmaker.task.queue_wait_us": int(wait * 1e6),
                    "batchmaker.worker.id": record.worker_id,
                    "batchmaker.task.finished": record.finished is not None and record.lost is None,
                },
            )
            if record.lost is not None:
                task.set_status(Status(StatusCode.ERROR, f"worker lost: {record.lost}"))
            task.end(self._ns(record.finished if record.finished is not None else now))
        span.end(self._ns(now))

    def _ns(self, seconds: float) -> int:
        return self._epoch_ns + int(seconds * 1e9)


def _server_attributes(address: str) -> dict[str, Any]:
    """The attributes every request span starts with: the RPC system and the address clients reach."""
    attributes: dict[str, Any] = {"rpc.system": "batchmaker", "rpc.service": "batchmaker", "rpc.method": "infer"}
    scheme, _, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme == "tcp" and colon and port.isdigit():
        attributes["server.address"], attributes["server.port"] = host.strip("[]"), int(port)
    else:
        attributes["server.address"] = rest
    return attributes


def _processor_metrics(reader: InMemoryMetricReader) -> dict[str, int]:
    """The span processor's queue and drops, from the metrics the SDK keeps about it (none where those are off)."""
    data = reader.get_metrics_data()
    if data is None:
        return {}
    queued = capacity = dropped = 0
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points = list(metric.data.data_points)
                if metric.name == "otel.sdk.processor.span.queue.size":
                    queued += sum(int(point.value) for point in points)
                elif metric.name == "otel.sdk.processor.span.queue.capacity":
                    capacity += sum(int(point.value) for point in points)
                elif metric.name == "otel.sdk.processor.span.processed":
                    dropped += sum(int(point.value) for point in points if "error.type" in point.attributes)
    return {"spans_queued": queued, "max_queued_spans": capacity, "spans_dropped": dropped}
