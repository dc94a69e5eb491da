"""AsyncClient over several servers, against tests/test_clients_failover.py's fake ROUTER servers: it
spreads requests by fewest outstanding, resends those of a server that closes, sets aside a silent
one and takes it back, sends nothing new to a draining one, waits for a server to come back, and
sends a cancel to the server holding its target."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import free_port, wait_until
from test_clients_failover import FAST, FakeServer, answered_by, infer_many, servers, start

from batchmaker.clients import AsyncClient, ServerError, ServerLost
from batchmaker.common.protocol import OVERLOADED

__all__ = ["servers"]  # the fixture, shared with tests/test_clients_failover.py


# -- AsyncClient -------------------------------------------------------------------------------


def test_async_spreads_by_fewest_outstanding(servers: list[FakeServer]) -> None:
    a, b, c = start(servers, "hold", "hold", "hold")

    async def run() -> list[Any]:
        async with AsyncClient([a.address, b.address, c.address], timeout=20, **FAST) as client:
            calls = asyncio.gather(infer_many(client, range(30)))
            received = lambda: len(a.infer_ids) + len(b.infer_ids) + len(c.infer_ids)
            await asyncio.to_thread(wait_until, lambda: received() == 30, "all 30 requests", 20.0)
            assert (len(a.infer_ids), len(b.infer_ids), len(c.infer_ids)) == (10, 10, 10)
            for server in (a, b, c):
                server.release()
            return (await calls)[0]

    assert sorted(set(answered_by(asyncio.run(run()), range(30)))) == ["s0", "s1", "s2"]


def test_async_resends_the_requests_of_a_closed_server(servers: list[FakeServer]) -> None:
    a, b, c = start(servers, "hold", "hold", "hold")

    async def run() -> list[Any]:
        async with AsyncClient([a.address, b.address, c.address], timeout=20, **FAST) as client:
            calls = asyncio.gather(infer_many(client, range(30)))
            await asyncio.to_thread(wait_until, lambda: len(a.infer_ids) == 10, "a's share", 20.0)
            a.close()
            await asyncio.to_thread(wait_until, lambda: len(b.infer_ids) + len(c.infer_ids) == 30, "the resends", 20.0)
            b.release()
            c.release()
            results = (await calls)[0]
            assert client.resent == 10
            return results

    who = answered_by(asyncio.run(run()), range(30))
    assert "s0" not in who
    assert set(a.infer_ids) <= set(b.infer_ids) | set(c.infer_ids)


def test_async_sets_aside_a_silent_server_drops_its_late_replies_and_takes_it_back(servers: list[FakeServer]) -> None:
    a, b = start(servers, "silent", "hold")

    async def run() -> tuple[list[Any], list[Any]]:
        async with AsyncClient([a.address, b.address], timeout=20, **FAST) as client:
            calls = asyncio.gather(infer_many(client, range(10)))
            await asyncio.to_thread(wait_until, lambda: len(b.infer_ids) == 10, "a's requests resent to b", 20.0)
            b.release()
            first = (await calls)[0]
            assert client.resent == 5
            a.mode = "answer"  # a reads its backlog: the late replies must not be delivered again
            await asyncio.to_thread(wait_until, lambda: len(a.infer_ids) == 5, "a reading its backlog", 20.0)
            later: list[Any] = []
            while "s0" not in [r.outputs["server"] for r in later]:
                later.append(await client.infer("m", {"n": 100 + len(later)}))
                await asyncio.sleep(0.02)
            return first, later

    first, later = asyncio.run(run())
    assert answered_by(first, range(10)) == ["s1"] * 10
    answered_by(later, range(100, 100 + len(later)))


def test_async_sends_nothing_new_to_a_draining_server(servers: list[FakeServer]) -> None:
    a, b = start(servers, "draining", "answer")

    async def run() -> tuple[list[Any], int, list[Any]]:
        async with AsyncClient([a.address, b.address], timeout=20, **FAST) as client:
            first = [await client.infer("m", {"n": n}) for n in range(10)]
            refused = len(a.infer_ids)
            assert client.resent == refused
            second = [await client.infer("m", {"n": n}) for n in range(10, 20)]
            assert len(a.infer_ids) == refused  # nothing new reached the draining server
            a.mode = "answer"
            third: list[Any] = []
            while "s0" not in [r.outputs["server"] for r in third]:
                third.append(await client.infer("m", {"n": 20 + len(third)}))
                await asyncio.sleep(0.02)
            return first + second, refused, third

    answers, refused, third = asyncio.run(run())
    assert answered_by(answers, range(20)) == ["s1"] * 20
    assert refused == 1
    answered_by(third, range(20, 20 + len(third)))


def test_async_resends_what_a_draining_server_accepted_when_it_dies(servers: list[FakeServer]) -> None:
    a, b = start(servers, "hold", "answer")

    async def run() -> list[Any]:
        async with AsyncClient([a.address, b.address], timeout=20, **FAST) as client:
            accepted = asyncio.gather(infer_many(client, range(0, 20, 2)))  # b answers its share at once
            await asyncio.to_thread(wait_until, lambda: len(a.infer_ids) == 5, "a's share", 20.0)
            a.mode = "draining"  # quiet while it owes answers: a probe finds it draining
            probed = lambda: any(m.get("op") == "health" for m in a.messages)
            await asyncio.to_thread(wait_until, probed, "a probe", 20.0)
            later = [await client.infer("m", {"n": n}) for n in range(100, 104)]
            assert all(r.outputs["server"] == "s1" for r in later)
            a.close()  # dies before answering what it accepted
            results = (await accepted)[0]
            assert client.resent == 5
            return results

    assert answered_by(asyncio.run(run()), range(0, 20, 2)) == ["s1"] * 10


def test_async_draining_refusal_reaches_the_caller_when_no_other_server_is_up(servers: list[FakeServer]) -> None:
    a, b = start(servers, "draining", "draining")

    async def run() -> None:
        async with AsyncClient([a.address, b.address], timeout=20, **FAST) as client:
            with pytest.raises(ServerError) as caught:
                for n in range(2):
                    await client.infer("m", {"n": n})
            assert caught.value.code == OVERLOADED and "draining" in caught.value.message

    asyncio.run(run())


def test_async_without_resend_fails_a_lost_servers_requests(servers: list[FakeServer]) -> None:
    a, b = start(servers, "hold", "hold")

    async def run() -> list[Any]:
        async with AsyncClient([a.address, b.address], timeout=20, resend=False, **FAST) as client:
            calls = asyncio.gather(infer_many(client, range(4)))
            spread = lambda: len(a.infer_ids) == 2 and len(b.infer_ids) == 2
            await asyncio.to_thread(wait_until, spread, "the spread", 20.0)
            a.close()
            b.release()
            return (await calls)[0]

    results = asyncio.run(run())
    lost = [r for r in results if isinstance(r, ServerLost)]
    assert len(lost) == 2 and all(a.address in str(r) and "resending is off" in str(r) for r in lost)
    assert [r.outputs["server"] for r in results if not isinstance(r, BaseException)] == ["s1", "s1"]
    assert len(b.infer_ids) == 2  # nothing was resent


def test_async_waits_for_a_server_to_come_back(servers: list[FakeServer]) -> None:
    ports = [free_port(), free_port()]
    addresses = [f"tcp://127.0.0.1:{port}" for port in ports]

    async def run() -> Any:
        async with AsyncClient(addresses, timeout=1.0, **FAST) as client:
            with pytest.raises(TimeoutError, match="no server was up"):
                await client.infer("m", {"n": 1})
            client.timeout = 20
            call = asyncio.ensure_future(client.infer("m", {"n": 2}))
            await asyncio.sleep(0.5)  # both servers are set aside by now; the request waits
            servers.append(FakeServer("late", port=ports[1]))
            return await call

    assert asyncio.run(run()).outputs == {"server": "late", "echo": 2}


def test_async_cancel_goes_to_the_server_holding_the_target(servers: list[FakeServer]) -> None:
    a, b = start(servers, "hold", "hold")

    async def run() -> None:
        async with AsyncClient([a.address, b.address], timeout=20, **FAST) as client:
            target = asyncio.ensure_future(client.call({"id": "t", "op": "infer", "model": "m", "inputs": {"n": 1}}))
            await asyncio.to_thread(wait_until, lambda: "t" in a.infer_ids + b.infer_ids, "the target", 20.0)
            holder = a if "t" in a.infer_ids else b
            assert (await client.cancel("t"))["cancelled"] is True
            assert next(m for m in holder.messages if m.get("op") == "cancel")["target"] == "t"
            target.cancel()

    asyncio.run(run())
