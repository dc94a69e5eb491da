"""Counters and latency samples behind the `stats` op, and the one place that records events.

The event loop reports each event once, here; the Prometheus metrics (manager.observability.metrics), when
served, are updated from the same calls, so the loop never speaks to them itself.

Besides throughput and latency, two counters make cellular batching observable:
`joining_tasks` (tasks holding nodes of requests that were already running
together with the first nodes of newly started requests) and `leaving_requests`
(requests answered while a request that arrived earlier was still running).
"""

from __future__ import annotations

import array
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from batchmaker.common.protocol import CONTROL_OPS
from batchmaker.manager.batching.outcomes import Failed, Outcome, Replayed
from batchmaker.manager.batching.records import Task
from batchmaker.manager.batching.versions import served_name

if TYPE_CHECKING:
    from batchmaker.manager.batching.worker_handle import WorkerHandle
    from batchmaker.manager.observability.metrics import Metrics

LATENCY_WINDOW = 20000
TIMINGS = ("total_us", "queue_us", "compute_us")  # kept per answered request, in the latency window


class LatencyWindow:
    """The timings of the latest `size` answered requests, in memory taken whole at start: a deque of
    tuples grows by about 150 bytes an answer until it is full (3 MB at 20,000), which in a long run's
    resident memory looks like a leak."""

    def __init__(self, size: int = LATENCY_WINDOW):
        self.size = size
        self._values = array.array("q", bytes(8 * len(TIMINGS) * size))
        self._next = 0  # the row the next answer overwrites
        self._count = 0

    def append(self, timing: dict[str, int]) -> None:
        at = self._next * len(TIMINGS)
        for offset, name in enumerate(TIMINGS):
            self._values[at + offset] = timing[name]
        self._next = (self._next + 1) % self.size
        self._count = min(self._count + 1, self.size)

    def __len__(self) -> int:
        return self._count

    def samples(self) -> np.ndarray:
        """One row per answer kept (in no particular order), one column per name of TIMINGS."""
        return np.frombuffer(self._values, dtype=np.int64).reshape(self.size, len(TIMINGS))[: self._count]


