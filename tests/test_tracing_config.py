"""The [tracing] config table, strict like the rest of the config, and the trace context the clients send."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from test_config import MODEL, config_error, write

from batchmaker.clients.trace_context import trace_fields
from batchmaker.common.config import load_config
from batchmaker.common.tracing_config import TracingConfig


def test_tracing_is_off_without_the_table_and_takes_defaults_with_it(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, MODEL)).tracing is None
    assert load_config(write(tmp_path, "[tracing]\n" + MODEL)).tracing == TracingConfig()
    text = '[tracing]\nendpoint = "http://collector:4317"\nprotocol = "grpc"\nsample_rate = 1\nservice_name = "edge"\n'
    assert load_config(write(tmp_path, text + MODEL)).tracing == TracingConfig(
        endpoint="http://collector:4317", protocol="grpc", sample_rate=1.0, service_name="edge"
    )


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("sample_rte = 0.5", "unknown key(s) ['sample_rte']"),
        ('protocol = "http/json"', "protocol must be one of http/protobuf, grpc"),
        ('endpoint = "127.0.0.1:4318"', "endpoint must be a URL"),
        ("sample_rate = 1.5", "sample_rate must be a number from 0.0 to 1.0"),
        ("sample_rate = -0.1", "sample_rate must be a number from 0.0 to 1.0"),
        ('sample_rate = "all"', "sample_rate must be a number from 0.0 to 1.0"),
        ('service_name = ""', "service_name must be a non-empty string"),
        ("max_queued_spans = 0", "max_queued_spans must be an integer >= 1"),
    ],
)
def test_a_bad_tracing_key_is_refused_by_name(tmp_path: Path, line: str, fragment: str) -> None:
    config_error(tmp_path, f"[tracing]\n{line}\n" + MODEL, "[tracing]", fragment)


def test_tracing_must_be_a_table(tmp_path: Path) -> None:
    config_error(tmp_path, "tracing = 1\n" + MODEL, "[tracing] must be a table")


def test_the_clients_send_the_current_spans_context_and_nothing_without_one() -> None:
    assert trace_fields() == {}
    tracer = trace.get_tracer("caller", tracer_provider=TracerProvider())
    with tracer.start_as_current_span("caller") as span:
        fields = trace_fields()
    context = span.get_span_context()
    assert fields == {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"}
    assert context.trace_flags.sampled
