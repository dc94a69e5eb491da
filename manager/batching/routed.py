"""Requests routed whole to a worker's running batch (`[scheduler] running_batch = "worker"`).

The manager's work for such a request is per request, never per step: check its envelope and model, refuse it
from the expected wait, pick a worker, and forward its inputs; the worker plans it, runs it in its running batch
(worker.running_batch) and sends its outputs back, which the manager relays. This table is the manager's one
record of them: who asked, on which worker each runs, its deadline, and its inputs, so that a request whose worker
is lost is sent again to another one. It does no I/O: what to send to which worker it returns as data.

The expected wait is the requests in flight over the rate requests were answered at over the last second (the
manager's own count of answers), so refusing costs no plan and no per-cell work. Until that rate is measured, the
requests in flight are bounded by what the workers' running batches hold at once.

A streamed request's partials come from its worker as its outputs grow; the table keeps those not yet sent, so
that a request gets at most one partial a turn of the event loop and none while its client has replies waiting
unread (what they carry then goes in one partial once it has caught up), and the last before its answer.
"""

from __future__ import annotations

import collections
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchmaker.common.models.base import Planner
from batchmaker.common.protocol import (
    DEADLINE_EXCEEDED,
    OVERLOADED,
    RequestError,
    encode,
    is_tensor_map,
    map_to_tensor,
    tensor_to_map,
)

RATE_WINDOW_S = 1.0  # answers older than this no longer count towards the measured rate
MIN_ANSWERS = 32  # fewer answers in the window than this measure nothing: no request is refused for the wait


@dataclass(eq=False)
class Routed:
    """A request routed whole: what the event loop's replies and stats read of a request, and its inputs."""

    client: bytes
    request_id: Any
    model: Planner
    inputs: Any
    arrival: float
    deadline: float | None
    priority: int = 0
    stream: bool = False
    worker_id: int = -1
    handle: int = 0
    failures: int = 0  # workers lost while it ran on them
    unsent: list[dict[str, Any]] = field(default_factory=list)  # partials its worker sent that are not sent on yet
    restarted: bool = False  # streamed: it started over on another worker since its last partial


def joined(partials: list[dict[str, Any]]) -> dict[str, Any]:
    """Partials' outputs (tensor maps) as one: each output's rows in order."""
    if len(partials) <= 1:
        return partials[0] if partials else {}
    return {
        name: tensor_to_map(np.concatenate([map_to_tensor(partial[name], name) for partial in partials]))
        for name in partials[0]
    }


