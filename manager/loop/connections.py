"""Which client identities a closed connection ends, so their requests can be cancelled.

libzmq's ROUTER does not say when a peer goes away (ZMQ_ROUTER_NOTIFY is a draft API).
The frontend's monitor socket does report disconnections, by file descriptor, and each
received message carries the descriptor it came in on (ZMQ_SRCFD), so mapping identities
to descriptors closes the loop. A DEALER gets a fresh identity on every connection.

Descriptors are reused: a connection that closes frees its descriptor for the next one, and
the old connection's disconnection may still be unread on the monitor when the new client's
first message arrives. libzmq queues that event before it closes the descriptor, so reading
the monitor before noting a new client ends the old connection's clients first.

The same monitor caps live connections at `max_clients`: it reports each accepted connection with
its descriptor before any of the connection's messages can be read, and one over the cap is shut
down at the OS level (on a duplicate descriptor, leaving libzmq's own for libzmq to close when it
sees the end of the stream). A message it managed to send before that is dropped unread, even when
read after the monitor has reported the connection's end.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("batchmaker.manager")

REFUSAL_LOG_INTERVAL_S = 10.0  # refused connections are logged at most once per interval, counted in between


class ClientConnections:
    def __init__(self, frontend: zmq.Socket, max_clients: int):
        self.monitor = frontend.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self.max_clients = max_clients
        self._live: set[int] = set()  # descriptors of accepted connections within the cap
        # Descriptors whose last connection was shut down for the cap, until one is accepted again: a
        # refused connection's messages can still be read after the monitor has reported its end.
        self._refused_fds: set[int] = set()
        self.refused = 0  # connections refused so far (stats)
        self._refused_unlogged = 0
        self._next_refusal_log = 0.0
        self._fd: dict[bytes, int] = {}
        self._clients: dict[int, set[bytes]] = {}
        self._gone: list[bytes] = []  # read off the monitor, not yet returned by `closed`

    def seen(self, client: bytes, frame: zmq.Frame) -> bool:
        """Note the connection a message came in on (cheap after the first message of a client).

        False when that connection was refused for the cap: the message must be dropped unread."""
        if client in self._fd:
            return True
        self._read_monitor()  # a closed connection that held this descriptor ends before the new one starts
        fd = frame.get(zmq.SRCFD)
        if fd in self._refused_fds:
            return False
        self._fd[client] = fd
        self._clients.setdefault(fd, set()).add(client)
        return True

    @property
    def live(self) -> int:
        """Accepted connections within the cap that have not ended."""
        return len(self._live)

    @property
    def departures_known(self) -> bool:
        """Closed connections were read off the monitor while noting a new client: `closed` returns them."""
        return bool(self._gone)

    def closed(self) -> list[bytes]:
        """Drain the monitor; return the identities whose connection has closed since the last call."""
        self._read_monitor()
        gone, self._gone = self._gone, []
        return gone

    def _read_monitor(self) -> None:
        while True:
            try:
                event: dict[str, Any] = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = event["value"]
            # An accepted descriptor was free, so whatever held it before has ended, reported or not.
            for client in self._clients.pop(fd, ()):
                del self._fd[client]
                self._gone.append(client)
            self._live.discard(fd)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._refused_fds.discard(fd)
                self._accepted(fd)

    def _accepted(self, fd: int) -> None:
        if len(self._live) < self.max_clients:
            self._live.add(fd)
            return
        self._refused_fds.add(fd)
        self.refused += 1
        with socket.socket(fileno=os.dup(fd)) as connection:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the peer has already gone
        self._log_refusal()

    def _log_refusal(self) -> None:
        """One line per REFUSAL_LOG_INTERVAL_S at most, however fast connections are refused."""
        self._refused_unlogged += 1
        now = time.monotonic()
        if now < self._next_refusal_log:
            return
        log.warning(
            "refused %d client connection(s) beyond max_clients = %d (%d refused since start)",
            self._refused_unlogged, self.max_clients, self.refused,
        )
        self._refused_unlogged = 0
        self._next_refusal_log = now + REFUSAL_LOG_INTERVAL_S

    def close(self) -> None:
        self.monitor.close()
