"""What `Client` and `AsyncClient` share: their settings, how a request is built, checked and
sized, what to do with each answer (hand it over, send it to another server, or send it again
after a backoff), and the counts they keep. The two classes add only their I/O: blocking
sockets and a poll loop, or asyncio sockets and futures.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Container, Sequence
from typing import Any, NamedTuple

from batchmaker.common.protocol import encode

from .errors import RequestTooLarge
from .messages import DEFAULT_ADDRESS, DEFAULT_TIMEOUT, CurveKeys, Reply, infer_message, to_infer_reply
from .retry import DEFAULT_BACKOFF, DEFAULT_MAX_RETRIES, Backoff, is_refusal, retry_after_s
from .servers import ASIDE, DEFAULT_HEALTH_INTERVAL, DEFAULT_HEALTH_TIMEOUT, RequestId, Server, ServerSet, as_addresses
from .sessions import SessionSteps
from .trace_context import trace_fields

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024  # the server's default server.max_message_bytes, for servers that do not say
SMALLEST_MESSAGE_LIMIT = 1024  # the lowest server.max_message_bytes a server accepts: smaller requests always fit


class Outgoing:
    """A request being answered: its message and frame (kept to send it again), the server it must
    go to (a session's, else None), when it is given up on, and the servers that refused it."""

    __slots__ = ("request_id", "message", "frame", "home", "until", "deadline", "give_up_at", "retries", "refused_by")

    def __init__(self, request_id: RequestId, message: dict[str, Any], home: Server | None, timeout: float):
        self.request_id = request_id
        self.message = message
        self.frame = encode(message)
        self.home = home
        now = time.monotonic()
        self.until = now + timeout  # the call's timeout
        deadline_ms = message.get("deadline_ms")
        has_deadline = isinstance(deadline_ms, (int, float)) and not isinstance(deadline_ms, bool)
        self.deadline = now + deadline_ms / 1e3 if has_deadline else None
        self.give_up_at = self.until if self.deadline is None else min(self.until, self.deadline)
        self.retries = 0  # resends after a backoff
        self.refused_by: set[Server] = set()  # servers that answered it with a retryable error, since the last backoff

    def send_later(self, at: float) -> None:
        """Re-encode it to be sent at `at`: its `deadline_ms` counts from its first send, so only what is left goes."""
        if self.deadline is not None:
            self.frame = encode({**self.message, "deadline_ms": max(0, int((self.deadline - at) * 1e3))})


class Resend(NamedTuple):
    """Send the request again to `target` (None: any up server) at `at` (a time.monotonic() value)."""

    target: Server | None
    at: float


class ClientBase:
    """The settings and decisions of a client; see `Client` and `AsyncClient` for their use."""

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        timeout: float = DEFAULT_TIMEOUT,
        curve: CurveKeys | None = None,
        resend: bool = True,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff: Backoff = DEFAULT_BACKOFF,
        max_message_bytes: int | None = None,
    ):
        """`curve`: (this client's secret key file, the server's public key file) for a server with CurveZMQ on.
        `max_retries`: how often at most a request refused with OVERLOADED is sent again after a `backoff`
        (0: never); the request's deadline and the call's timeout end its resends first by default.
        `max_message_bytes`: the largest request to send; None asks each server its own, once, the first
        time a request is over 1 KiB."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be 0 or more, got {max_retries}")
        if max_message_bytes is not None and max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
        self.addresses = as_addresses(address)
        self.address = ", ".join(self.addresses)
        self.timeout = timeout
        self.resend = resend
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_message_bytes = max_message_bytes
        self._limits: dict[Server, int] = {}  # each server's max_message_bytes, once asked
        self._servers = ServerSet(self.addresses, health_interval, health_timeout)
        self._ids = itertools.count(1)
        self.resent = 0  # requests sent to another server because theirs was lost, draining or refused them
        self.retries = 0  # resends after a backoff, of requests every server refused with OVERLOADED
        self.sessions = SessionSteps()
        self._connect(curve)

    def _connect(self, curve: CurveKeys | None) -> None:
        """Open one socket per server (each client with its own kind of socket)."""
        raise NotImplementedError

    def _infer_request(
        self,
        model: str,
        inputs: dict[str, Any],
        deadline_ms: int | None,
        priority: int | None,
        session: str | None,
        session_end: bool,
        stream: bool = False,
        version: int | None = None,
        trace: dict[str, str] | None = None,
    ) -> tuple[dict[str, Any], Server | None]:
        """An infer message, and the server it must go to: its session's, else None (any). It carries `trace`,
        else the current span's trace context, if any, so that the server's span joins the caller's trace."""
        message = infer_message(model, inputs, deadline_ms, priority, stream, version)
        message |= trace_fields() if trace is None else trace
        if session is None:
            return message, None
        server = self.sessions.server(session, self._servers.pick)
        return message | self.sessions.fields(session, session_end), server

    def _infer_reply(self, reply: dict[str, Any], session: str | None, session_end: bool) -> Reply:
        """A successful infer reply as the caller gets it, noting how far its session got."""
        if session is not None:
            self.sessions.answered(session, session_end, reply)
        return to_infer_reply(reply)

    def _outgoing(self, message: dict[str, Any], home: Server | None, in_flight: Container[RequestId] = ()) -> Outgoing:
        """The request with its id: the message's own (which must not be `in_flight`), else a fresh one."""
        if "id" in message:
            if message["id"] in in_flight:
                raise ValueError(f"request id {message['id']!r} is already in flight on this client")
            return Outgoing(message["id"], message, home, self.timeout)
        request_id = next(self._ids)
        while request_id in in_flight:
            request_id = next(self._ids)
        return Outgoing(request_id, {**message, "id": request_id}, home, self.timeout)

    # -- size --------------------------------------------------------------------------------
    def _limits_to_ask(self, request: Outgoing) -> list[Server]:
        """The servers to ask for their max_message_bytes (with `health`) before sizing this request:
        those not asked yet, unless the limit is set or the request fits any server's."""
        if self.max_message_bytes is not None or len(request.frame) <= SMALLEST_MESSAGE_LIMIT:
            return []
        return [s for s in self._servers.servers if s.state != ASIDE and s not in self._limits]

    def _heard_limit(self, server: Server, health: dict[str, Any]) -> None:
        limit = health.get("max_message_bytes")
        valid = isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
        self._limits[server] = limit if valid else DEFAULT_MAX_MESSAGE_BYTES

    def _message_limit(self) -> int:
        """The set limit, else the smallest of the servers' (1 MiB for one that did not say)."""
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        servers = [s for s in self._servers.servers if s.state != ASIDE] or self._servers.servers
        return min(self._limits.get(s, DEFAULT_MAX_MESSAGE_BYTES) for s in servers)

    def _check_size(self, request: Outgoing) -> None:
        """Refuse, unsent, a request the server would close its connection for without reading it."""
        limit = self._message_limit()
        if len(request.frame) > limit:
            raise RequestTooLarge(len(request.frame), limit, request.request_id)

    # -- answers -----------------------------------------------------------------------------
    @staticmethod
    def _stays_home(request: Outgoing) -> bool:
        """Whether the request must go to its own server or nowhere: it continues a session, saying the step the
        session reached, whose state is on that server alone. Sent elsewhere it could only be SESSION_LOST."""
        return request.home is not None and "session_step" in request.message

    def _resend(self, request: Outgoing, server: Server, reply: dict[str, Any], now: float) -> Resend | None:
        """Where and when to send a request again after `server` answered it with `reply`; None: hand the reply over.

        First another server that has not refused it (docs/protocol.md, "Several servers"), unless it is a
        session's, which stays where its session's state is; once every one has, or with one server, or for
        a session, an OVERLOADED refusal is sent again after a backoff, while the resend leaves at least as
        long again before the request's deadline or timeout (time for its answer) and its retries last, unless
        another request of its session is in flight (docs/protocol.md, "Retries")."""
        target = self._servers.retry_target(server, reply, request.refused_by, elsewhere=request.home is None)
        if target is not None:
            self.resent += 1
            return Resend(target, now)
        if request.retries >= self.max_retries or not is_refusal(reply) or self.sessions.pipelined(request.message):
            return None
        wait = self.backoff.delay(request.retries, retry_after_s(reply))
        at = now + wait
        if at + wait >= request.give_up_at:  # the resend would have less time to be answered than it waited
            return None
        request.retries += 1
        self.retries += 1
        request.refused_by.clear()  # after the wait every server may take it again
        request.send_later(at)
        return Resend(request.home, at)
