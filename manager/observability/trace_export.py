"""The manager's span export from the `[tracing]` config table: OTLP over HTTP (or gRPC) through a
BatchSpanProcessor with a bounded queue, whose thread exports off the event loop.

OpenTelemetry is an optional extra: this module imports it only when a config turns tracing on, so a
server without the packages starts and serves as long as its config has no `[tracing]` table, and
one whose config has it fails start-up naming what to install.

A collector that is down or slow costs spans, never requests or memory: the processor's queue holds
`max_queued_spans` at most and drops what comes beyond (counted in `stats`, and logged at most once a
minute, not once a span).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from typing import TYPE_CHECKING

from batchmaker.common.config import Config, ConfigError
from batchmaker.common.tracing_config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from batchmaker.manager.observability.tracing import RequestTracing

EXPORT_TIMEOUT_S = 10.0  # one export to the collector, retries included
EXPORT_BATCH = 512  # spans per export at most
EXPORT_DELAY_MS = 1000  # how long a span may wait for a fuller batch
DROP_LOG_INTERVAL_S = 60.0
# The SDK counts its processor's queue and drops only when this says so; `stats` reports them from those counts.
SDK_METRICS_SWITCH = "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"
_EXPORTERS = {
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "tracing"),
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "tracing-grpc"),
}


def check_tracing_packages(config: Config) -> None:
    """Raise ConfigError naming what to install when the config turns tracing on without its packages."""
    if config.tracing is None:
        return
    module, extra = _EXPORTERS[config.tracing.protocol]
    for name in ("opentelemetry.sdk.trace", module):
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            raise ConfigError(
                f"{config.path}: [tracing] with protocol = {config.tracing.protocol!r} needs OpenTelemetry "
                f"({name} is not installed): pip install 'batchmaker[{extra}]'"
            )


def open_tracing(config: Config, address: str) -> RequestTracing | None:
    """The manager's tracing as the config asks (None: no `[tracing]` table), spans exported over OTLP."""
    if config.tracing is None:
        return None
    check_tracing_packages(config)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    from batchmaker.manager.observability.tracing import RequestTracing

    tracing = config.tracing
    os.environ.setdefault(SDK_METRICS_SWITCH, "true")  # read as the processor is made; an operator's "false" stands
    reader = InMemoryMetricReader()
    provider = TracerProvider(resource=Resource.create({"service.name": tracing.service_name}), sampler=ALWAYS_ON)
    processor = BatchSpanProcessor(
        _exporter(tracing),
        max_queue_size=tracing.max_queued_spans,
        max_export_batch_size=min(EXPORT_BATCH, tracing.max_queued_spans),
        schedule_delay_millis=EXPORT_DELAY_MS,
        meter_provider=MeterProvider(metric_readers=[reader]),
    )
    provider.add_span_processor(processor)
    logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(_OncePerInterval(DROP_LOG_INTERVAL_S))
    return RequestTracing(provider, tracing.sample_rate, address, reader)


def _exporter(tracing: TracingConfig) -> SpanExporter:
    module, _ = _EXPORTERS[tracing.protocol]
    exporter = importlib.import_module(module).OTLPSpanExporter
    return exporter(endpoint=tracing.endpoint, timeout=EXPORT_TIMEOUT_S)


class _OncePerInterval(logging.Filter):
    """Lets one record of each message through per interval: the processor warns at every span it drops."""

    def __init__(self, interval_s: float):
        super().__init__()
        self._interval_s = interval_s
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._last.get(record.msg, -self._interval_s) < self._interval_s:
            return False
        self._last[record.msg] = now
        return True
