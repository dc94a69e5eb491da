"""Resending OVERLOADED after a backoff, and refusing a request too large to send, against fake servers.

The backoff's arithmetic is checked with a chosen jitter draw; the clients' use of it with servers
that refuse each request a set number of times, then answer it. Nothing is timed: the clients'
counts and what the servers received say what happened."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import pytest
from test_clients_failover import DRAINING_MESSAGE, FAST, FakeServer, answered_by, infer_many, servers

from batchmaker.clients import AsyncClient, Backoff, Client, RequestTooLarge, ServerError, ServerLost
from batchmaker.clients.messages import DEFAULT_TIMEOUT
from batchmaker.clients.retry import DEFAULT_MAX_RETRIES, is_refusal, retry_after_s
from batchmaker.common.protocol import INVALID_INPUT, OVERLOADED, error_reply

__all__ = ["servers"]  # the fixture, shared with the failover tests

NEARLY_ONE = 1 - 1e-9
MiB = 1024 * 1024


class Refusing(FakeServer):
    """Refuses each infer request its first `refusals` times with OVERLOADED (saying `retry_after_ms` when set),
    then answers it; its `health` says `max_message_bytes` when set."""

    def __init__(
        self, name: str, refusals: int, retry_after_ms: int | None = None, max_message_bytes: int | None = None
    ):
        self.refusals = refusals
        self.retry_after_ms = retry_after_ms
        self.max_message_bytes = max_message_bytes
        self.seen: Counter[Any] = Counter()
        self.ran: list[Any] = []  # the requests answered, by n, in the order they were
        super().__init__(name)

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op", "infer")
        if op == "health" and self.max_message_bytes is not None:
            return {**super()._answer(message), "max_message_bytes": self.max_message_bytes}
        if op == "infer":
            self.seen[message["inputs"]["n"]] += 1  # ids repeat across clients: tests give each request its own n
            if self.seen[message["inputs"]["n"]] <= self.refusals:
                return error_reply(message["id"], OVERLOADED, "estimated wait 90 ms; retry later", self.retry_after_ms)
            self.ran.append(message["inputs"]["n"])
        return super()._answer(message)


def refusing(servers: list[FakeServer], *args: Any, **kwargs: Any) -> Refusing:
    server = Refusing(f"s{len(servers)}", *args, **kwargs)
    servers.append(server)
    return server


# -- the backoff -------------------------------------------------------------------------------


def test_the_backoff_doubles_within_its_jitter_up_to_its_cap() -> None:
    backoff = Backoff(first_s=0.01, max_s=0.1)
    for retry in range(8):
        ceiling = min(0.1, 0.01 * 2**retry)
        assert backoff.delay(retry, None, lambda: 0.0) == pytest.approx(ceiling / 2)
        assert ceiling / 2 < backoff.delay(retry, None, lambda: NEARLY_ONE) <= ceiling
    assert backoff.delay(10_000, None, lambda: NEARLY_ONE) <= 0.1  # no overflow however many retries
    assert len({backoff.delay(3, None) for _ in range(50)}) > 1  # jittered


def test_the_servers_estimate_is_a_floor_under_the_growing_backoff() -> None:
    backoff = Backoff(first_s=0.01, max_s=1.0)
    assert backoff.delay(0, 0.25, lambda: 0.0) == 0.25
    assert backoff.delay(0, 0.25, lambda: NEARLY_ONE) == 0.25
    assert backoff.delay(6, 0.25, lambda: NEARLY_ONE) == pytest.approx(0.64)  # the backoff has grown past it
    assert backoff.delay(0, 5.0, lambda: 0.0) == 5.0  # not capped: sooner would only be refused again


def test_a_quote_of_1_ms_still_gets_waits_that_grow_and_spread() -> None:
    """A burst refused with `retry_after_ms: 1` every time: the waits grow from the backoff's first step
    to its cap, jittered, rather than coming back every millisecond."""
    backoff = Backoff()
    lowest = [backoff.delay(retry, 0.001, lambda: 0.0) for retry in range(10)]
    highest = [backoff.delay(retry, 0.001, lambda: NEARLY_ONE) for retry in range(10)]
    assert lowest == pytest.approx([0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5, 0.5])
    assert highest == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0, 1.0])
    assert sum(lowest) > 1.5  # ten resends span seconds, not ~20 ms
    assert len({backoff.delay(3, 0.001) for _ in range(50)}) > 1  # jittered


def test_the_default_count_of_resends_outlasts_the_default_timeout() -> None:
    """The time budget ends a refused request's resends, not their count: even with every wait at its shortest,
    the default number of resends spans more than the default timeout."""
    backoff = Backoff()
    shortest = sum(backoff.delay(retry, None, lambda: 0.0) for retry in range(DEFAULT_MAX_RETRIES))
    assert shortest > DEFAULT_TIMEOUT


@pytest.mark.parametrize("first_s, max_s", [(0, 1), (-1, 1), (2, 1)])
def test_a_backoff_that_cannot_wait_is_refused(first_s: float, max_s: float) -> None:
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first_s, max_s)


def test_only_a_refusal_from_a_server_not_stopping_is_retried_and_its_estimate_is_read() -> None:
    assert is_refusal(error_reply(1, OVERLOADED, "estimated wait 90 ms; retry later"))
    assert not is_refusal(error_reply(1, OVERLOADED, DRAINING_MESSAGE))
    assert not is_refusal(error_reply(1, INVALID_INPUT, "token 7 is outside the vocabulary"))
    assert not is_refusal({"id": 1, "ok": True})
    assert retry_after_s(error_reply(1, OVERLOADED, "", 250)) == 0.25
    for value in (None, -1, True, "250", float("nan")):
        assert retry_after_s({"id": 1, "ok": False, "error": {"code": OVERLOADED, "retry_after_ms": value}}) is None


# -- resending after a backoff -----------------------------------------------------------------


def test_one_server_refusing_each_request_three_times_answers_them_all(servers: list[FakeServer]) -> None:
    server = refusing(servers, 3, retry_after_ms=5)
    with Client(server.address, timeout=10) as client:
        assert [client.infer("m", {"n": n}).outputs["echo"] for n in range(4)] == list(range(4))
        assert client.retries == 12 and client.resent == 0

    async def run() -> tuple[list, int]:
        async with AsyncClient(server.address, timeout=10) as client:
            return await infer_many(client, range(10, 30)), client.retries

    results, retries = asyncio.run(run())
    assert answered_by(results, range(10, 30)) == ["s0"] * 20
    assert retries == 60 and set(server.seen.values()) == {4}


def test_several_servers_take_another_server_first_then_back_off(servers: list[FakeServer]) -> None:
    """Each server refuses each request once: it goes to the other one, then, both having refused, waits."""
    for _ in range(2):
        refusing(servers, 1)
    addresses = [s.address for s in servers]

    async def run() -> tuple[list, int, int]:
        async with AsyncClient(addresses, timeout=10, **FAST) as client:
            return await infer_many(client, range(10)), client.resent, client.retries

    results, resent, retries = asyncio.run(run())
    answered_by(results, range(10))
    assert resent == retries == 10
    with Client(addresses, timeout=10, **FAST) as client:
        assert client.infer("m", {"n": 10}).outputs["echo"] == 10
        assert client.resent == client.retries == 1


def test_a_sessions_pipelined_requests_are_never_run_out_of_order(servers: list[FakeServer]) -> None:
    """A refused request of a session is resent only while no other of its session is in flight: one resent
    behind a later one would run after it. The caller gets the refusal instead."""
    server = refusing(servers, 1, retry_after_ms=1)

    async def run() -> list:
        async with AsyncClient(server.address, timeout=10) as client:
            first = await client.infer("m", {"n": 0}, session="s")  # alone: refused, resent, answered
            assert first.outputs["echo"] == 0 and client.retries == 1
            pipelined = [client.infer("m", {"n": n}, session="s") for n in range(1, 6)]
            return await asyncio.gather(*pipelined, return_exceptions=True)

    results = asyncio.run(run())
    assert all(
        isinstance(r, ServerError) and r.code == OVERLOADED or r.outputs["echo"] == n for n, r in enumerate(results, 1)
    )
    assert server.ran == sorted(server.ran) and server.ran[0] == 0


@pytest.mark.parametrize("mode, code", [("invalid", INVALID_INPUT), ("draining", OVERLOADED)])
def test_other_errors_and_a_draining_servers_refusal_reach_the_caller_at_once(
    servers: list[FakeServer], mode: str, code: str
) -> None:
    server = FakeServer("s0", mode=mode)
    servers.append(server)
    with Client(server.address, timeout=10) as client, pytest.raises(ServerError) as caught:
        client.infer("m", {"n": 1})
    assert caught.value.code == code and client.retries == 0 and len(server.infer_ids) == 1


def test_a_retry_stops_at_the_requests_deadline(servers: list[FakeServer]) -> None:
    server = refusing(servers, 10**9)
    with Client(server.address, timeout=30, max_retries=10**6) as client, pytest.raises(ServerError) as caught:
        client.infer("m", {"n": 1}, deadline_ms=300)
    assert caught.value.code == OVERLOADED
    deadlines = [m["deadline_ms"] for m in server.messages if m.get("op", "infer") == "infer"]
    assert deadlines[0] == 300 and len(deadlines) == client.retries + 1 < 10**6
    assert all(later <= earlier for earlier, later in itertools.pairwise(deadlines)) and deadlines[-1] < 300


def test_a_retry_stops_at_the_calls_timeout(servers: list[FakeServer]) -> None:
    """The caller gets the refusal, not a TimeoutError: no wait is started that would end past the timeout."""
    server = refusing(servers, 10**9)

    async def run() -> tuple[BaseException, int]:
        async with AsyncClient(server.address, timeout=0.5, max_retries=10**6) as client:
            return (await infer_many(client, range(1)))[0], client.retries

    error, retries = asyncio.run(run())
    assert isinstance(error, ServerError) and error.code == OVERLOADED
    assert len(server.infer_ids) == retries + 1 < 10**6
    assert all("deadline_ms" not in m for m in server.messages)


# -- requests too large to send ----------------------------------------------------------------


def test_a_request_over_the_set_limit_is_refused_unsent_and_the_next_one_goes(servers: list[FakeServer]) -> None:
    server = refusing(servers, 0)
    with Client(server.address, timeout=10, max_message_bytes=10_000) as client:
        with pytest.raises(
            RequestTooLarge, match=r"over the server's limit of 10000 bytes \(server.max_message_bytes\)"
        ):
            client.infer("m", {"n": 1, "blob": b"\x00" * 20_000})
        assert client.infer("m", {"n": 2}).outputs["echo"] == 2

    async def run() -> list:
        async with AsyncClient(server.address, timeout=10, max_message_bytes=10_000) as client:
            calls = [client.infer("m", {"n": n, "blob": b"\x00" * (20_000 if n == 3 else 10)}) for n in range(6)]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run())
    assert isinstance(results[3], RequestTooLarge) and results[3].limit == 10_000 and results[3].size > 20_000
    assert [r.outputs["echo"] for i, r in enumerate(results) if i != 3] == [0, 1, 2, 4, 5]
    assert all(len(m["inputs"].get("blob", b"")) < 10_000 for m in server.messages if m.get("op", "infer") == "infer")
    assert not any(m.get("op") == "health" for m in server.messages)  # a set limit is not asked


def test_the_limit_is_asked_of_the_server_once_a_request_is_over_1_kib(servers: list[FakeServer]) -> None:
    roomy = refusing(servers, 0, max_message_bytes=4 * MiB)
    with Client(roomy.address, timeout=10) as client:
        assert client.infer("m", {"n": 1, "blob": b"\x00" * (2 * MiB)}).outputs["echo"] == 1
        assert client.infer("m", {"n": 2, "blob": b"\x00" * (3 * MiB)}).outputs["echo"] == 2
    assert [m.get("op", "infer") for m in roomy.messages] == ["health", "infer", "infer"]

    silent_on_it = refusing(servers, 0)  # a server whose health does not say: the default holds

    async def run() -> list:
        async with AsyncClient(silent_on_it.address, timeout=10) as client:
            return await asyncio.gather(
                client.infer("m", {"n": 1, "blob": b"\x00" * (2 * MiB)}),
                client.infer("m", {"n": 2}),
                return_exceptions=True,
            )

    too_large, answered = asyncio.run(run())
    assert isinstance(too_large, RequestTooLarge) and too_large.limit == MiB
    assert answered.outputs["echo"] == 2 and len(silent_on_it.infer_ids) == 1  # the large one was not sent


class SessionKeeping(Refusing):
    """A Refusing server that keeps sessions as the real one counts them: each answer says its session's step."""

    def __init__(self, name: str, refusals: int):
        self.steps: Counter[str] = Counter()
        super().__init__(name, refusals)

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        reply = super()._answer(message)
        if reply.get("ok") and "session" in message:
            self.steps[message["session"]] += 1
            reply["session_step"] = self.steps[message["session"]]
        return reply


