"""Which clients a closed connection ends: real ROUTER and DEALER sockets over TCP on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import zmq

from batchmaker.manager.loop.connections import ClientConnections

WAIT_MS = 10_000


def _receive(router: zmq.Socket, connections: ClientConnections) -> tuple[bytes, int]:
    """One message on the router, noted as the frontend notes it: the client and its connection's descriptor."""
    assert router.poll(WAIT_MS), "no message reached the router"
    frames = router.recv_multipart(copy=False)
    connections.seen(frames[0].bytes, frames[-1])
    return frames[0].bytes, frames[-1].get(zmq.SRCFD)


def _connected(context: zmq.Context, address: str) -> zmq.Socket:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    dealer.send(b"hello")
    return dealer


# A DEALER that connects and says hello when told to on its stdin, and closes when its stdin ends.
REMOTE_CLIENT = """
import sys, zmq
context = zmq.Context()
dealer = context.socket(zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 0)
sys.stdin.readline()
dealer.connect(sys.argv[1])
dealer.send(b"hello")
sys.stdin.read()
dealer.close()
context.term()
"""


class _RemoteClient:
    """A client in a process of its own, started before it connects: it opens no descriptor in this
    process once connected, so the router's next accepted connection takes the lowest free descriptor."""

    def __init__(self, address: str):
        self._process = subprocess.Popen(
            [sys.executable, "-c", REMOTE_CLIENT, address], stdin=subprocess.PIPE, text=True
        )

    def connect(self) -> None:
        self._process.stdin.write("go\n")
        self._process.stdin.flush()

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=WAIT_MS / 1e3)


def _wait_until_closed(fd: int) -> None:
    """The monitor reports a disconnection before libzmq closes the descriptor: wait for the close itself."""
    for _ in range(WAIT_MS // 10):
        if not os.path.exists(f"/proc/self/fd/{fd}"):
            return
        time.sleep(0.01)
    raise AssertionError(f"the router never closed descriptor {fd}")


@pytest.fixture
def served() -> Iterator[tuple[zmq.Context, zmq.Socket, ClientConnections, str]]:
    """A context, a ROUTER bound on loopback with its connections watched, and the address to connect to."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    connections = ClientConnections(router, max_clients=8)
    try:
        yield context, router, connections, f"tcp://127.0.0.1:{port}"
    finally:
        connections.close()
        context.destroy(linger=0)


def test_a_closed_connection_ends_its_client_only(served):
    context, router, connections, address = served
    staying = _connected(context, address)
    kept, _ = _receive(router, connections)
    leaving = _connected(context, address)
    gone, _ = _receive(router, connections)
    leaving.close()
    assert connections.monitor.poll(WAIT_MS), "the monitor never reported the disconnection"
    assert connections.closed() == [gone]
    assert connections.closed() == []
    staying.close()
    assert connections.monitor.poll(WAIT_MS)
    assert connections.closed() == [kept]


def test_a_new_client_on_a_reused_descriptor_is_not_taken_for_the_old_one(served):
    """The old connection's disconnection is still unread when a new client's first message arrives
    on the same descriptor: only the old client has gone."""
    _, router, connections, address = served
    first, second = _RemoteClient(address), _RemoteClient(address)  # both started before any descriptor is freed
    try:
        first.connect()
        old, old_fd = _receive(router, connections)
        first.close()
        # Wait until the server has closed the old descriptor (its event is queued), without reading the event.
        assert connections.monitor.poll(WAIT_MS), "the monitor never reported the disconnection"
        _wait_until_closed(old_fd)
        second.connect()
        new, new_fd = _receive(router, connections)
        assert new_fd == old_fd, "the kernel did not reuse the descriptor; this test needs it to"
        assert connections.closed() == [old]
    finally:
        first.close()
        second.close()
    assert connections.monitor.poll(WAIT_MS)
    assert connections.closed() == [new]
