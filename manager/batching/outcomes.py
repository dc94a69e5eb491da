"""What the batching core concluded about a request, for the event loop to act on: answer it,
send it its error, send a streamed request the outputs that became final, count it as started
over, or refuse one that waited unadmitted (manager.batching.core)."""

from __future__ import annotations

from typing import Any, NamedTuple

from batchmaker.common.protocol import RequestError
from batchmaker.manager.batching.records import Request


def request_timing(arrival: float, started: float, end: float) -> dict[str, int]:
    """An answer's `timing`: queueing (arrival to first issue), computation (first issue to answer) and total,
    in µs."""
    started = started or end
    return {
        "queue_us": int((started - arrival) * 1e6),
        "compute_us": int((end - started) * 1e6),
        "total_us": int((end - arrival) * 1e6),
    }


class Answered(NamedTuple):
    """The request's outputs are known: reply with them."""

    request: Request
    outputs: dict[str, Any]
    timing: dict[str, int]  # queue_us, compute_us, total_us
    left_early: bool  # answered while a request that arrived before it was still running
    session_step: int | None = None  # of a session's request: the session's requests answered so far


class Failed(NamedTuple):
    """The request ended with an error: reply with it."""

    request: Request
    error: RequestError


class Partial(NamedTuple):
    """A streamed request's outputs that became final since its last partial reply: send them.
    `restarted`: the request started over since then (its worker was lost), so the partials sent
    before are void and this one begins the stream anew."""

    request: Request
    outputs: dict[str, Any]
    restarted: bool


class Replayed(NamedTuple):
    """The request lost its worker and starts over from its inputs as this new record (no reply)."""

    request: Request


class Refused(NamedTuple):
    """A request that waited for its session's previous one ended without being admitted."""

    client: bytes
    request_id: Any
    error: RequestError


Outcome = Answered | Failed | Partial | Replayed | Refused
