"""Admission by expected wait: refuse a request at once rather than let it queue for seconds.

A new request is expected to wait until the cells queued ahead of it have run: queued cells /
cells the server runs per second at capacity, measured on the nearly full tasks of the last second.
Cells of every model count alike: they share the same workers. The queued cells are the ones admitted and not yet
completed: those not yet submitted to a worker and those in the tasks the workers hold (several tasks
ahead each, a few tens of milliseconds of work the new request waits for too); the request processor
counts both. Completions are fed in per task, so the check and the bookkeeping cost O(1) per request
(amortised over the window).

Until the capacity has been measured (a cold start, or a server never loaded enough to fill its
batches) the workers' own timing of full tasks at warm-up stands in for it (warm_up_capacity), so a
cold server offered a flood bounds its queue from the first request. Without either there is no
estimate and requests are admitted: a missing measurement must not turn clients away.
See docs/protocol.md (errors) for what clients are told.

The checks of a request's envelope that need no plan (the in-flight limit, its deadline, `stream` and `priority`)
are here too, for both paths (the batching core's and the workers' running batches), and the `Burst`: the requests
of one burst checked and planned, whose records the batching core makes together.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from batchmaker.common.models.base import Planner
from batchmaker.common.protocol import (
    BAD_REQUEST,
    DEADLINE_EXCEEDED,
    INVALID_INPUT,
    OVERLOADED,
    RequestError,
    echo,
    optional_int,
)
from batchmaker.manager.batching.records import Request
from batchmaker.manager.batching.versions import served_name

WINDOW_S = 1.0  # completions older than this no longer count towards the measured throughput
MAX_SPREAD_S = 1.0  # how far past the queue's own excess the quotes of earlier refusals may delay a new one's
CELLS_SMOOTHING = 0.1  # weight of each admitted burst in the running mean of cells per request
MIN_BUSY_S = 0.02  # a throughput measured over less busy time than this is noise, not an estimate
FULL_FILL = 0.75  # a task this full shows what the server can do, not just what it was offered
MAX_PRIORITY = 2**31 - 1  # a request's priority lies within +-MAX_PRIORITY


def check_room(in_flight: int, limit: int) -> None:
    """Refuse a request beyond `max_queued_requests` (`limit`) requests in flight."""
    if in_flight >= limit:
        raise RequestError(OVERLOADED, f"{in_flight} requests in flight (limit {limit}); retry later")


def inputs_of(message: dict[str, Any], model: Planner) -> Any:
    """The request's `inputs`, whose names its model knows (their values are the model's to check, in its plan)."""
    if "inputs" not in message:
        raise RequestError(BAD_REQUEST, "request lacks 'inputs' (a map)")
    model.check_input_names(message["inputs"])
    return message["inputs"]


def stream_and_priority(message: dict[str, Any], model: Planner) -> tuple[bool, int]:
    """The request's `stream` (which its model must be able to do) and `priority` (0 when absent)."""
    stream = message.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(BAD_REQUEST, f"'stream' must be true or false, got {echo(stream)}")
    if stream and not model.can_stream:
        name = served_name(model.name)
        why = f"model {name!r} ({model.kind}) cannot stream its outputs; send the request without 'stream'"
        raise RequestError(INVALID_INPUT, why)
    return stream, optional_int(message, "priority", minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY) or 0


def deadline_of(message: dict[str, Any], default_ms: int) -> int | None:
    """The request's `deadline_ms`, else the server's `default_deadline_ms` (None: no deadline)."""
    deadline_ms = optional_int(message, "deadline_ms", minimum=0)
    return deadline_ms if deadline_ms is not None else default_ms or None


