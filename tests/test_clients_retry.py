"""The failover rule of clients with several servers: a retryable error (OVERLOADED, UNAVAILABLE, WORKER_LOST) is
resent to another server, each server gets a request once, then the caller gets the last error;
other errors, and every error with one address, reach the caller as they are. Here the resends of
OVERLOADED after a backoff are off (`max_retries=0`) where they would change that; test_clients_backoff.py
covers them."""

from __future__ import annotations

import asyncio

import pytest
from test_clients_failover import FAST, REFUSALS, FakeServer, answered_by, infer_many, servers, start

from batchmaker.clients import AsyncClient, Client, ServerError
from batchmaker.clients.servers import DRAINING, UP, ServerSet
from batchmaker.common.protocol import INVALID_INPUT, OVERLOADED, SESSION_LOST, UNAVAILABLE, error_reply

__all__ = ["servers"]  # the fixture, shared with the failover tests


def refusal(code: str) -> dict:
    mode = {UNAVAILABLE: "unavailable", OVERLOADED: "overloaded", INVALID_INPUT: "invalid"}[code]
    return error_reply(1, *REFUSALS[mode])


def test_retry_target_takes_each_server_once_then_gives_up() -> None:
    server_set = ServerSet(["tcp://a:1", "tcp://b:1", "tcp://c:1"])
    a, b, c = server_set.servers
    refused: set = set()
    first = server_set.retry_target(a, refusal(OVERLOADED), refused)
    assert first in (b, c) and a.state == UP  # a busy server still takes other requests
    second = server_set.retry_target(first, refusal(UNAVAILABLE), refused)
    assert second not in (a, first) and first.state == DRAINING  # a stopping server gets nothing new
    assert server_set.retry_target(second, refusal(OVERLOADED), refused) is None
    assert refused == {a, b, c}


def test_retry_target_leaves_other_errors_and_a_single_server_alone() -> None:
    several = ServerSet(["tcp://a:1", "tcp://b:1"])
    refused: set = set()
    assert several.retry_target(several.servers[0], refusal(INVALID_INPUT), refused) is None
    assert several.retry_target(several.servers[0], {"id": 1, "ok": True}, refused) is None
    assert not refused and several.servers[0].state == UP
    single = ServerSet(["tcp://a:1"])
    assert single.retry_target(single.servers[0], refusal(UNAVAILABLE), set()) is None


@pytest.mark.parametrize("mode", ["unavailable", "overloaded", "worker_lost"])
def test_async_resends_retryable_errors_to_another_server(servers: list[FakeServer], mode: str) -> None:
    refusing, answering = start(servers, mode, "answer")

    async def run() -> tuple[list, int]:
        async with AsyncClient([s.address for s in servers], timeout=10, **FAST) as client:
            return await infer_many(client, range(20)), client.resent

    results, resent = asyncio.run(run())
    assert set(answered_by(results, range(20))) == {"s1"}
    assert resent == len(refusing.infer_ids) > 0
    assert len(answering.infer_ids) == 20


def test_async_gives_the_last_error_once_every_server_refused(servers: list[FakeServer]) -> None:
    """With retries after a backoff off, each server is tried once (with them on, see test_clients_backoff.py)."""
    start(servers, "overloaded", "unavailable", "overloaded")

    async def run() -> list:
        async with AsyncClient([s.address for s in servers], timeout=10, max_retries=0, **FAST) as client:
            return await infer_many(client, range(5))

    results = asyncio.run(run())
    for result in results:
        assert isinstance(result, ServerError) and result.code in (OVERLOADED, UNAVAILABLE)
    for server in servers:
        assert len(server.infer_ids) == len(set(server.infer_ids))  # never sent twice to one server
    assert len(servers[0].infer_ids) == len(servers[2].infer_ids) == 5  # busy servers stay up: each tried once


def test_async_does_not_resend_other_errors(servers: list[FakeServer]) -> None:
    invalid, answering = start(servers, "invalid", "answer")

    async def run() -> list:
        async with AsyncClient([s.address for s in servers], timeout=10, **FAST) as client:
            return await infer_many(client, range(10))

    results = asyncio.run(run())
    codes = [r.code if isinstance(r, ServerError) else "ok" for r in results]
    assert codes.count(INVALID_INPUT) == len(invalid.infer_ids) > 0
    assert codes.count("ok") == len(answering.infer_ids)


