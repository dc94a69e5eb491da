"""The spans of requests, read from an in-memory exporter: the manager runs in this process (its event
loop in a thread, given a tracer provider that exports to memory), its workers are real processes,
and real clients send the requests, inside a span of their own that the server's span must join.

Chains (LSTM, with a session), trees (TreeLSTM), a streamed Seq2Seq, a deadline and a cancel, refusals,
the caller's sampled flag and malformed trace contexts, and a request replayed after its worker is killed."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    ROOT,
    SMALL_LSTM,
    SMALL_SEQ2SEQ,
    SST_TREELSTM,
    start_worker,
    stop_in_thread,
    wait_until,
    with_faults,
    write_config,
)
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from batchmaker.clients import Client, Partial, Reply, ServerError
from batchmaker.common.config import Config, resolve_running_batch
from batchmaker.common.models import build_model
from batchmaker.common.models.base import save_weights
from batchmaker.common.models.seq2seq import decoding_mismatch
from batchmaker.common.models.sst import load_vocabulary, ptb_to_tree
from batchmaker.manager.loop.server import Manager
from batchmaker.manager.observability.tracing import SPAN_NAME, RequestTracing

TOLERANCE = 1e-5
LONG_DECODE = 30000  # decoder steps of a request that runs until its deadline or cancel
SST = ROOT / "data" / "sst"
MODELS = (
    SMALL_LSTM + SST_TREELSTM + SMALL_SEQ2SEQ.replace("max_decode_length = 60", f"max_decode_length = {LONG_DECODE}")
)
MANAGER_STEPS = 'running_batch = "manager"'  # the tasks a request's cells ran in have spans of their own
CALLER = trace.get_tracer("test-caller", tracer_provider=TracerProvider())  # the client's own spans


class TracedServer:
    """A manager run in this process with spans exported to memory, and its workers as processes."""

    def __init__(self, config: Config, workers: int, sample_rate: float = 1.0):
        config = resolve_running_batch(config, ["cpu"] * workers)  # as `batchmaker serve` would
        self.config = config
        self.address = config.server.address
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.worker_address = f"ipc://{config.path.parent / 'workers.ipc'}"
        tracing = RequestTracing(provider, sample_rate, self.address)
        self.manager = Manager(config, self.address, self.worker_address, workers, tracing=tracing)
        self.loop = threading.Thread(target=self.manager.run, daemon=True)
        self.loop.start()
        self.workers = [self.add_worker() for _ in range(workers)]
        with self.client() as client:
            wait_until(lambda: len(client.health()["workers"]) == workers, "the workers registering", timeout=120)

    def add_worker(self):
        return start_worker(self.config, self.worker_address)

    def client(self) -> Client:
        return Client(self.address, timeout=60)

    def spans_of(self, request_id: Any) -> tuple[ReadableSpan, list[ReadableSpan]]:
        """The span of the request with this (unique) id, once exported, and its tasks' spans."""
        span = wait_until(lambda: self._request_span(request_id), f"the span of request {request_id!r}")
        return span, self.tasks_of(span)

    def tasks_of(self, span: ReadableSpan) -> list[ReadableSpan]:
        """The children of a request's span (exported before it), in start order."""
        children = [
            s for s in self.exporter.get_finished_spans() if s.parent and s.parent.span_id == span.context.span_id
        ]
        return sorted(children, key=lambda child: child.start_time)

    def span_in(self, trace_id: int) -> ReadableSpan:
        """The request span of the trace a caller's span began, once exported."""
        return wait_until(
            lambda: next((s for s in self.exporter.get_finished_spans()
                          if s.name == SPAN_NAME and s.context.trace_id == trace_id), None),
            "the request's span in the caller's trace",
        )  # fmt: skip

    def _request_span(self, request_id: Any) -> ReadableSpan | None:
        spans = [s for s in self.exporter.get_finished_spans() if s.name == SPAN_NAME]
        return next((s for s in spans if s.attributes["batchmaker.request.id"] == request_id), None)

    def close(self) -> None:
        stop_in_thread(self.manager, self.loop, self.workers)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedServer]:
    """LSTM, TreeLSTM and a Seq2Seq whose decoder never emits EOS (it stops at max_len), one worker."""
    config = write_config(tmp_path_factory.mktemp("tracing"), MODELS, scheduler=MANAGER_STEPS)
    seq2seq = build_model(config.models["seq2seq"])
    state = seq2seq.load_weights()
    state["decoder.projection.bias"][seq2seq.eos_id] = -1e4
    save_weights(state, config.models["seq2seq"].weights)
    server = TracedServer(config, workers=1)
    yield server
    server.close()


