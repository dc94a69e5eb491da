"""Prometheus metrics of a front door process, served at GET /metrics on its HTTP port.

Series (prefixed `batchmaker_frontdoor_`; each process of `[http] processes` counts its own requests):

==================================  =========  ===================================================
requests_total{protocol,endpoint}   counter    requests received, by protocol (http, grpc) and endpoint
errors_total{protocol,code}         counter    requests answered with an error, by the error's code
request_latency_seconds{protocol}   histogram  arrival to answer of inference requests, whatever the outcome
==================================  =========  ===================================================
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DoorMetrics:
    """One registry per process (never the process-wide default)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "batchmaker_frontdoor_requests", "Requests received", ["protocol", "endpoint"], registry=self.registry
        )
        self._errors = Counter(
            "batchmaker_frontdoor_errors",
            "Requests answered with an error",
            ["protocol", "code"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "batchmaker_frontdoor_request_latency_seconds",
            "Inference requests, arrival to answer",
            ["protocol"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # Each series' child, bound once: `labels()` validates and locks on every call, a dict lookup does not.
        self._bound: dict[tuple[object, ...], Any] = {}

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        key = (metric, *labels)
        child = self._bound.get(key)
        if child is None:
            child = self._bound[key] = metric.labels(*labels)
        return child

    def request(self, protocol: str, endpoint: str) -> None:
        self._child(self._requests, protocol, endpoint).inc()

    def error(self, protocol: str, code: str) -> None:
        self._child(self._errors, protocol, code).inc()

    def latency(self, protocol: str, seconds: float) -> None:
        self._child(self._latency, protocol).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
