"""The caller's trace context, sent with each request so that the server's span of it joins the
caller's trace (docs/protocol.md, "Tracing"). Only where OpenTelemetry is installed and a span is
current: otherwise a request carries nothing more."""

from __future__ import annotations

try:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the clients need no OpenTelemetry
    _PROPAGATOR = None
else:
    _PROPAGATOR = TraceContextTextMapPropagator()


def trace_fields() -> dict[str, str]:
    """`traceparent` (and `tracestate`, when the trace has one) of the current span; empty without one."""
    carrier: dict[str, str] = {}
    if _PROPAGATOR is not None:
        _PROPAGATOR.inject(carrier)
    return carrier
