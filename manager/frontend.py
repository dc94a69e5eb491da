"""The client side of the manager: the ROUTER socket clients talk to, its authentication, the
envelope of each message (one frame, a msgpack map, an `id`), replies, and departed clients."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from common.auth import CurveServer
from common.config import ServerConfig
from common.protocol import BAD_REQUEST, RequestError, decode, encode
from manager.connections import ClientConnections

log = logging.getLogger("batchmaker.manager")

SOCKET_LIMIT_FACTOR = 4


@dataclass
class Incoming:
    """One message from a client: its map, or why it is not one (then `message` is None)."""

    client: bytes
    request_id: Any  # as the client sent it, to echo back: an int, a str, or None when unusable
    message: dict[str, Any] | None
    error: RequestError | None
    arrival: float


def echo_id(value: Any) -> Any:
    """A request id fit to echo back: an int or a str, else None."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    return None


class ClientFrontend:
    def __init__(self, context: zmq.Context, address: str, server: ServerConfig):
        self.max_message_bytes = server.max_message_bytes
        self._curve: CurveServer | None = None
        self.socket = context.socket(zmq.ROUTER)
        if server.curve is not None:
            self._curve = CurveServer(context, server.curve.secret_key, server.curve.allowed_clients)
            self._curve.apply(self.socket)
        elif not is_loopback(address):
            log.warning("serving %s without authentication: configure [server.curve]", address)
        # Frames over max_message_bytes get a BAD_REQUEST from the decoder; the socket itself drops the
        # connection only past a hard ceiling well above it, to bound what a peer can make us buffer.
        self.socket.setsockopt(zmq.MAXMSGSIZE, SOCKET_LIMIT_FACTOR * self.max_message_bytes)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.connections = ClientConnections(self.socket)

    def receive(self, limit: int) -> Iterator[Incoming]:
        """Up to `limit` messages waiting on the socket, their envelopes checked."""
        for _ in range(limit):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            arrival = time.perf_counter()
            client = frames[0].bytes
            self.connections.seen(client, frames[-1])
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
                    raise RequestError(BAD_REQUEST, "'id' must be an int or a string")
            except RequestError as exc:
                request_id = echo_id(message.get("id")) if isinstance(message, dict) else None
                yield Incoming(client, request_id, None, exc, arrival)
                continue
            yield Incoming(client, message["id"], message, None, arrival)

    def reply(self, client: bytes, message: dict[str, Any]) -> None:
        self.socket.send(client, zmq.SNDMORE)  # two sends cost less than send_multipart's frame list
        self.socket.send(encode(message))

    def departed(self) -> list[bytes]:
        """Clients whose connection has closed since the last call."""
        return self.connections.closed()

    def close(self) -> None:
        self.connections.close()
        self.socket.close()
        if self._curve is not None:
            self._curve.stop()


def is_loopback(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return not address.startswith("tcp://") or host in ("localhost", "::1") or host.startswith("127.")
