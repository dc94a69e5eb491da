"""What the batching core concluded about a request, for the event loop to act on: answer it,
send it its error, count it as started over, or refuse one that waited unadmitted (manager.core)."""

from __future__ import annotations

from typing import Any, NamedTuple

from common.protocol import RequestError
from manager.records import Request


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


class Replayed(NamedTuple):
    """The request lost its worker and starts over from its inputs as this new record (no reply)."""

    request: Request


class Refused(NamedTuple):
    """A request that waited for its session's previous one ended without being admitted."""

    client: bytes
    request_id: Any
    error: RequestError


Outcome = Answered | Failed | Replayed | Refused
