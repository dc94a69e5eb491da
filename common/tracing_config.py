"""The [tracing] table: where OpenTelemetry spans of requests go, and how many (docs/deploy.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchmaker.common.config_values import ConfigError, check_keys, positive_int, string

TRACE_PROTOCOLS = ("http/protobuf", "grpc")  # OTLP transports, named as OTEL_EXPORTER_OTLP_PROTOCOL names them


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry spans of requests, exported over OTLP (docs/deploy.md, "Tracing with a collector")."""

    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    protocol: str = "http/protobuf"
    sample_rate: float = 0.0  # of requests without a sampled caller; a caller's sampled flag is always honoured
    service_name: str = "batchmaker"
    max_queued_spans: int = 2048  # finished spans waiting for the exporter; beyond it new ones are dropped


def parse_tracing(table: dict[str, Any], path: Path) -> TracingConfig:
    defaults = TracingConfig()
    check_keys(table, set(TracingConfig.__dataclass_fields__), "tracing", path)
    protocol = string(table, "protocol", defaults.protocol, "tracing", path)
    if protocol not in TRACE_PROTOCOLS:
        raise ConfigError(f"{path}: [tracing] protocol must be one of {', '.join(TRACE_PROTOCOLS)}, got {protocol!r}")
    endpoint = string(table, "endpoint", defaults.endpoint, "tracing", path)
    if not endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f'{path}: [tracing] endpoint must be a URL like "http://127.0.0.1:4318/v1/traces", got {endpoint!r}'
        )
    rate = table.get("sample_rate", defaults.sample_rate)
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0.0 <= rate <= 1.0:
        raise ConfigError(f"{path}: [tracing] sample_rate must be a number from 0.0 to 1.0, got {rate!r}")
    return TracingConfig(
        endpoint=endpoint,
        protocol=protocol,
        sample_rate=float(rate),
        service_name=string(table, "service_name", defaults.service_name, "tracing", path),
        max_queued_spans=positive_int(table, "max_queued_spans", defaults.max_queued_spans, "tracing", path),
    )