def reference(config: Config, name: str, inputs: dict) -> dict[str, Any]:
    model = build_model(config.models[name])
    return model.reference(model.load_weights(), inputs)


def assert_close(reply: Reply, expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        assert reply.outputs[key].dtype == np.float32 and reply.outputs[key].shape == np.shape(value)
        assert float(np.abs(reply.outputs[key] - value).max()) <= TOLERANCE


def assert_tasks_cover(span: ReadableSpan, tasks: list[ReadableSpan], worker_id: int, cell_types: set[str]) -> None:
    """Each task span lies within the request's span, on the worker, and together they ran all its cells."""
    assert tasks and {t.attributes["batchmaker.cell_type"] for t in tasks} == cell_types
    assert sum(t.attributes["batchmaker.task.cells"] for t in tasks) == span.attributes["batchmaker.request.cells"]
    for task in tasks:
        assert task.context.trace_id == span.context.trace_id and task.kind == SpanKind.INTERNAL
        assert span.start_time <= task.start_time <= task.end_time <= span.end_time
        assert task.attributes["batchmaker.worker.id"] == worker_id and task.attributes["batchmaker.task.finished"]
        assert task.attributes["batchmaker.task.batch_size"] >= 1 and task.attributes["batchmaker.task.steps"] >= 1
        assert task.attributes["batchmaker.task.queue_wait_us"] >= 0


def test_a_chain_is_a_child_of_the_callers_span_with_a_span_per_task(served: TracedServer):
    tokens = list(range(3, 120))
    with served.client() as client, CALLER.start_as_current_span("caller") as caller:
        worker_id = client.health()["workers"][0]["id"]
        reply = client.infer("lstm", {"tokens": tokens})
    assert_close(reply, reference(served.config, "lstm", {"tokens": tokens}))
    caller_context = caller.get_span_context()
    span = served.span_in(caller_context.trace_id)
    tasks = served.tasks_of(span)
    assert span.parent.span_id == caller_context.span_id and span.parent.is_remote
    assert span.kind == SpanKind.SERVER and span.status.status_code == StatusCode.UNSET
    attributes = span.attributes
    assert attributes["rpc.system"] == "batchmaker" and attributes["rpc.method"] == "infer"
    assert attributes["server.address"] == "127.0.0.1" and attributes["server.port"] == int(
        served.address.rsplit(":", 1)[1]
    )
    assert attributes["batchmaker.model"] == "lstm" and attributes["batchmaker.outcome"] == "ok"
    assert attributes["batchmaker.request.cells"] == len(tokens)
    assert attributes["batchmaker.queue_us"] == reply.timing["queue_us"]
    assert attributes["batchmaker.compute_us"] == reply.timing["compute_us"]
    assert "error.type" not in attributes
    assert_tasks_cover(span, tasks, worker_id, {"lstm/layer0"})


def test_a_tree_has_a_span_per_task_of_each_cell_type(served: TracedServer):
    line = (SST / "dev.txt").read_text(encoding="utf-8").splitlines()[5]
    tokens, parents, _ = ptb_to_tree(line, load_vocabulary(SST / "vocab.txt"))
    tree = {"tree": {"tokens": tokens, "parents": parents}}
    with served.client() as client, CALLER.start_as_current_span("caller") as caller:
        worker_id = client.health()["workers"][0]["id"]
        reply = client.infer("tree", tree)
    assert_close(reply, reference(served.config, "tree", tree))
    span = served.span_in(caller.get_span_context().trace_id)
    tasks = served.tasks_of(span)
    assert (
        span.attributes["batchmaker.model"] == "tree" and span.attributes["batchmaker.request.cells"] == len(tokens) + 1
    )
    assert_tasks_cover(span, tasks, worker_id, {"tree/leaf", "tree/internal", "tree/classifier"})
    assert len(tasks) > 2  # a level of internal nodes a task, at least


def test_a_streamed_seq2seq_has_an_event_per_partial_reply(served: TracedServer):
    inputs = {"tokens": [5, 9, 11, 4], "max_len": 40}
    with served.client() as client, CALLER.start_as_current_span("caller") as caller:
        *partials, final = client.stream("seq2seq", inputs)
    model = build_model(served.config.models["seq2seq"])
    assert decoding_mismatch(final.outputs["tokens"], model.reference(model.load_weights(), inputs)) is None
    assert len(final.outputs["tokens"]) == 40 and all(isinstance(p, Partial) for p in partials)
    span = served.span_in(caller.get_span_context().trace_id)
    assert span.attributes["batchmaker.stream"] is True
    events = [event for event in span.events if event.name == "partial reply"]
    assert len(events) == len(partials)
    assert [e.attributes["batchmaker.partial.rows"] for e in events] == [len(p.outputs["tokens"]) for p in partials]
    assert all(span.start_time <= e.timestamp <= span.end_time for e in events)
    tasks = served.tasks_of(span)
    assert {t.attributes["batchmaker.cell_type"] for t in tasks} >= {"seq2seq/encoder", "seq2seq/decoder"}


def test_a_deadline_and_a_cancel_are_events_of_failed_spans(served: TracedServer):
    long = {"tokens": [1, 2, 3], "max_len": LONG_DECODE}
    with served.client() as client:
        with pytest.raises(ServerError) as late:
            client.call({"id": "late", "op": "infer", "model": "seq2seq", "inputs": long, "deadline_ms": 50})
        assert late.value.code == "DEADLINE_EXCEEDED"
        stream = client.stream("seq2seq", long)
        assert isinstance(next(stream), Partial)
        stream.close()  # leaving a stream early cancels it
    for code, event in (("DEADLINE_EXCEEDED", "deadline"), ("CANCELLED", "cancel")):
        span = wait_until(
            lambda code=code: next((s for s in served.exporter.get_finished_spans()
                                    if s.name == SPAN_NAME and s.attributes.get("error.type") == code), None),
            f"the span of the {code} request",
        )  # fmt: skip
        assert span.status.status_code == StatusCode.ERROR and code in span.status.description
        assert span.attributes["batchmaker.outcome"] == code
        assert [e.name for e in span.events if e.name == event] == [event]
        assert span.events[-1].timestamp <= span.end_time


def test_a_refused_request_has_a_failed_span(served: TracedServer):
    with served.client() as client, pytest.raises(ServerError) as refused:
        client.call({"id": "no-such", "op": "infer", "model": "nope", "inputs": {}})
    assert refused.value.code == "UNKNOWN_MODEL"
    span, tasks = served.spans_of("no-such")
    assert span.attributes["error.type"] == "UNKNOWN_MODEL" and span.attributes["batchmaker.model"] == "nope"
    assert span.status.status_code == StatusCode.ERROR and not tasks


def test_session_steps_are_events(served: TracedServer):
    with served.client() as client:
        for step, tokens in enumerate(([4, 5, 6], [7, 8])):
            request = {"op": "infer", "model": "lstm", "inputs": {"tokens": tokens}, "session": "talk"}
            client.call({"id": f"talk-{step}", **request, "session_end": step == 1})
    for step in range(2):
        span, _ = served.spans_of(f"talk-{step}")
        assert span.attributes["batchmaker.session"] == "talk"
        assert [e.attributes["batchmaker.session.step"] for e in span.events if e.name == "session step"] == [step + 1]


SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NOT_SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.mark.parametrize(
    "fields, parent",
    [
        ({"traceparent": SAMPLED, "tracestate": "vendor=1"}, 0xB7AD6B7169203331),
        ({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"}, None),  # a field short
        ({"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"}, None),  # an invalid trace id
        ({"traceparent": "not a traceparent at all"}, None),
        ({"traceparent": 12345, "tracestate": ["x"]}, None),  # not even a string
    ],
)
def test_a_malformed_traceparent_is_ignored(served: TracedServer, fields: dict, parent: int | None):
    """The request is answered whatever its trace context, traced as a root (sample_rate 1.0) when the
    traceparent cannot be read, as W3C Trace Context says."""
    request_id = f"tp-{parent}-{abs(hash(str(fields)))}"
    tokens = [3, 1, 4, 1, 5]
    with served.client() as client:
        reply = client.call({"id": request_id, "op": "infer", "model": "lstm", "inputs": {"tokens": tokens}, **fields})
    expected = reference(served.config, "lstm", {"tokens": tokens})
    assert (
        float(np.abs(np.frombuffer(reply["outputs"]["h"]["data"], np.float32) - np.ravel(expected["h"])).max())
        <= TOLERANCE
    )
    span, _ = served.spans_of(request_id)
    if parent is None:
        assert span.parent is None
    else:
        assert span.parent.span_id == parent and span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
        assert span.context.trace_state.get("vendor") == "1"


def test_a_caller_that_does_not_sample_is_not_traced(served: TracedServer):
    with served.client() as client:
        client.call(
            {
                "id": "unsampled",
                "op": "infer",
                "model": "lstm",
                "inputs": {"tokens": [1, 2]},
                "traceparent": NOT_SAMPLED,
            }
        )
        client.call({"id": "after-unsampled", "op": "infer", "model": "lstm", "inputs": {"tokens": [1, 2]}})
    served.spans_of("after-unsampled")  # exported after the first one's would have been
    assert served._request_span("unsampled") is None


def test_a_replayed_request_has_a_replay_event_and_its_lost_task(tmp_path: Path):
    """The request's first worker hangs with its task in flight and is killed; a second worker runs it again."""
    config = write_config(
        tmp_path, with_faults(tmp_path, SMALL_LSTM), server="heartbeat_timeout_ms = 1000", scheduler=MANAGER_STEPS
    )
    server = TracedServer(config, workers=1)
    try:
        with server.client() as client:
            [first] = client.health()["workers"]
            os.kill(first["pid"], signal.SIGUSR1)  # its cells stop returning: the task stays in flight
            tokens = list(range(10, 60))
            result: dict[str, Any] = {}
            caller = threading.Thread(
                target=lambda: result.update(
                    reply=Client(server.address, timeout=120).infer("lstm", {"tokens": tokens})
                )
            )
            caller.start()
            wait_until(
                lambda: client.health()["workers"][0]["tasks_in_flight"] > 0, "the task reaching the hung worker"
            )
            server.workers.append(server.add_worker())
            second = wait_until(
                lambda: next((w for w in client.health()["workers"] if w["id"] != first["id"]), None),
                "the second worker registering",
                timeout=120,
            )
            os.kill(first["pid"], signal.SIGKILL)
            caller.join(timeout=120)
        assert_close(result["reply"], reference(config, "lstm", {"tokens": tokens}))
        span = wait_until(
            lambda: next((s for s in server.exporter.get_finished_spans() if s.name == SPAN_NAME), None), "the span"
        )
        tasks = server.tasks_of(span)
        assert [e.attributes["batchmaker.replays"] for e in span.events if e.name == "replay"] == [1]
        assert span.attributes["batchmaker.replays"] == 1 and span.attributes["batchmaker.outcome"] == "ok"
        lost = [t for t in tasks if t.attributes["batchmaker.worker.id"] == first["id"]]
        assert lost and all(
            t.status.status_code == StatusCode.ERROR and "worker lost" in t.status.description for t in lost
        )
        rerun = [t for t in tasks if t.attributes["batchmaker.worker.id"] == second["id"]]
        assert sum(t.attributes["batchmaker.task.cells"] for t in rerun) == len(tokens)
        assert all(t.start_time >= max(l.end_time for l in lost) for t in rerun)
    finally:
        server.close()


def test_a_request_routed_to_a_running_batch_names_its_worker(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM, scheduler='running_batch = "worker"')
    server = TracedServer(config, workers=1)
    try:
        tokens = list(range(3, 40))
        with server.client() as client, CALLER.start_as_current_span("caller") as caller:
            worker_id = client.health()["workers"][0]["id"]
            reply = client.infer("lstm", {"tokens": tokens})
            with pytest.raises(ServerError):
                client.call({"id": "unknown model", "op": "infer", "model": "nope", "inputs": {"tokens": [1]}})
        assert_close(reply, reference(config, "lstm", {"tokens": tokens}))
        span = server.span_in(caller.get_span_context().trace_id)
        assert span.attributes["batchmaker.outcome"] == "ok" and span.attributes["batchmaker.worker.id"] == worker_id
        assert span.attributes["batchmaker.replays"] == 0
        assert span.attributes["batchmaker.queue_us"] == reply.timing["queue_us"] > 0  # arrival to joining the batch
        assert span.attributes["batchmaker.compute_us"] == reply.timing["compute_us"] > 0
        assert server.tasks_of(span) == []  # the worker decided its steps: no task of the manager's
        refused, _ = server.spans_of("unknown model")
        assert refused.status.status_code == StatusCode.ERROR and refused.attributes["error.type"] == "UNKNOWN_MODEL"
    finally:
        server.close()
