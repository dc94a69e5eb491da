"""The client side of the manager: the ROUTER socket clients talk to, its authentication, the
envelope of each message (one frame, a msgpack map, an `id`, no field its op does not read),
replies, and departed clients.

No reply is dropped while its client is connected. A ROUTER socket silently drops messages to a
peer whose send queue is full (its high-water mark), so the socket is ROUTER_MANDATORY: a full
queue makes the send fail instead, and the reply waits in that client's backlog, in order, until
the client reads again. A client whose backlog has not moved for `unreachable_client_ms`, or has
grown past its bound (in replies, or in bytes: `max_backlog_bytes`), is taken for gone: its backlog
is dropped and its requests are cancelled, as for a client that disconnected.

A connection beyond `max_clients` live ones is closed as soon as it is accepted (manager/loop/connections.py).

A frame over `max_message_bytes` closes its connection before it is read (ZMQ_MAXMSGSIZE): libzmq
buffers every frame it accepts, so the limit must be the socket's, not the decoder's.

Messages are read in bursts: all those waiting, for up to READ_S (`receive`), since a request
waiting unread in the socket is one the server's admission cannot see. Replies made meanwhile, and
while completions are taken (`replies_held`), are sent together at the end: each send to a pipe the
socket's I/O thread has emptied wakes that thread with a system call, so a burst of refusals sent
one by one would cost the manager several times what deciding them does.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from batchmaker.common.addresses import is_loopback
from batchmaker.common.auth import CurveServer
from batchmaker.common.protocol import BAD_REQUEST, CONTROL_OPS, RequestError, check_request_fields, decode, encode
from batchmaker.common.server_config import ServerConfig
from batchmaker.common.sockets import MORE, NOW, receive
from batchmaker.manager.loop.connections import ClientConnections
from batchmaker.manager.loop.error_frames import ErrorFrames

log = logging.getLogger("batchmaker.manager")

MAX_ID_CHARS = 256  # a longer string id is refused: every reply and log line echoes it
BACKLOG_MARGIN = 10_000  # replies to refused requests a non-reading client may have waiting, beyond its admitted ones
READ_S = 0.002  # a burst of client messages lasts this long at most: workers hold several tasks, more than this


@dataclass
class Incoming:
    """One message from a client: its map, or why it is not one (then `message` is None)."""

    client: bytes
    request_id: Any  # as the client sent it, to echo back: an int, a str, or None when unusable
    message: dict[str, Any] | None
    error: RequestError | None
    arrival: float

    @property
    def control_op(self) -> str | None:
        """The op of a control call (CONTROL_OPS), which stats counts apart from inference requests; else None."""
        op = self.message.get("op") if self.message is not None else None
        return op if isinstance(op, str) and op in CONTROL_OPS else None


def echo_id(value: Any) -> Any:
    """A request id fit to echo back: an int or a str of at most MAX_ID_CHARS, else None."""
    if (isinstance(value, str) and len(value) <= MAX_ID_CHARS) or (
        isinstance(value, int) and not isinstance(value, bool)
    ):
        return value
    return None


class ClientFrontend:
    def __init__(self, context: zmq.Context, address: str, server: ServerConfig):
        self.max_message_bytes = server.max_message_bytes
        self._unreachable_s = server.unreachable_client_ms / 1e3
        # Every reply answers a message the client sent: admitted requests are bounded, refusals are not,
        # so a client that sends without reading can hold this many replies before it counts as gone.
        self._max_backlog = server.max_queued_requests + BACKLOG_MARGIN
        self._max_backlog_bytes = server.max_backlog_bytes
        self._backlog: dict[bytes, collections.deque[bytes]] = {}
        self._backlog_bytes: dict[bytes, int] = {}
        self._stuck_since: dict[bytes, float] = {}  # when its backlog last moved
        self._unreachable: list[bytes] = []
        self._abandoned: set[bytes] = set()  # given up on: replies they cannot take are dropped, not queued
        self._held: list[tuple[bytes, bytes]] | None = None  # replies to send together, while held
        self._error_frames = ErrorFrames()
        self.unreachable_clients = 0  # clients given up on so far (stats)
        self._curve: CurveServer | None = None
        self.socket = context.socket(zmq.ROUTER)
        if server.curve is not None:
            self._curve = CurveServer(context, server.curve.secret_key, server.curve.allowed_clients)
            self._curve.apply(self.socket)
        elif not is_loopback(address):
            log.warning("serving %s without authentication: configure [server.curve]", address)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.bind(address)
        self.connections = ClientConnections(self.socket, server.max_clients)

    def receive(self) -> Iterator[Incoming]:
        """The messages waiting on the socket, their envelopes checked, until none is left or READ_S has
        passed (the event loop then takes completions and feeds workers, and comes back). Replies made
        while the messages are handled go out together when the burst ends."""
        until = time.perf_counter() + READ_S
        with self.replies_held():
            while time.perf_counter() < until:
                try:
                    frames = receive(self.socket, NOW)
                except zmq.Again:
                    return
                if self.connections.seen(frames[0].bytes, frames[-1]):
                    yield self._envelope(frames, time.perf_counter())

    def _envelope(self, frames: list[zmq.Frame], arrival: float) -> Incoming:
        client = frames[0].bytes
        message: Any = None
        try:
            if len(frames) != 2:
                raise RequestError(BAD_REQUEST, "a request is exactly one frame holding a msgpack map")
            message = decode(frames[-1].bytes, self.max_message_bytes)
            if not isinstance(message, dict):
                raise RequestError(BAD_REQUEST, "a request must be a msgpack map")
            if "id" not in message:
                raise RequestError(BAD_REQUEST, "request lacks 'id' (an int or a string)")
            if echo_id(message["id"]) is None:
                raise RequestError(BAD_REQUEST, f"'id' must be an int or a string of at most {MAX_ID_CHARS} characters")
            check_request_fields(message)
        except RequestError as exc:
            request_id = echo_id(message.get("id")) if isinstance(message, dict) else None
            return Incoming(client, request_id, None, exc, arrival)
        return Incoming(client, message["id"], message, None, arrival)

    @contextlib.contextmanager
    def replies_held(self) -> Iterator[None]:
        """Replies made within are sent together when it ends (within another, when that one ends)."""
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            for client, body in held:
                self._deliver(client, body)

    def reply(self, client: bytes, message: dict[str, Any]) -> None:
        self._reply(client, encode(message))

    def refuse(self, client: bytes, request_id: Any, error: RequestError, retry_after_ms: int | None = None) -> None:
        """Answer a request with an error (packed from a template: most replies under a flood are refusals)."""
        self._reply(client, self._error_frames.frame(request_id, error, retry_after_ms))

    def _reply(self, client: bytes, body: bytes) -> None:
        if self._held is not None:
            self._held.append((client, body))
        else:
            self._deliver(client, body)

    def _deliver(self, client: bytes, body: bytes) -> None:
        backlog = self._backlog.get(client)
        if backlog is not None:  # behind earlier replies: keep the order
            backlog.append(body)
            self._backlog_bytes[client] += len(body)
            if len(backlog) > self._max_backlog or self._backlog_bytes[client] > self._max_backlog_bytes:
                self._give_up(client, f"{len(backlog)} replies of {self._backlog_bytes[client]} bytes unread")
        elif not self._send(client, body) and client not in self._abandoned:
            self._backlog[client] = collections.deque([body])
            self._backlog_bytes[client] = len(body)
            self._stuck_since[client] = time.monotonic()

    def _send(self, client: bytes, body: bytes) -> bool:
        """Send one reply; False when the client's queue is full (it is not reading)."""
        try:
            self.socket.send(client, MORE | NOW)  # ROUTER_MANDATORY: a full or gone peer fails here, on its address
            self.socket.send(body, NOW)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # The client has gone: nobody can read this reply; the monitor reports its departure.
        self._abandoned.discard(client)  # it reads again
        return True

    @property
    def backlogged(self) -> bool:
        """Replies wait for slow clients: the event loop should come back soon to flush them."""
        return bool(self._backlog)

    def has_backlog(self, client: bytes) -> bool:
        """Whether replies wait for this client to read (its streamed requests' partials are held meanwhile)."""
        return client in self._backlog

    @property
    def departures_known(self) -> bool:
        """Some clients are already known to be gone (taken for gone by `flush`, or their closed
        connection read off the monitor early): `departed` tells which."""
        return bool(self._unreachable) or self.connections.departures_known

    def flush(self) -> None:
        """Send what slow clients can take now; give up on those that have not read for too long."""
        now = time.monotonic()
        for client, backlog in list(self._backlog.items()):
            sent = 0
            while backlog and self._send(client, backlog[0]):
                self._backlog_bytes[client] -= len(backlog.popleft())
                sent += 1
            if not backlog:
                self._forget_backlog(client)
            elif sent:
                self._stuck_since[client] = now
            elif now - self._stuck_since[client] > self._unreachable_s:
                self._give_up(client, f"nothing read for {now - self._stuck_since[client]:.0f} s")

    def _forget_backlog(self, client: bytes) -> int:
        """Drop a client's backlog; return how many replies it held."""
        del self._stuck_since[client], self._backlog_bytes[client]
        return len(self._backlog.pop(client))

    def _give_up(self, client: bytes, why: str) -> None:
        dropped = self._forget_backlog(client)
        log.warning(
            "client %s is unreachable (%s): %d replies dropped, its requests cancelled", client.hex(), why, dropped
        )
        self._unreachable.append(client)
        self._abandoned.add(client)
        self.unreachable_clients += 1

    def departed(self) -> list[bytes]:
        """Clients whose connection has closed, or that stopped reading, since the last call."""
        closed = self.connections.closed()
        for client in closed:
            if client in self._backlog:
                self._forget_backlog(client)
            self._abandoned.discard(client)
        gone, self._unreachable = closed + self._unreachable, []
        return gone

    def close(self) -> None:
        self.connections.close()
        self.socket.close()
        if self._curve is not None:
            self._curve.stop()