def test_sync_resends_retryable_errors_and_then_fails_with_the_last(servers: list[FakeServer]) -> None:
    start(servers, "unavailable", "overloaded", "answer")
    with Client([s.address for s in servers], timeout=10, **FAST) as client:
        assert {client.infer("m", {"n": n}).outputs["server"] for n in range(6)} == {"s2"}
    servers[2].mode = "overloaded"
    several = [s.address for s in servers]
    with Client(several, timeout=10, max_retries=0, **FAST) as client, pytest.raises(ServerError) as caught:
        client.infer("m", {"n": 99})
    assert caught.value.code in (OVERLOADED, UNAVAILABLE)  # the last server's refusal
    for server in servers:
        assert [m["inputs"]["n"] for m in server.messages if m.get("op", "infer") == "infer"].count(99) == 1


@pytest.mark.parametrize("mode", ["unavailable", "overloaded"])
def test_one_address_raises_the_code_without_resending(servers: list[FakeServer], mode: str) -> None:
    """UNAVAILABLE always, and OVERLOADED with retries after a backoff off (`max_retries=0`)."""
    (server,) = start(servers, mode)
    code = REFUSALS[mode][0]
    with Client(server.address, timeout=10, max_retries=0) as client, pytest.raises(ServerError, match=code) as caught:
        client.infer("m", {"n": 1})
    assert caught.value.code == code and server.infer_ids == [caught.value.request_id]

    async def run() -> BaseException:
        async with AsyncClient(server.address, timeout=10, max_retries=0) as client:
            return (await infer_many(client, range(1)))[0]

    assert isinstance(error := asyncio.run(run()), ServerError) and error.code == code
    assert len(server.infer_ids) == 2


def test_session_lost_is_never_sent_to_another_server(servers: list[FakeServer]) -> None:
    """Another server cannot hold the session's state either: SESSION_LOST reaches the caller at once."""
    lost, answering = start(servers, "session_lost", "answer")
    with Client([s.address for s in servers], timeout=10, **FAST) as client:
        codes = []
        for n in range(8):
            try:
                client.infer("m", {"n": n}, session=f"s{n}")
                codes.append("ok")
            except ServerError as error:
                codes.append(error.code)

    async def run() -> list:
        async with AsyncClient([s.address for s in servers], timeout=10, **FAST) as client:
            calls = (client.infer("m", {"n": n}, session=f"s{n}") for n in range(8, 16))
            return await asyncio.gather(*calls, return_exceptions=True)

    codes += [r.code if isinstance(r, ServerError) else "ok" for r in asyncio.run(run())]
    assert codes.count(SESSION_LOST) == len(lost.infer_ids) > 0
    assert codes.count("ok") == len(answering.infer_ids) > 0
    sent = [m for server in servers for m in server.messages if m.get("op", "infer") == "infer"]
    assert sorted(m["inputs"]["n"] for m in sent) == list(range(16))  # each sent once
    assert all(m["session"] == f"s{m['inputs']['n']}" for m in sent)


def test_a_sessions_requests_all_go_to_the_server_of_its_first(servers: list[FakeServer]) -> None:
    """A session lives on one server: pipelined requests of a session are not spread over the servers."""
    start(servers, "answer", "answer")
    names = [f"s{i}" for i in range(4)]

    async def run() -> None:
        async with AsyncClient([s.address for s in servers], timeout=10, **FAST) as client:
            await asyncio.gather(*(client.infer("m", {"n": n}, session=names[n % 4]) for n in range(24)))

    asyncio.run(run())
    with Client([s.address for s in servers], timeout=10, **FAST) as client:
        for n in range(24, 32):
            client.infer("m", {"n": n}, session=names[n % 4])
    sent = [(server.name, m) for server in servers for m in server.messages if m.get("op", "infer") == "infer"]
    for name in names:
        assert len({server for server, m in sent if m["session"] == name}) == 1, name
    assert len({server for server, _ in sent}) == 2  # different sessions still spread
