"""Which client identities a closed connection ends, so their requests can be cancelled.

libzmq's ROUTER does not say when a peer goes away (ZMQ_ROUTER_NOTIFY is a draft API).
The frontend's monitor socket does report disconnections, by file descriptor, and each
received message carries the descriptor it came in on (ZMQ_SRCFD), so mapping identities
to descriptors closes the loop. A DEALER gets a fresh identity on every connection.
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

    def seen(self, client: bytes, frame: zmq.Frame) -> None:
        """Note the connection a message came in on (cheap after the first message of a client)."""
        if client in self._fd:
            return
        fd = frame.get(zmq.SRCFD)
        self._fd[client] = fd
        self._clients.setdefault(fd, set()).add(client)

    def closed(self) -> list[bytes]:
        """Drain the monitor; return the identities whose connection has closed."""
        gone: list[bytes] = []
        while True:
            try:
                event: dict[str, Any] = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return gone
            for client in self._clients.pop(event["value"], ()):
                del self._fd[client]
                gone.append(client)

    def close(self) -> None:
        self.monitor.close()
