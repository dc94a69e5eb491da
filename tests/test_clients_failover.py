"""Clients over several servers, against fake ROUTER servers that can hold, go silent, drain or close:
address lists, server states, the blocking Client and the command line. AsyncClient's failover is in
tests/test_clients_failover_async.py.

Servers listen on loopback TCP so that closing one closes the client's connection the
way a killed process does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from conftest import free_port

from batchmaker.clients import AsyncClient, Client, ServerLost
from batchmaker.clients.cli import main as cli_main
from batchmaker.clients.servers import ASIDE, DRAINING, UP, ServerSet
from batchmaker.common.protocol import (
    INVALID_INPUT,
    OVERLOADED,
    SESSION_LOST,
    UNAVAILABLE,
    WORKER_LOST,
    decode,
    encode,
    error_reply,
)

FAST = {"health_interval": 0.1, "health_timeout": 0.3}
DRAINING_MESSAGE = "the server is draining before it stops; send the request elsewhere"
REFUSALS = {
    "unavailable": (UNAVAILABLE, "the server stopped before finishing the request; send it elsewhere"),
    "overloaded": (OVERLOADED, "estimated wait 900 ms exceeds the server's limit of 500 ms"),
    "invalid": (INVALID_INPUT, "token 7 is outside the vocabulary"),
    "worker_lost": (WORKER_LOST, "its worker was lost (process exited with status -9) and none remains"),
    "session_lost": (SESSION_LOST, "session 's' is lost: this server holds no state for it"),
}


class FakeServer:
    """A ROUTER thread standing for one server.

    Modes: "answer" replies at once; "hold" keeps infer requests until `release`;
    "silent" reads nothing (a hung host); "draining" refuses infer requests as a
    stopping manager does and says so in health; "unavailable" answers them as a
    manager that stopped before finishing them, "overloaded" as one that refuses
    them at admission, "worker_lost" as one whose only worker died, and "invalid" as
    one that finds them wrong. `close` drops the connection.
    Each infer reply names the server that computed it.
    """

    def __init__(self, name: str, port: int | None = None, mode: str = "answer"):
        self.name = name
        self.port = port or free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.mode = mode
        self.messages: list[dict[str, Any]] = []
        self._held: list[tuple[bytes, dict[str, Any]]] = []
        self._release = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    @property
    def infer_ids(self) -> list[Any]:
        return [m["id"] for m in list(self.messages) if m.get("op", "infer") == "infer"]

    def release(self) -> None:
        """Answer the held requests, and answer from now on."""
        self._release.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.address)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if self._release.is_set():
                    self._release.clear()
                    self.mode = "answer"
                    for peer, message in self._held:
                        socket.send_multipart([peer, encode(self._answer(message))])
                    self._held.clear()
                if self.mode == "silent" or not socket.poll(10):
                    time.sleep(0.005)
                    continue
                peer, frame = socket.recv_multipart()
                message = decode(frame)
                self.messages.append(message)
                if self.mode == "hold" and message.get("op", "infer") == "infer":
                    self._held.append((peer, message))
                else:
                    for reply in self._replies(message):
                        socket.send_multipart([peer, encode(reply)])
        finally:
            socket.close()
            context.term()

    def _replies(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """What it sends back for a message it answers at once: one reply (a subclass may stream several)."""
        return [self._answer(message)]

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        request_id = message["id"]
        op = message.get("op", "infer")
        if op == "health":
            stopping = self.mode in ("draining", "unavailable")
            return {"id": request_id, "ok": True, "status": "draining" if stopping else "ready"}
        if op == "cancel":
            return {"id": request_id, "ok": True, "cancelled": True}
        if self.mode == "draining":
            return error_reply(request_id, OVERLOADED, DRAINING_MESSAGE)
        if self.mode in REFUSALS:
            return error_reply(request_id, *REFUSALS[self.mode])
        return {"id": request_id, "ok": True, "outputs": {"server": self.name, "echo": message["inputs"]["n"]}}


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    started: list[FakeServer] = []
    yield started
    for server in started:
        server.close()


def start(servers: list[FakeServer], *modes: str) -> list[FakeServer]:
    for mode in modes:
        servers.append(FakeServer(f"s{len(servers)}", mode=mode))
    return servers


async def infer_many(client: AsyncClient, numbers: range) -> list[Any]:
    return await asyncio.gather(*(client.infer("m", {"n": n}) for n in numbers), return_exceptions=True)


def answered_by(results: list[Any], numbers: range) -> list[str]:
    """Check every result is the right answer; return who computed each."""
    assert len(results) == len(numbers)
    for n, result in zip(numbers, results):
        assert not isinstance(result, BaseException), result
        assert result.outputs["echo"] == n
    return [result.outputs["server"] for result in results]


# -- addresses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address, message",
    [
        ([], "at least one"),
        (["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"], "twice"),
        (["tcp://127.0.0.1:1", ""], "non-empty"),
    ],
)
def test_bad_address_lists_are_refused(address: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Client(address)
    with pytest.raises(ValueError, match=message):
        AsyncClient(address)


def test_bad_health_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        Client(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], health_timeout=0)


def test_server_states_follow_probes() -> None:
    """A draining server that falls silent is set aside; probed later, it rejoins on a non-draining answer."""
    servers = ServerSet(["tcp://a:1", "tcp://b:1"], health_interval=1.0, health_timeout=2.0)
    a, b = servers.servers
    servers.sent(a, 7, now=100.0)
    servers.draining(a)
    assert servers.pick() is b
    (probed, first_probe), = servers.tick(100.0)[0]
    assert probed is a and servers.tick(101.0) == ([], [])  # its probe is still awaited
    assert servers.tick(102.5) == ([], [a])
    assert servers.set_aside(a) == {7} and a.state == ASIDE and not a.outstanding
    (_, probe), = servers.tick(103.5)[0]
    assert servers.probe_answered(a, {"id": first_probe, "ok": True, "status": "ready"}) is False  # an old probe
    assert servers.probe_answered(a, {"id": probe, "ok": True, "status": "draining"}) is False
    assert a.state == ASIDE
    (_, probe), = servers.tick(104.5)[0]
    assert servers.probe_answered(a, {"id": probe, "ok": True, "status": "ready"}) is True and a.state == UP
    servers.sent(b, 8, now=105.0)
    assert servers.pick() is a  # fewest outstanding
    (_, probe), = servers.tick(106.0)[0]  # b owes an answer and has been quiet for the interval
    assert servers.probe_answered(b, {"id": probe, "ok": True, "status": "draining"}) is False
    assert b.state == DRAINING


# -- Client ------------------------------------------------------------------------------------


def test_sync_takes_servers_in_turn_and_resends_when_one_closes(servers: list[FakeServer]) -> None:
    a, b = start(servers, "answer", "answer")
    with Client([a.address, b.address], timeout=20, **FAST) as client:
        assert sorted(client.infer("m", {"n": n}).outputs["server"] for n in range(4)) == ["s0", "s0", "s1", "s1"]
        a.close()
        outputs = [client.infer("m", {"n": n}).outputs for n in range(4)]
        assert outputs == [{"server": "s1", "echo": n} for n in range(4)]
        assert client.resent <= 1  # only a request already sent to the closed server goes again


def test_sync_sets_aside_a_silent_server(servers: list[FakeServer]) -> None:
    a, b = start(servers, "silent", "answer")
    with Client([a.address, b.address], timeout=20, **FAST) as client:
        assert [client.infer("m", {"n": n}).outputs["server"] for n in range(4)] == ["s1"] * 4


def test_sync_draining_server_gets_the_request_sent_elsewhere(servers: list[FakeServer]) -> None:
    a, b = start(servers, "draining", "answer")
    with Client([a.address, b.address], timeout=20, **FAST) as client:
        assert [client.infer("m", {"n": n}).outputs["server"] for n in range(4)] == ["s1"] * 4
    assert len(a.infer_ids) == 1


def test_sync_without_resend_raises_server_lost(servers: list[FakeServer]) -> None:
    a, b = start(servers, "silent", "silent")
    with (
        Client([a.address, b.address], timeout=20, resend=False, **FAST) as client,
        pytest.raises(ServerLost, match="no answer to health"),
    ):
        client.infer("m", {"n": 1})


def test_sync_cancel_goes_to_the_server_of_the_timed_out_request(servers: list[FakeServer]) -> None:
    a, b = start(servers, "hold", "hold")
    with Client([a.address, b.address], timeout=0.5, **FAST) as client:
        with pytest.raises(TimeoutError):
            client.call({"id": "slow", "op": "infer", "model": "m", "inputs": {"n": 1}})
        holder = a if "slow" in a.infer_ids else b
        assert client.cancel("slow")["cancelled"] is True
        assert [m["target"] for m in holder.messages if m.get("op") == "cancel"] == ["slow"]


def test_cli_takes_several_addresses(servers: list[FakeServer], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = start(servers, "draining", "answer")
    argv = ["infer", "--address", a.address, "--address", b.address, "--model", "m", "--inputs", '{"n": 4}']
    for _ in range(2):
        assert cli_main(argv) == 0
        assert 'server: "s1"' in capsys.readouterr().out


def test_cli_refuses_an_address_given_twice(capsys: pytest.CaptureFixture[str]) -> None:
    address = "tcp://127.0.0.1:1"
    assert cli_main(["health", "--address", address, "--address", address]) == 1
    assert capsys.readouterr().err.startswith("error USAGE: ")
