"""Deadlines of things that may end before theirs passes (answered, admitted, cancelled): a heap,
so that the event loop sleeps until the earliest one and then ends, once, those still unfinished.
The request table keeps one for admitted requests, the session store one for requests waiting for
their session's turn."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Ending(Protocol):
    @property
    def done(self) -> bool: ...


T = TypeVar("T", bound=Ending)


SLACK = 64  # entries of finished items tolerated beyond twice the unfinished ones


def without_done(heap: list[tuple[float, int, T]], unfinished: int) -> list[tuple[float, int, T]]:
    """A heap of (time, tie-breaker, item) entries whose items may finish before their entry comes up:
    the same heap, or, once it holds more than twice the `unfinished` items (the owner's count), a new
    one of their entries only. The cost is amortised over the entries added since the last."""
    if len(heap) <= 2 * unfinished + SLACK:
        return heap
    kept = [entry for entry in heap if not entry[2].done]
    heapq.heapify(kept)
    return kept


class Deadlines(Generic[T]):
    """perf_counter deadlines; an item that is `done` when its deadline passes is skipped.

    An item that finishes long before its deadline (a request answered in milliseconds with a
    minute's deadline) would stay in the heap, and keep everything it refers to, until then: at a
    few thousand requests a second that is hundreds of thousands of finished requests. The owner
    says how many of its items are unfinished (`forget_done`), and once the heap holds more than
    twice that, the finished entries are dropped (`without_done`)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []  # (deadline, tie-breaker, item)

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, deadline: float, item: T) -> None:
        heapq.heappush(self._heap, (deadline, id(item), item))

    def forget_done(self, unfinished: int) -> None:
        """Drop the finished items' entries if they outnumber the `unfinished` ones (the owner's count)."""
        self._heap = without_done(self._heap, unfinished)

    def due(self, now: float) -> Iterator[T]:
        """The unfinished items whose deadline is at or before `now`, earliest first; each comes due once."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)[2]
            if not item.done:
                yield item

    def wait_ms(self, longest: int) -> int:
        """How long the event loop may sleep before the next deadline (at most `longest`)."""
        if not self._heap:
            return longest
        wait = (self._heap[0][0] - time.perf_counter()) * 1e3
        return max(0, min(longest, math.ceil(wait)))
