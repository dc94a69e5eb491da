"""Which client identities a closed connection ends, so their requests can be cancelled.

libzmq's ROUTER does not say when a peer goes away (ZMQ_ROUTER_NOTIFY is a draft API).
The frontend's monitor socket does report disconnections, by file descriptor, and each
received message carries the descriptor it came in on (ZMQ_SRCFD), so mapping identities
to descriptors closes the loop. A DEALER gets a fresh identity on every connection.

Descriptors are reused: a connection that closes frees its descriptor for the next one, and
the old connection's disconnection may still be unread on the monitor when the new client's
first message arrives. libzmq queues that event before it closes the descriptor, so reading
the monitor before noting a new client ends the old connection's clients first.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message


class ClientConnections:
    def __init__(self, frontend: zmq.Socket):
        self.monitor = frontend.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._fd: dict[bytes, int] = {}
        self._clients: dict[int, set[bytes]] = {}
        self._gone: list[bytes] = []  # read off the monitor, not yet returned by `closed`

    def seen(self, client: bytes, frame: zmq.Frame) -> None:
        """Note the connection a message came in on (cheap after the first message of a client)."""
        if client in self._fd:
            return
        self._read_monitor()  # a closed connection that held this descriptor ends before the new one starts
        fd = frame.get(zmq.SRCFD)
        self._fd[client] = fd
        self._clients.setdefault(fd, set()).add(client)

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
            for client in self._clients.pop(event["value"], ()):
                del self._fd[client]
                self._gone.append(client)

    def close(self) -> None:
        self.monitor.close()
