"""The caller's trace context through the Open Inference Protocol front door: the `traceparent` and `tracestate`
of an HTTP request's headers, or of a gRPC call's metadata (a streamed request's included), make the real
server's span of the request a child of the caller's span, as its OTLP export to a receiver in the test shows."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import SMALL_LSTM, stop_server, wait_until
from oip_server import close, start_door
from test_tracing_export import Receiver, http_receiver

TAGGER = """
[models.tagger]
builder = "batchmaker.common.models.lstm:build"
weights = "tagger.pt"
vocab_size = 300
embedding_size = 16
hidden_size = 16
per_step = true
head_size = 3
max_length = 100
batch_sizes = [1, 2, 4]
"""
TRACE_STATE = "vendor=opaque"


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"  # sampled


def tokens_input(module, tokens: np.ndarray):
    item = module.InferInput("tokens", [len(tokens)], "INT64")
    item.set_data_from_numpy(tokens)
    return item


def test_trace_headers_and_metadata_make_the_servers_span_a_child_of_the_callers(tmp_path: Path):
    receiver = Receiver()
    endpoint, stop_receiver = http_receiver(receiver)
    tracing = f'[tracing]\nendpoint = "{endpoint}"\n'  # sample_rate 0: only what a sampled caller asks is traced
    door = start_door(tmp_path, SMALL_LSTM + TAGGER + tracing)
    tokens = np.array([5, 17, 42, 8], dtype=np.int64)
    callers = {name: (index << 64 | 0xABC, 0x1000 + index) for index, name in enumerate(["http", "grpc", "stream"], 1)}
    try:
        http = httpclient.InferenceServerClient(door.http)
        untraced = http.infer("lstm", [tokens_input(httpclient, tokens)])
        headers = {"traceparent": traceparent(*callers["http"]), "tracestate": TRACE_STATE}
        traced = http.infer("lstm", [tokens_input(httpclient, tokens)], headers=headers)

        grpc = grpcclient.InferenceServerClient(door.grpc)
        metadata = {"traceparent": traceparent(*callers["grpc"]), "tracestate": TRACE_STATE}
        over_grpc = grpc.infer("lstm", [tokens_input(grpcclient, tokens)], headers=metadata)
        responses: queue.Queue = queue.Queue()
        grpc.start_stream(
            callback=lambda result, error: responses.put(error or result),
            headers={"traceparent": traceparent(*callers["stream"])},
        )
        grpc.async_stream_infer("tagger", [tokens_input(grpcclient, tokens)])
        streamed = []
        while not streamed or not streamed[-1].get_response().parameters["triton_final_response"].bool_param:
            streamed.append(responses.get(timeout=60))
        grpc.stop_stream()

        spans = wait_until(lambda: len(receiver.requests()) >= 3 and receiver.requests(), "the three requests' spans")
        by_trace = {int.from_bytes(span.trace_id, "big"): span for _, span in spans}
        assert len(spans) == 3 and set(by_trace) == {trace_id for trace_id, _ in callers.values()}  # not `untraced`
        for name, (trace_id, span_id) in callers.items():
            span = by_trace[trace_id]
            assert int.from_bytes(span.parent_span_id, "big") == span_id
            assert span.trace_state == ("" if name == "stream" else TRACE_STATE)
            model = {a.key: a.value.string_value for a in span.attributes}["batchmaker.model"]
            assert model == ("tagger" if name == "stream" else "lstm")
    finally:
        stop_server(door.server)
        stop_receiver()
    expected = door.reference("lstm", {"tokens": tokens.tolist()})
    for result in (untraced, traced, over_grpc):
        assert close(result.as_numpy("h"), expected["h"]) and close(result.as_numpy("c"), expected["c"])
    tagged = door.reference("tagger", {"tokens": tokens.tolist()})["y"]
    assert close(streamed[-1].as_numpy("y"), tagged)  # the final response; the partials before it add up to it
    assert len(streamed) == 1 or close(np.concatenate([result.as_numpy("y") for result in streamed[:-1]]), tagged)
