"""The registry of unanswered requests, an index beside the request table (which holds every
admitted request until it is forgotten): each request accepted and not yet answered, by client
and id, with the deadlines of those that have one (a heap, so the event loop sleeps until the
next). The batching core alone writes it, from the outcomes it returns."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

from manager.records import Request


class RequestRegistry:
    def __init__(self) -> None:
        self._live: dict[tuple[bytes, Any], Request] = {}
        self._deadlines: list[tuple[float, int, Request]] = []  # (deadline, tie-breaker, request)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: tuple[bytes, Any]) -> bool:
        return key in self._live

    def get(self, client: bytes, request_id: Any) -> Request | None:
        return self._live.get((client, request_id))

    def add(self, request: Request) -> None:
        """Track a request (a replay replaces the record it was made from)."""
        self._live[(request.client, request.request_id)] = request
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, id(request), request))

    def remove(self, request: Request) -> None:
        if self._live.get((request.client, request.request_id)) is request:
            del self._live[(request.client, request.request_id)]

    def of_clients(self, clients: Iterable[bytes]) -> list[Request]:
        gone = set(clients)
        return [request for (client, _), request in self._live.items() if client in gone] if gone else []

    def all(self) -> list[Request]:
        return list(self._live.values())

    def expired(self) -> Iterator[Request]:
        """Requests whose deadline has passed and that are not answered yet."""
        now = time.perf_counter()
        while self._deadlines and self._deadlines[0][0] <= now:
            request = heapq.heappop(self._deadlines)[2]
            if not request.done:
                yield request

    def wait_ms(self, longest: int) -> int:
        """How long the event loop may sleep before the next deadline (at most `longest`)."""
        if not self._deadlines:
            return longest
        wait = (self._deadlines[0][0] - time.perf_counter()) * 1e3
        return max(0, min(longest, math.ceil(wait)))
