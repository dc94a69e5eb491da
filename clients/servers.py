"""Which of several servers gets the next request, and which ones are set aside (docs/protocol.md, "Several servers").

This is the bookkeeping both clients share; it does no I/O. A server is *up* (gets
new requests), *draining* (it refused a request because it is stopping: no new
requests, but the ones it accepted are still awaited) or *aside* (it stopped
answering or its connection closed: its unanswered requests were handed back to be
sent elsewhere). Servers that are not up are probed with `health` every
`health_interval` seconds and rejoin when one answers without "draining".
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from batchmaker.common.protocol import OVERLOADED, UNAVAILABLE, WORKER_LOST

UP, DRAINING, ASIDE = "up", "draining", "aside"
PROBE_PREFIX = "\x00probe-"  # health probes use string ids no caller picks by accident
DEFAULT_HEALTH_INTERVAL = 1.0
DEFAULT_HEALTH_TIMEOUT = 2.0

RequestId = int | str
RETRYABLE_CODES = (OVERLOADED, UNAVAILABLE, WORKER_LOST)  # it did not run to its end there: another server may take it


def as_addresses(address: str | Sequence[str]) -> list[str]:
    """One address or several, checked: at least one, each a non-empty string, none twice."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError("give at least one server address")
    for item in addresses:
        if not isinstance(item, str) or not item:
            raise ValueError(f"a server address must be a non-empty string like tcp://host:5555, got {item!r}")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"a server address is listed twice: {addresses}")
    return addresses


def is_probe(request_id: RequestId) -> bool:
    return isinstance(request_id, str) and request_id.startswith(PROBE_PREFIX)


def _error(reply: dict[str, Any]) -> dict[str, Any]:
    error = reply.get("error") if reply.get("ok") is False else None
    return error if isinstance(error, dict) else {}


def is_retryable(reply: dict[str, Any]) -> bool:
    """An error answer for a request that did not run (refused, or its server stopped): it may go elsewhere."""
    return _error(reply).get("code") in RETRYABLE_CODES


def is_stopping(reply: dict[str, Any]) -> bool:
    """An answer saying its server is stopping (UNAVAILABLE, or OVERLOADED while draining): send it nothing new."""
    error = _error(reply)
    code = error.get("code")
    return code == UNAVAILABLE or (code == OVERLOADED and "draining" in str(error.get("message", "")))


class Server:
    """One server address: its state, the requests it owes an answer, and its health probe."""

    def __init__(self, index: int, address: str):
        self.index = index
        self.address = address
        self.state = UP
        self.outstanding: set[RequestId] = set()
        self.quiet_since = 0.0  # last reply, or when its first outstanding request was sent
        self.probe_id: str | None = None
        self.probe_sent = 0.0

    def __repr__(self) -> str:
        return f"Server({self.address!r}, {self.state}, {len(self.outstanding)} outstanding)"


class ServerSet:
    """The servers of one client; `pick` chooses the up server with the fewest outstanding requests."""

    def __init__(
        self,
        addresses: Sequence[str],
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
    ):
        if health_interval <= 0 or health_timeout <= 0:
            raise ValueError("health_interval and health_timeout must be positive")
        self.servers = [Server(index, address) for index, address in enumerate(addresses)]
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.failover = len(self.servers) > 1  # with one server there is nowhere else to send a request
        self._rotation = itertools.cycle(range(len(self.servers)))
        self._probe_ids = itertools.count(1)

    @property
    def any_up(self) -> bool:
        return any(server.state == UP for server in self.servers)

    def pick(self, exclude: Collection[Server] = ()) -> Server | None:
        """The up server with the fewest outstanding requests, ties taken in turn; None if none is up
        (or only servers in `exclude`)."""
        if not self.failover:
            return self.servers[0]
        start = next(self._rotation)
        best: Server | None = None
        count = len(self.servers)
        for offset in range(count):
            server = self.servers[(start + offset) % count]
            if server.state != UP or server in exclude:
                continue
            if best is None or len(server.outstanding) < len(best.outstanding):
                best = server
        return best

    def retry_target(
        self, server: Server, reply: dict[str, Any], refused: set[Server], elsewhere: bool = True
    ) -> Server | None:
        """Where to resend a request `server` answered with `reply`, or None to give the caller that reply
        (or to send it again to `server` after a backoff).

        Only a retryable error is resent, never to a server that already refused the request
        (each server gets it once, then the caller gets the last error), and only where the
        request may go `elsewhere` (a session's request stays with its state). `refused` (the
        request's own set) records `server`; a server that says it is stopping gets nothing new."""
        if not (self.failover and is_retryable(reply)):
            return None
        if is_stopping(reply):
            self.draining(server)
        if not elsewhere:
            return None
        refused.add(server)
        return self.pick(refused)

    @staticmethod
    def sent(server: Server, request_id: RequestId, now: float) -> None:
        if not server.outstanding:
            server.quiet_since = now
        server.outstanding.add(request_id)

    @staticmethod
    def heard(server: Server, now: float) -> None:
        server.quiet_since = now

    def draining(self, server: Server) -> None:
        """The server refused a request because it is stopping: send it nothing new."""
        if server.state == UP:
            server.state = DRAINING
            server.probe_sent = 0.0  # probe at once: tells when it is back

    def set_aside(self, server: Server) -> set[RequestId]:
        """Stop using a server that went silent or away; return the requests it still owed, to send elsewhere."""
        server.state = ASIDE
        server.probe_id = None
        server.probe_sent = 0.0
        owed, server.outstanding = server.outstanding, set()
        return owed

    def probe_answered(self, server: Server, reply: dict[str, Any]) -> bool:
        """Note a health answer; return True when it brings a drained or set-aside server back."""
        if reply.get("id") != server.probe_id:
            return False  # an older probe's answer, or one sent before the server was set aside
        server.probe_id = None
        draining = reply.get("status") == "draining"
        if draining and server.state == UP:
            self.draining(server)
        if server.state != UP and reply.get("ok") is True and not draining:
            server.state = UP
            return True
        return False

    def tick(self, now: float) -> tuple[list[tuple[Server, str]], list[Server]]:
        """The probes to send now, as (server, probe id), and the servers whose probe went unanswered.

        An up or draining server is probed when it owes answers and has been quiet for
        `health_interval`; any other server every `health_interval`. A probe unanswered
        for `health_timeout` marks its server lost, unless it is already aside.
        """
        probes: list[tuple[Server, str]] = []
        lost: list[Server] = []
        for server in self.servers:
            if server.probe_id is not None:
                if now - server.probe_sent < self.health_timeout:
                    continue
                server.probe_id = None
                if server.state != ASIDE:
                    lost.append(server)
                    continue
            if server.state == UP:
                due = bool(server.outstanding) and now - server.quiet_since >= self.health_interval
            else:
                due = now - server.probe_sent >= self.health_interval
            if due:
                server.probe_id = f"{PROBE_PREFIX}{next(self._probe_ids)}"
                server.probe_sent = now
                probes.append((server, server.probe_id))
        return probes, lost

    def describe(self) -> str:
        return ", ".join(server.address for server in self.servers)


def connection_closed(event_frames: list[bytes]) -> bool:
    """Whether frames read from a socket monitor report that the connection to the server closed."""
    return parse_monitor_message(event_frames)["event"] == zmq.EVENT_DISCONNECTED