class Stats:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self.requests: collections.Counter[str] = collections.Counter()
        # Calls about the server (models, health, stats, cancel, load, unload, reload), apart: a monitor polling
        # stats must not look like load.
        self.control_calls = dict.fromkeys(CONTROL_OPS, 0)
        self.tasks = 0
        self.steps = 0  # a multi-step task runs several
        self.nodes = 0
        self.padded_rows = 0
        self.joining_tasks = 0
        self.leaving_requests = 0
        self.worker_losses = 0
        self.replayed = 0
        self.partial_replies = 0
        self.batch_sizes: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        self._latency = LatencyWindow()

    def task_submitted(self, task: Task) -> None:
        self.tasks += 1
        self.steps += len(task.step_nodes)
        count = task.nodes
        self.nodes += count
        self.padded_rows += task.batch_size - count
        for nodes in task.step_nodes:  # each step of a multi-step task is a batch of its own
            self.batch_sizes[task.spec.key][nodes] += 1
        self.joining_tasks += task.joining
        if self.metrics is not None:
            self.metrics.task_submitted(task.spec.key, *task.step_nodes)

    def steps_run(self, ran: dict[str, dict[int, int]]) -> None:
        """Steps a worker's running batch ran (per cell type, how many at each batch size): no task, each a batch."""
        for key, sizes in ran.items():
            for nodes, steps in sizes.items():
                self.steps += steps
                self.nodes += nodes * steps
                self.batch_sizes[key][nodes] += steps
                if self.metrics is not None:
                    self.metrics.batches_run(key, nodes, steps)

    def request_received(self) -> None:
        """An inference request, or a message whose op is unreadable or unknown (refused, and counted so)."""
        self.requests["received"] += 1

    def control_call(self, op: str) -> None:
        """A call of one of CONTROL_OPS, answered or refused: never counted among `requests`."""
        self.control_calls[op] += 1
        if self.metrics is not None:
            self.metrics.control_call(op)

    def request_refused(self, code: str) -> None:
        """A request answered with an error before it was admitted."""
        self.requests[code] += 1
        if self.metrics is not None:
            self.metrics.request_refused(code)

    def model_served(self, name: str) -> None:
        """A model loaded while the server runs serves from now on: the metrics label its requests."""
        if self.metrics is not None:
            self.metrics.add_model(name)

    def concluded(self, outcome: Outcome) -> None:
        """What the batching core concluded about an admitted request."""
        if isinstance(outcome, Replayed):
            self.replayed += 1
            return
        name = served_name(outcome.request.model.name)
        if isinstance(outcome, Failed):
            self.requests[outcome.error.code] += 1
            if self.metrics is not None:
                self.metrics.request_finished(name, outcome.error.code, None, None)
            return
        timing = outcome.timing  # Answered
        self.requests["ok"] += 1
        self._latency.append(timing)
        self.leaving_requests += outcome.left_early
        if self.metrics is not None:
            self.metrics.request_finished(name, "ok", timing["total_us"] / 1e6, timing["queue_us"] / 1e6)

    def partial_sent(self, model: str) -> None:
        """A streamed request's partial reply was sent (its answer is counted when it concludes)."""
        self.partial_replies += 1
        if self.metrics is not None:
            self.metrics.partial_sent(model)

    def worker_lost(self, worker_id: int) -> None:
        self.worker_losses += 1
        if self.metrics is not None:
            self.metrics.remove_worker(str(worker_id))

    def worker_restarted(self) -> None:
        if self.metrics is not None:
            self.metrics.worker_restarted()

    def sample(
        self,
        now: float,
        workers: dict[int, WorkerHandle],
        expected_workers: int,
        draining: bool,
        ready_nodes: Callable[[], dict[str, int]],
        routed_to: Callable[[int], int],
    ) -> None:
        """Set the gauges that are sampled rather than counted (once per watch interval, when metrics are served);
        `routed_to`: the requests in flight routed whole to a worker's running batch."""
        metrics = self.metrics
        if metrics is None:
            return
        metrics.set_liveness(now)
        metrics.set_readiness(len(workers), expected_workers, draining)
        for key, ready in ready_nodes().items():
            metrics.set_queue_depth(key, ready)
        for worker in workers.values():
            capacity = sum(a.capacity for a in worker.slots.values())
            routed = routed_to(worker.worker_id)
            metrics.set_worker(str(worker.worker_id), worker.in_flight, routed, worker.slots_in_use(), capacity)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def snapshot(self) -> dict[str, Any]:
        latency: dict[str, Any] = {}
        if self._latency:
            samples = self._latency.samples().astype(np.float64)
            for column, name in enumerate(TIMINGS):
                p50, p90, p99 = np.percentile(samples[:, column], [50, 90, 99])
                latency[name] = {"p50": p50, "p90": p90, "p99": p99, "mean": float(samples[:, column].mean())}
        return {
            "requests": dict(self.requests),
            "control_calls": dict(self.control_calls),
            "tasks": self.tasks,
            "steps": self.steps,
            "nodes": self.nodes,
            "mean_batch_size": self.nodes / self.steps if self.steps else 0.0,
            "padded_rows": self.padded_rows,
            "joining_tasks": self.joining_tasks,
            "leaving_requests": self.leaving_requests,
            "worker_losses": self.worker_losses,
            "replayed_requests": self.replayed,
            "partial_replies": self.partial_replies,
            "batch_sizes": {
                key: {str(size): n for size, n in sorted(c.items())} for key, c in self.batch_sizes.items()
            },
            "latency": {name: {k: float(v) for k, v in values.items()} for name, values in latency.items()},
            "latency_window": len(self._latency),
        }