class RoutedRequests:
    """Routed requests by handle and by (client, id), their deadlines, and each worker's share of them."""

    def __init__(self, max_queue_delay_ms: int, window: int, clock=time.perf_counter):
        """`window`: the requests a worker's running batch holds at once (common.window)."""
        self._max_wait_s = max_queue_delay_ms / 1e3
        self._window = window
        self._clock = clock
        self._by_handle: dict[int, Routed] = {}
        self._by_key: dict[tuple[bytes, Any], Routed] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._held: collections.Counter[int] = collections.Counter()  # requests in flight, per worker
        self._progress_at: dict[int, float] = {}  # per worker: when it last reported steps, or got work while idle
        self._answered: collections.deque[float] = collections.deque()  # when each answer of the window came
        self._next_handle = 1
        self._outbox: dict[int, list[bytes]] = collections.defaultdict(list)  # worker id -> request frames
        self._dropped: dict[int, list[int]] = collections.defaultdict(list)  # worker id -> handles to let go
        self._streams_changed: dict[Routed, None] = {}  # streamed requests with partials not sent on, in order

    def __len__(self) -> int:
        return len(self._by_handle)

    def __contains__(self, key: tuple[bytes, Any]) -> bool:
        return key in self._by_key

    def get(self, client: bytes, request_id: Any) -> Routed | None:
        return self._by_key.get((client, request_id))

    # -- admission -------------------------------------------------------------------------------
    def answer_rate(self) -> float | None:
        """Answers a second over the last RATE_WINDOW_S; None while fewer than MIN_ANSWERS came in it."""
        now = self._clock()
        while self._answered and self._answered[0] < now - RATE_WINDOW_S:
            self._answered.popleft()
        if len(self._answered) < MIN_ANSWERS:
            return None
        return len(self._answered) / RATE_WINDOW_S

    def expected_wait_s(self) -> float | None:
        """The wait a new request is expected to have: requests in flight over the answer rate."""
        rate = self.answer_rate()
        return None if rate is None else len(self._by_handle) / rate

    def overload(self, workers: int, rate: float | None) -> RequestError | None:
        """Why a new request is refused (OVERLOADED): the server is not expected to start it within
        `max_queue_delay_ms` at the answer `rate`; None when it is. Until the rate is measured (a server that just
        started, or one idle for a second), a request beyond what the `workers`' running batches hold at once is
        refused: a burst into a cold server would otherwise all be let in."""
        if not self._max_wait_s:
            return None
        held = len(self._by_handle)
        if rate is None:
            if held < workers * self._window:
                return None
            return RequestError(
                OVERLOADED, f"{held} requests in flight, as many as the workers' running batches hold at once, "
                "and the server's rate is not measured yet; retry later",
            )  # fmt: skip
        if held <= self._max_wait_s * rate:
            return None
        return RequestError(
            OVERLOADED, f"estimated wait {held / rate * 1e3:.0f} ms exceeds the server's limit of "
            f"{self._max_wait_s * 1e3:.0f} ms ({held} requests in flight); retry later",
        )  # fmt: skip

    def check_deadline(self, deadline_ms: int | None, rate: float | None) -> None:
        """Refuse a request (DEADLINE_EXCEEDED) whose deadline is nearer than its expected wait at the answer `rate`."""
        if deadline_ms is None or rate is None:
            return
        wait_ms = len(self._by_handle) / rate * 1e3
        if wait_ms > deadline_ms:
            raise RequestError(
                DEADLINE_EXCEEDED, f"estimated wait {wait_ms:.0f} ms exceeds the request's deadline_ms {deadline_ms}"
            )

    def retry_after_ms(self, refused: int) -> list[int]:
        """When each of `refused` requests refused with OVERLOADED now could come back: once the expected wait is
        under the bound again, one request's share of the answer rate apart, so that they do not return together."""
        wait = self.expected_wait_s()
        if wait is None or not self._max_wait_s or wait <= self._max_wait_s:
            return []
        spacing = RATE_WINDOW_S / len(self._answered)
        return [math.ceil((wait - self._max_wait_s + i * spacing) * 1e3) for i in range(refused)]

    def route(self, request: Routed, workers: list[int]) -> None:
        """Send the request to the worker of `workers` holding the fewest (sent with `take_sends`)."""
        request.worker_id = min(workers, key=self._held.__getitem__)
        if not self._held[request.worker_id]:
            self._progress_at[request.worker_id] = self._clock()  # the hang watchdog counts from here
        if not request.handle:
            request.handle = self._next_handle
            self._next_handle += 1
            self._by_key[(request.client, request.request_id)] = request
            if request.deadline is not None:
                heapq.heappush(self._deadlines, (request.deadline, request.handle))
        self._by_handle[request.handle] = request
        self._held[request.worker_id] += 1
        frame = encode([request.handle, request.model.name, request.inputs, request.priority, request.stream])
        self._outbox[request.worker_id].append(frame)

    def take_sends(self) -> tuple[dict[int, list[bytes]], dict[int, list[int]]]:
        """What to send since the last call: request frames per worker, and handles each worker should let go."""
        sends, drops = dict(self._outbox), dict(self._dropped)
        self._outbox.clear()
        self._dropped.clear()
        return sends, drops

    # -- streams ---------------------------------------------------------------------------------
    def partial(self, worker_id: int, handle: Any, outputs: Any) -> None:
        """A worker's partial of a streamed request (its outputs final since its last one), kept to be sent on."""
        request = self._by_handle.get(handle) if isinstance(handle, int) else None
        if request is None or request.worker_id != worker_id or not request.stream:
            return  # it ended meanwhile, or was sent again after its worker was written off
        if isinstance(outputs, dict) and outputs and all(map(is_tensor_map, outputs.values())):
            request.unsent.append(outputs)
            self._streams_changed[request] = None

    def partials(self, client_waiting: Callable[[bytes], bool]) -> list[tuple[Routed, dict[str, Any], bool]]:
        """A partial for each streamed request with news whose client reads its replies (the others keep it for a
        later turn): its outputs and whether it restarted since its last one."""
        partials = []
        ready = [request for request in self._streams_changed if not client_waiting(request.client)]
        for request in ready:
            news = self.last_partial(request)
            if news is not None:
                partials.append((request, *news))
        return partials

    def last_partial(self, request: Routed) -> tuple[dict[str, Any], bool] | None:
        """The request's news in one partial, sent now; None when it has none (no outputs, no restart to tell)."""
        self._streams_changed.pop(request, None)
        if not request.unsent and not request.restarted:
            return None
        outputs, restarted = joined(request.unsent), request.restarted
        request.unsent, request.restarted = [], False
        return outputs, restarted

    # -- ends ------------------------------------------------------------------------------------
    def progressed(self, worker_id: int) -> None:
        """The worker's running batch reported steps (with answers or without: it reports at least every second)."""
        self._progress_at[worker_id] = self._clock()

    def stalled(self, timeout_s: float) -> dict[int, float]:
        """Workers holding requests whose running batch reported no step for over `timeout_s`: seconds since."""
        now = self._clock()
        return {
            worker: now - self._progress_at[worker]
            for worker, held in self._held.items()
            if held and now - self._progress_at[worker] > timeout_s
        }

    def held_by(self, worker_id: int) -> int:
        """Requests in flight routed to this worker."""
        return self._held[worker_id]

    def older_in_flight(self, request: Routed) -> bool:
        """Whether a request that arrived before this one, just answered, is still in flight: this one left the
        running batches early, as cellular batching lets it."""
        oldest = next(iter(self._by_handle.values()), None)  # in the order they were routed
        return oldest is not None and oldest.arrival < request.arrival

    def answered(self, worker_id: int, handle: Any) -> Routed | None:
        """The request a worker's answer is for; None for one that ended meanwhile (cancelled, expired, or sent
        again after its worker was written off)."""
        request = self._by_handle.get(handle) if isinstance(handle, int) else None
        if request is None or request.worker_id != worker_id:
            return None
        self._answered.append(self._clock())
        self._forget(request)
        return request

    def end(self, requests: list[Routed]) -> list[Routed]:
        """End requests before their answer (cancel, deadline, client gone, shutdown): their workers let them go."""
        for request in requests:
            self._dropped[request.worker_id].append(request.handle)
            self._forget(request)
        return requests

    def of_clients(self, clients: set[bytes]) -> list[Routed]:
        return [request for request in self._by_handle.values() if request.client in clients]

    def expired(self) -> list[Routed]:
        now, expired = self._clock(), []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, handle = heapq.heappop(self._deadlines)
            if handle in self._by_handle:
                expired.append(self._by_handle[handle])
        return expired

    def wait_ms(self, longest: int) -> int:
        """How long the event loop may sleep before the next deadline (at most `longest`)."""
        while self._deadlines and self._deadlines[0][1] not in self._by_handle:
            heapq.heappop(self._deadlines)
        if not self._deadlines:
            return longest
        return max(0, min(longest, int((self._deadlines[0][0] - self._clock()) * 1e3) + 1))

    def uses(self, model: Planner) -> bool:
        """Whether a request in flight runs on this model's version (it cannot be unloaded yet)."""
        return any(request.model is model for request in self._by_handle.values())

    def all(self) -> list[Routed]:
        return list(self._by_handle.values())

    def lost(self, worker_id: int) -> list[Routed]:
        """The requests a lost worker held, in the order they came; they are no longer on any worker."""
        lost = [request for request in self._by_handle.values() if request.worker_id == worker_id]
        for request in lost:
            del self._by_handle[request.handle]
            self._streams_changed.pop(request, None)
            request.unsent.clear()  # void: it starts over, and its next partial says so
            request.restarted = request.stream
        self._held.pop(worker_id, None)
        self._progress_at.pop(worker_id, None)
        self._outbox.pop(worker_id, None)
        self._dropped.pop(worker_id, None)
        return lost

    def forget_lost(self, request: Routed) -> None:
        """A request `lost` returned that is not routed again (it failed)."""
        del self._by_key[(request.client, request.request_id)]

    def _forget(self, request: Routed) -> None:
        del self._by_handle[request.handle]
        self._streams_changed.pop(request, None)
        del self._by_key[(request.client, request.request_id)]
        self._held[request.worker_id] -= 1

    def snapshot(self) -> dict[str, Any]:
        wait = self.expected_wait_s()
        return {
            "requests_in_flight": len(self._by_handle),
            "expected_wait_ms": None if wait is None else round(wait * 1e3, 3),
            "by_worker": {str(worker): count for worker, count in self._held.items() if count},
        }