class ExpectedWait:
    """The server's throughput, measured over a sliding window of completed tasks, and the wait it
    implies for queued cells.

    Throughput is counted per second a worker was busy, not per second of wall time: a lightly
    loaded server completes only what it is offered. A task kept its worker busy from its
    submission, or from the worker's previous completion if that came later (a worker runs its
    tasks one after another), to the moment the manager reads its notice. That is the manager's
    view on purpose: queued cells drain at the rate the whole server runs them, and a manager short
    of CPU drains them slower than its workers could run them. A build in which each worker timed
    its own tasks put the capacity up to 46% above the rate the server answered at under overload
    (docs/benchmarks/log.md, "A task's busy time, timed by the worker").

    Only nearly full tasks count: small batches run far fewer cells per second than full ones, so
    a rate measured on them would turn away bursts the server could absorb, and a server filling
    up from idle (a cold start under load) is measured as soon as its first full tasks have run,
    not once they outnumber the small ones. The capacity last
    measured is kept while no full task runs; until it is first measured there is no estimate.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, window_s: float = WINDOW_S):
        self.clock = clock
        self._window_s = window_s
        self._window: collections.deque[tuple[float, int, float, Hashable]] = collections.deque()
        self._cells = 0  # of the window's full tasks
        self._busy_s = 0.0  # of the window's full tasks
        self._tasks_by_worker: collections.Counter[Hashable] = collections.Counter()  # full ones, in the window
        self._last_finish: dict[Hashable, float] = {}
        self._capacity: float | None = None  # cells per second, measured on nearly full tasks
        self._assumed: float | None = None  # cells per second, from the workers' warm-up, until measured

    def measure_task(self, cells: int, largest_batch: int, worker: Hashable, submitted: float, steps: int = 1) -> float:
        """Record a task of `cells` cells in `steps` steps (of a cell type batching up to `largest_batch`),
        submitted at `submitted` (on this clock), that `worker` finished; returns the seconds it kept the
        worker busy. A multi-step task counts as full when its steps are, on average."""
        now = self.clock()
        busy = max(0.0, now - max(submitted, self._last_finish.get(worker, submitted)))
        self._last_finish[worker] = now
        if cells >= FULL_FILL * largest_batch * steps:
            self._window.append((now, cells, busy, worker))
            self._cells += cells
            self._busy_s += busy
            self._tasks_by_worker[worker] += 1
        self._expire(now)
        if self._busy_s >= MIN_BUSY_S:
            self._capacity = self._cells / self._busy_s * len(self._tasks_by_worker)
        return busy

    def assume(self, cells_per_second: float | None) -> None:
        """The capacity to quote until one is measured (None: none)."""
        self._assumed = cells_per_second

    def cells_per_second(self) -> float | None:
        """The server's capacity in cells per second: measured on nearly full tasks, else the one assumed."""
        return self._capacity if self._capacity is not None else self._assumed

    def assumed_cells_per_second(self) -> float | None:
        return self._assumed

    def wait_s(self, queued_cells: int) -> float | None:
        """Seconds until `queued_cells` cells have run at capacity; None while there is no capacity."""
        rate = self.cells_per_second()
        return None if rate is None else queued_cells / rate

    def _expire(self, now: float) -> None:
        horizon = now - self._window_s
        while self._window and self._window[0][0] < horizon:
            _, cells, busy, worker = self._window.popleft()
            self._cells -= cells
            self._busy_s -= busy
            self._tasks_by_worker[worker] -= 1
            if not self._tasks_by_worker[worker]:
                del self._tasks_by_worker[worker]
                if self._last_finish.get(worker, now) < horizon:  # gone quiet, or gone: forget it
                    del self._last_finish[worker]
        if not self._window:
            self._busy_s = 0.0  # no float residue once the window is empty