def session_messages(servers: list[FakeServer], session: str) -> list[tuple[str, dict[str, Any]]]:
    return [(s.name, m) for s in servers for m in s.messages if m.get("session") == session]


def test_a_sessions_refused_request_backs_off_on_its_own_server_never_another(servers: list[FakeServer]) -> None:
    """Both servers refuse each request once: a session's request waits and goes back to its session's server,
    where its state is, instead of to the other one, which would answer SESSION_LOST (or start it from zeros)."""
    for _ in range(2):
        servers.append(SessionKeeping(f"s{len(servers)}", refusals=1))
    addresses = [s.address for s in servers]
    with Client(addresses, timeout=10, **FAST) as client:
        steps = [client.infer("m", {"n": n}, session="sync").session_step for n in range(4)]
        assert steps == [1, 2, 3, 4] and client.retries == 4 and client.resent == 0

    async def run() -> list[int | None]:
        async with AsyncClient(addresses, timeout=10, **FAST) as client:
            return [(await client.infer("m", {"n": n}, session="async")).session_step for n in range(10, 14)]

    assert asyncio.run(run()) == [1, 2, 3, 4]
    for session in ("sync", "async"):
        sent = session_messages(servers, session)
        assert len({name for name, _ in sent}) == 1 and len(sent) == 8  # each of 4 refused once, all on one server


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_session_whose_server_is_lost_is_not_continued_on_another(servers: list[FakeServer], kind: str) -> None:
    for _ in range(2):
        servers.append(SessionKeeping(f"s{len(servers)}", refusals=0))
    addresses = [s.address for s in servers]

    async def session_steps() -> None:
        async with AsyncClient(addresses, timeout=10, **FAST) as client:
            await client.infer("m", {"n": 0}, session="kept")
            home = next(s for s in servers if s.messages and s.infer_ids)
            home.close()
            with pytest.raises(ServerLost, match="continues a session whose state is on that server"):
                await client.infer("m", {"n": 1}, session="kept")

    if kind == "async":
        asyncio.run(session_steps())
    else:
        with Client(addresses, timeout=10, **FAST) as client:
            client.infer("m", {"n": 0}, session="kept")
            home = next(s for s in servers if s.infer_ids)
            home.close()
            with pytest.raises(ServerLost, match="continues a session whose state is on that server"):
                client.infer("m", {"n": 1}, session="kept")
    assert len({name for name, _ in session_messages(servers, "kept")}) == 1  # nothing sent elsewhere


def test_a_resend_is_made_only_with_as_much_time_left_after_it_as_it_waited(servers: list[FakeServer]) -> None:
    """A resend that would leave its answer no time would end in a timeout: the caller gets the refusal instead."""
    server = refusing(servers, 10**9)
    refusal = error_reply(1, OVERLOADED, "estimated wait 90 ms; retry later", 100)  # a wait of 0.1 s at least
    with Client(server.address, timeout=10, max_retries=10**6) as client:
        request = client._outgoing({"model": "m", "inputs": {"n": 1}}, None)
        home = client._servers.servers[0]
        assert client._resend(request, home, refusal, request.give_up_at - 0.25) is not None  # 0.1 s, twice: fits
        assert client._resend(request, home, refusal, request.give_up_at - 0.15) is None  # 0.1 s twice: past it
