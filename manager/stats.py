"""Counters and latency samples behind the `stats` op.

Besides throughput and latency, two counters make cellular batching observable:
`joining_tasks` (tasks holding nodes of requests that were already running
together with the first nodes of newly started requests) and `leaving_requests`
(requests answered while a request that arrived earlier was still running).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from manager.records import Task

LATENCY_WINDOW = 20000


class Stats:
    def __init__(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.tasks = 0
        self.nodes = 0
        self.padded_rows = 0
        self.joining_tasks = 0
        self.leaving_requests = 0
        self.worker_losses = 0
        self.replayed = 0
        self.batch_sizes: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        self._latency: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=LATENCY_WINDOW)

    def task_submitted(self, task: Task) -> None:
        self.tasks += 1
        count = task.nodes
        self.nodes += count
        self.padded_rows += task.batch_size - count
        self.batch_sizes[task.spec.key][count] += 1
        self.joining_tasks += task.joining

    def request_received(self) -> None:
        self.requests["received"] += 1

    def request_answered(self, outcome: str, timing: dict[str, int] | None, left_early: bool) -> None:
        self.requests[outcome] += 1
        if timing is not None:
            self._latency.append((timing["total_us"], timing["queue_us"], timing["compute_us"]))
        if left_early:
            self.leaving_requests += 1

    def snapshot(self) -> dict[str, Any]:
        latency: dict[str, Any] = {}
        if self._latency:
            samples = np.array(self._latency, dtype=np.float64)
            for column, name in enumerate(("total_us", "queue_us", "compute_us")):
                p50, p90, p99 = np.percentile(samples[:, column], [50, 90, 99])
                latency[name] = {"p50": p50, "p90": p90, "p99": p99, "mean": float(samples[:, column].mean())}
        return {
            "requests": dict(self.requests),
            "tasks": self.tasks,
            "nodes": self.nodes,
            "mean_batch_size": self.nodes / self.tasks if self.tasks else 0.0,
            "padded_rows": self.padded_rows,
            "joining_tasks": self.joining_tasks,
            "leaving_requests": self.leaving_requests,
            "worker_losses": self.worker_losses,
            "replayed_requests": self.replayed,
            "batch_sizes": {key: {str(size): n for size, n in sorted(c.items())} for key, c in self.batch_sizes.items()},
            "latency": {name: {k: float(v) for k, v in values.items()} for name, values in latency.items()},
            "latency_window": len(self._latency),
        }


def request_timing(arrival: float, started: float, end: float) -> dict[str, int]:
    """Queueing (arrival to first issue), computation (first issue to answer) and total, in µs."""
    started = started or end
    return {
        "queue_us": int((started - arrival) * 1e6),
        "compute_us": int((end - started) * 1e6),
        "total_us": int((end - arrival) * 1e6),
    }
