"""The client frontend's read bursts and held replies, on real sockets in this process."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from conftest import free_port

from batchmaker.common.protocol import OVERLOADED, RequestError
from batchmaker.common.server_config import ServerConfig
from batchmaker.manager.loop.frontend import READ_S, ClientFrontend, Incoming

NOTHING_MS = 200  # long enough for a sent reply to arrive on this machine, even a busy one


@pytest.fixture
def sockets() -> Iterator[tuple[ClientFrontend, zmq.Socket]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()  # its own, like a manager's: frontends closed in a shared one leave it unable to connect
    frontend = ClientFrontend(context, address, ServerConfig(address=address))
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(address)
    yield frontend, client
    client.close()
    frontend.close()
    context.term()


def send(client: zmq.Socket, first: int, count: int) -> None:
    for i in range(first, first + count):
        client.send(msgpack.packb({"id": i}))


def read_all(frontend: ClientFrontend, count: int) -> list[list[int]]:
    """Bursts until `count` messages are read: the ids each burst read."""
    bursts: list[list[int]] = []
    while sum(map(len, bursts)) < count:
        if frontend.socket.poll(10_000):
            bursts.append([incoming.request_id for incoming in frontend.receive()])
    return bursts


def test_replies_made_during_a_burst_go_out_together_when_it_ends(sockets):
    frontend, client = sockets
    send(client, 0, 20)
    answered = 0
    while answered < 20:
        assert frontend.socket.poll(10_000)
        for incoming in frontend.receive():
            frontend.reply(incoming.client, {"id": incoming.request_id, "ok": True})
            answered += 1
            if answered == 1:
                assert not client.poll(NOTHING_MS), "a reply left before its burst ended"
    replies = [msgpack.unpackb(client.recv())["id"] for _ in range(20) if client.poll(10_000)]
    assert replies == list(range(20))


def test_replies_held_nest_and_leave_with_the_outermost(sockets):
    frontend, client = sockets
    send(client, 0, 1)
    assert frontend.socket.poll(10_000)
    (incoming,) = list(frontend.receive())
    with frontend.replies_held():
        with frontend.replies_held():
            frontend.reply(incoming.client, {"id": 1})
        assert not client.poll(NOTHING_MS)
        frontend.reply(incoming.client, {"id": 2})
    assert [msgpack.unpackb(client.recv())["id"] for _ in range(2) if client.poll(10_000)] == [1, 2]


def test_refusals_and_replies_keep_their_order_and_a_refusal_reads_as_an_error_reply(sockets):
    frontend, client = sockets
    send(client, 0, 4)
    read: list[Incoming] = []
    while len(read) < 4:
        assert frontend.socket.poll(10_000)
        read += frontend.receive()
    for incoming in read:
        if incoming.request_id % 2:
            frontend.refuse(incoming.client, incoming.request_id, RequestError(OVERLOADED, "estimated wait 300 ms"))
        else:
            frontend.reply(incoming.client, {"id": incoming.request_id, "ok": True})
    replies = [msgpack.unpackb(client.recv()) for _ in range(4) if client.poll(10_000)]
    assert replies == [
        {"id": 0, "ok": True},
        {"id": 1, "ok": False, "error": {"code": OVERLOADED, "message": "estimated wait 300 ms"}},
        {"id": 2, "ok": True},
        {"id": 3, "ok": False, "error": {"code": OVERLOADED, "message": "estimated wait 300 ms"}},
    ]


def test_a_burst_ends_when_its_time_is_up_and_the_next_reads_the_rest(sockets):
    frontend, client = sockets
    send(client, 0, 3)
    assert frontend.socket.poll(10_000)
    first = []
    for incoming in frontend.receive():
        first.append(incoming.request_id)
        time.sleep(READ_S)  # handling takes the whole burst: the others wait for the next
    assert first == [0]
    rest = read_all(frontend, 2)
    assert [i for burst in rest for i in burst] == [1, 2]



def test_a_client_whose_unread_replies_pass_the_byte_bound_is_taken_for_gone():
    """A backlog bounded by count alone lets one client hold count x reply size: it is bounded by bytes too."""
    address = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    frontend = ClientFrontend(context, address, ServerConfig(address=address, max_backlog_bytes=1 << 20))
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.RCVHWM, 1)
    client.connect(address)
    try:
        send(client, 0, 1)
        assert frontend.socket.poll(10_000)
        (incoming,) = frontend.receive()
        reply = {"id": 0, "ok": True, "blob": b"x" * 10_000}
        sent = 0
        while not frontend.departures_known:
            frontend.reply(incoming.client, reply)
            sent += 1
            # the socket's queue takes its high-water mark of 1000; then 1 MB of backlog at most
            assert sent < 1000 + 110, f"{sent} unread replies and the client is not given up on"
        assert frontend.departed() == [incoming.client] and frontend.unreachable_clients == 1
        assert not frontend.backlogged
    finally:
        client.close()
        frontend.close()
        context.term()