class Admission:
    """The expected-wait checks made before a request is admitted (the count bounds stay in the server)."""

    def __init__(self, max_queue_delay_ms: int, estimator: ExpectedWait | None = None):
        self.max_queue_delay_s = max_queue_delay_ms / 1e3  # 0: no refusal by expected wait
        self.estimator = estimator or ExpectedWait()
        self.shedding = False  # whether the latest check refused for the expected wait
        self._returns_at = 0.0  # on the estimator's clock: when the refused requests quoted so far would be admitted
        self._cells_per_request: float | None = None  # a running mean over the admitted bursts
        self._last_key: tuple[Any, ...] | None = None
        self._last_refusal = RequestError(OVERLOADED, "")

    def measure_task(self, cells: int, largest_batch: int, worker: Hashable, submitted: float, steps: int = 1) -> float:
        return self.estimator.measure_task(cells, largest_batch, worker, submitted, steps)

    def check(self, queued_cells: int, deadline_ms: int | None) -> None:
        """Raise DEADLINE_EXCEEDED if the expected wait exceeds the deadline, OVERLOADED if it exceeds the limit."""
        wait = self.estimator.wait_s(queued_cells)
        self.shedding = False
        if wait is None:
            return
        if deadline_ms is not None and wait * 1e3 > deadline_ms:
            raise self._refusal(
                (DEADLINE_EXCEEDED, wait, deadline_ms),
                lambda: RequestError(
                    DEADLINE_EXCEEDED,
                    f"estimated wait {_ms(wait)} ms exceeds the request's deadline_ms {deadline_ms}; "
                    "raise the deadline or retry later",
                ),
            )
        if self.max_queue_delay_s and wait > self.max_queue_delay_s:
            self.shedding = True
            raise self._refusal(
                (OVERLOADED, wait, queued_cells),
                lambda: RequestError(
                    OVERLOADED,
                    f"estimated wait {_ms(wait)} ms exceeds the server's limit of {_ms(self.max_queue_delay_s)} ms "
                    f"({queued_cells} cells queued); retry later",
                ),
            )

    def _refusal(self, key: tuple[Any, ...], build: Callable[[], RequestError]) -> RequestError:
        """The refusal for `key` (what its message says), built only when the last one said otherwise: under a
        flood, refusals come in runs quoting the same wait, since refusing queues nothing. It is raised afresh,
        without the traceback of its last raise, which would otherwise grow by a frame per raise."""
        if key != self._last_key:
            self._last_key, self._last_refusal = key, build()
        return self._last_refusal.with_traceback(None)

    def snapshot(self, queued_cells: int) -> dict[str, float | None]:
        """For the `stats` op: the measured capacity and the wait a new request would be quoted."""
        wait = self.estimator.wait_s(queued_cells)
        return {
            "cells_per_s": self.estimator.cells_per_second(),
            "warm_up_cells_per_s": self.estimator.assumed_cells_per_second(),
            "estimated_wait_ms": None if wait is None else wait * 1e3,
            "max_queue_delay_ms": self.max_queue_delay_s * 1e3,
        }

    def admitted(self, requests: int, cells: int) -> None:
        """A burst of `requests` requests holding `cells` cells was admitted: refused requests are taken to be
        of the running mean's size when their return times are spread (refusing plans nothing, so their own
        size is never known)."""
        if not requests:
            return
        mean = cells / requests
        known = self._cells_per_request
        self._cells_per_request = mean if known is None else known + CELLS_SMOOTHING * (mean - known)

    def retry_after_ms(self, queued_cells: int, refused: int = 1) -> list[int]:
        """When each of `refused` requests refused with OVERLOADED now would be admitted, in order; empty while
        max_queue_delay_ms is not what refuses.

        The first comes back once the expected wait, at the measured capacity, is back under the bound, and each
        one after it later by the time a request's cells take at that capacity, behind every refused request
        quoted before it: a burst refused together is told to return spread out, at the rate the server can
        admit it, rather than together to be refused together again. What earlier refusals were quoted delays
        a new burst by at most MAX_SPREAD_S past the queue's own excess, so that quotes to requests that never
        came back do not pile up."""
        wait = self.estimator.wait_s(queued_cells)  # the wait `check` refuses on
        rate = self.estimator.cells_per_second()
        if wait is None or rate is None or not self.max_queue_delay_s or wait <= self.max_queue_delay_s:
            return []
        now = self.estimator.clock()
        admissible = now + wait - self.max_queue_delay_s
        first = min(max(admissible, self._returns_at), admissible + MAX_SPREAD_S)
        spacing = (self._cells_per_request or 0.0) / rate
        self._returns_at = first + refused * spacing
        return [math.ceil(round((first - now + i * spacing) * 1e3, 3)) for i in range(refused)]  # whole µs, then up


def warm_up_capacity(timings: Iterable[Any], max_batch: Mapping[str, int]) -> float | None:
    """Cells per second the workers' warm-up timings imply (each a map of cell type to the seconds of a
    task at its largest batch): per worker, its cell types in turn, an equal share of cells each; the
    workers side by side. A worker whose timing is missing or malformed counts nothing; None if none counts."""
    total = 0.0
    for timed in timings:
        if not isinstance(timed, dict) or set(timed) != set(max_batch):
            continue
        seconds = list(timed.values())
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 for s in seconds):
            continue
        total += len(max_batch) / sum(timed[key] / max_batch[key] for key in max_batch)
    return total or None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


class Burst:
    """Requests of one burst checked and planned, whose records are made together."""

    def __init__(self, routed: int = 0) -> None:
        self.routed = routed  # requests in flight routed to workers whole
        self.requests: list[Request] = []
        self.keys: set[tuple[bytes, Any]] = set()  # (client, id) of each
        self.nodes = 0  # their cells

    def add(self, request: Request) -> None:
        self.requests.append(request)
        self.keys.add((request.client, request.request_id))
        self.nodes += request.unfolded.plan.nodes

    def clear(self) -> None:
        self.requests = []
        self.keys.clear()
        self.nodes = 0
