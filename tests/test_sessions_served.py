"""Server-held sessions through a real server: a session's chunks equal one unchunked torch.nn run,
sessions interleave, a session's requests run in order, and every way a session ends or is refused, with the
manager deciding each step and with the workers running their own batches."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import SMALL_SEQ2SEQ, start_server, stop_server, wait_idle, wait_until, wait_until_async, write_config

from batchmaker.clients import AsyncClient, Client, ServerError
from batchmaker.common.models import build_model
from batchmaker.common.protocol import (
    BAD_REQUEST,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INVALID_INPUT,
    OVERLOADED,
    SESSION_LOST,
    decode_outputs,
)

TOLERANCE = 1e-5
VOCAB = 100
LONG = 3000  # tokens of a chunk that keeps a worker busy long enough to be killed under it
MAX_SESSIONS = 6

MODELS = f"""
[models.lstm2]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm2.pt"
vocab_size = {VOCAB}
embedding_size = 12
hidden_size = 16
num_layers = 2
max_length = {LONG}
batch_sizes = [1, 2, 4, 8]

[models.gru]
builder = "batchmaker.common.models.gru:build"
weights = "gru.pt"
vocab_size = {VOCAB}
embedding_size = 12
hidden_size = 16
max_length = {LONG}
batch_sizes = [1, 2, 4, 8]
""" + SMALL_SEQ2SEQ


RUNNING_BATCH = ["manager", "worker"]  # who decides each step: the manager's batching core, or each worker


@pytest.fixture(scope="module", params=RUNNING_BATCH)
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[Any, dict[str, Any]]]:
    scheduler = f'running_batch = "{request.param}"'
    server = f"max_sessions = {MAX_SESSIONS}"
    config = write_config(tmp_path_factory.mktemp("sessions"), MODELS, server=server, scheduler=scheduler)
    server = start_server(config, workers=2)
    models = {}
    for name in ("lstm2", "gru"):
        model = build_model(config.models[name])
        model.max_length = 10 * LONG  # the reference runs whole sessions, longer than one request may be
        models[name] = (model, model.load_weights())
    yield server, models
    stop_server(server)


def chunks(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=length).tolist() for length in lengths]


def joined(parts: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(parts))


def assert_reference(models: dict[str, Any], name: str, tokens: list[int], outputs: dict[str, Any]) -> None:
    """The reply equals nn.LSTM / nn.GRU run once over all of the session's tokens so far, from zeros."""
    model, state = models[name]
    expected = model.reference(state, {"tokens": tokens})
    for key, value in expected.items():
        assert np.abs(outputs[key] - value).max() <= TOLERANCE, key


def sessions_live(server: Any) -> int:
    with server.client() as client:
        return client.stats()["sessions"]


def assert_refused(call: Any, code: str, text: str) -> None:
    with pytest.raises(ServerError) as raised:
        call()
    assert raised.value.code == code and text in raised.value.message, raised.value


@pytest.mark.parametrize("name", ["lstm2", "gru"])
def test_a_session_over_several_chunks_equals_one_unchunked_run(served, name):
    server, models = served
    seen: list[int] = []
    with server.client() as client:
        parts = chunks(1, [5, 1, 12, 7])
        for step, part in enumerate(parts, start=1):
            seen += part
            reply = client.infer(name, {"tokens": part}, session=f"chunks-{name}", session_end=step == len(parts))
            assert reply.session_step == step
            assert_reference(models, name, seen, reply.outputs)
        stats = client.stats()
    assert sessions_live(server) == 0
    if stats["running_batch"] == "worker":
        assert stats["tasks"] == 0  # every request of the sessions ran in a worker's running batch


def test_interleaved_sessions_keep_their_own_state(served):
    server, models = served
    streams = {f"s{i}": chunks(10 + i, [3, 8, 2, 6]) for i in range(3)}

    async def run() -> None:
        async with AsyncClient(server.address, timeout=60) as client:
            for turn in range(4):  # each turn: one chunk of every session, all in flight together
                replies = await asyncio.gather(
                    *(client.infer("lstm2", {"tokens": parts[turn]}, session=f"inter-{name}", session_end=turn == 3)
                      for name, parts in streams.items())
                )  # fmt: skip
                for (name, parts), reply in zip(streams.items(), replies):
                    assert_reference(models, "lstm2", joined(parts[: turn + 1]), reply.outputs)

    asyncio.run(run())
    assert sessions_live(server) == 0


def test_a_sessions_requests_run_one_at_a_time_in_arrival_order(served):
    """Five chunks sent at once: the later ones wait for the earlier; each reply is the state after its chunk."""
    server, models = served
    parts = chunks(20, [4, 9, 1, 6, 3])

    async def run() -> list[Any]:
        async with AsyncClient(server.address, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.infer("gru", {"tokens": part}, session="ordered", session_end=i == 4)
                    for i, part in enumerate(parts)
                )
            )

    replies = asyncio.run(run())
    assert [reply.session_step for reply in replies] == [1, 2, 3, 4, 5]
    for i, reply in enumerate(replies):
        assert_reference(models, "gru", joined(parts[: i + 1]), reply.outputs)
    assert sessions_live(server) == 0


def test_session_end_frees_the_session_and_its_name_starts_afresh(served):
    server, models = served
    first, second = chunks(30, [6, 5])
    with server.client() as client:
        client.infer("lstm2", {"tokens": first}, session="ends")
        assert client.stats()["sessions"] == 1
        client.infer("lstm2", {"tokens": first}, session="ends", session_end=True)
        assert client.stats()["sessions"] == 0
        reply = client.infer("lstm2", {"tokens": second}, session="ends", session_end=True)
    assert reply.session_step == 1
    assert_reference(models, "lstm2", second, reply.outputs)


def test_max_sessions_refuses_a_new_session_and_serves_the_live_ones(served):
    server, models = served
    part = chunks(40, [3])[0]
    with server.client() as client:
        for i in range(MAX_SESSIONS):
            client.infer("gru", {"tokens": part}, session=f"full-{i}")
        assert client.stats()["sessions"] == MAX_SESSIONS
        assert_refused(
            lambda: client.infer("gru", {"tokens": part}, session="one-too-many"), OVERLOADED, "sessions live"
        )
        for i in range(MAX_SESSIONS):
            reply = client.infer("gru", {"tokens": part}, session=f"full-{i}", session_end=True)
            assert_reference(models, "gru", part + part, reply.outputs)
        assert client.stats()["sessions"] == 0
        client.infer("gru", {"tokens": part}, session="one-too-many", session_end=True)


def test_a_worker_killed_under_a_sessions_request_costs_nothing(served):
    """The state lives in the manager: the request replays on the other worker from the same h0."""
    server, models = served
    first, long_part, last = chunks(50, [7, LONG, 4])
    with server.client() as client:
        before = wait_idle(client)
        client.infer("lstm2", {"tokens": first}, session="survivor")

    async def run() -> list[Any]:
        async with AsyncClient(server.address, timeout=120) as client:
            running = asyncio.ensure_future(client.infer("lstm2", {"tokens": long_part}, session="survivor"))

            async def busy_worker() -> int | None:
                stats = await client.stats()
                routed = stats["routed"]["by_worker"]  # with the running batch in the workers: no task, no slot
                workers = stats["workers"].items()
                busy = [w["pid"] for i, w in workers if w["tasks_in_flight"] > 0 or routed.get(i, 0) > 0]
                return busy[0] if busy and stats["requests_in_flight"] == 1 else None

            os.kill(await wait_until_async(busy_worker, "the long chunk running on a worker"), signal.SIGKILL)
            ending = client.infer("lstm2", {"tokens": last}, session="survivor", session_end=True)  # waits behind it
            return await asyncio.gather(running, ending)

    replies = asyncio.run(run())
    assert_reference(models, "lstm2", first + long_part, replies[0].outputs)
    assert_reference(models, "lstm2", first + long_part + last, replies[1].outputs)
    assert [reply.session_step for reply in replies] == [2, 3]
    with server.client() as client:
        wait_until(lambda: len(client.health()["workers"]) == 2, "the killed worker's replacement")
        stats = wait_idle(client)
    assert stats["worker_losses"] == before["worker_losses"] + 1
    assert stats["replayed_requests"] >= before["replayed_requests"] + 1
    assert stats["sessions"] == 0


def raw_infer(client: Client, model: str, tokens: list[int], **fields: Any) -> dict[str, Any]:
    return client.call({"model": model, "inputs": {"tokens": tokens}, **fields})


@pytest.mark.parametrize(
    "fields, code, text",
    [
        ({"session": 7}, BAD_REQUEST, "'session' must be a string"),
        ({"session": ""}, BAD_REQUEST, "'session' must be a string"),
        ({"session": "x" * 257}, BAD_REQUEST, "'session' must be a string"),
        ({"session": "a", "session_end": "yes"}, BAD_REQUEST, "'session_end' must be true or false"),
        ({"session": "a", "session_step": -1}, BAD_REQUEST, "'session_step' must be an integer >= 0"),
        ({"session": "a", "session_step": True}, BAD_REQUEST, "'session_step' must be an integer >= 0"),
        ({"session_end": True}, BAD_REQUEST, "'session_end' needs 'session'"),
        ({"session_step": 2}, BAD_REQUEST, "'session_step' needs 'session'"),
        ({"session": "never-seen", "session_step": 3}, SESSION_LOST, "holds no state for it"),
    ],
)
def test_bad_session_fields_are_refused(served, fields, code, text):
    server, _ = served
    with server.client() as client:
        assert_refused(lambda: raw_infer(client, "lstm2", [1, 2], **fields), code, text)
        assert client.stats()["sessions"] == 0


def test_sessions_refuse_models_without_state_and_explicit_initial_states(served):
    server, _ = served
    with server.client() as client:
        assert_refused(
            lambda: client.infer("seq2seq", {"tokens": [1, 2]}, session="s2s"), INVALID_INPUT, "keeps no state"
        )
        h0 = np.zeros((2, 16), np.float32)
        assert_refused(
            lambda: client.infer("lstm2", {"tokens": [1, 2], "h0": h0}, session="given"),
            INVALID_INPUT,
            "without 'session'",
        )
        client.infer("lstm2", {"tokens": [1, 2]}, session="owned")
        assert_refused(
            lambda: client.infer("gru", {"tokens": [1]}, session="owned"), INVALID_INPUT, "belongs to model 'lstm2'"
        )
        assert_refused(
            lambda: raw_infer(client, "lstm2", [1], session="owned", session_step=5), SESSION_LOST, "at step 1, not 5"
        )
        assert client.infer("lstm2", {"tokens": [3]}, session="owned", session_end=True).session_step == 2
        assert client.stats()["sessions"] == 0


def test_a_waiting_request_that_fails_leaves_the_session_as_it_was(served):
    """Behind a long chunk: one request cancelled, one past its deadline, one with bad input; the
    session goes on from the long chunk's state."""
    server, models = served
    long_part, last = chunks(60, [LONG, 5])

    async def run() -> tuple[list[Any], dict[str, Any]]:
        async with AsyncClient(server.address, timeout=120) as client:
            calls = [
                client.call({"id": "long", "model": "lstm2", "inputs": {"tokens": long_part}, "session": "waits"}),
                client.call({"id": "cancelled", "model": "lstm2", "inputs": {"tokens": [1]}, "session": "waits"}),
                client.call(
                    {"id": "late", "model": "lstm2", "inputs": {"tokens": [1]}, "session": "waits", "deadline_ms": 1}
                ),
                client.call({"id": "bad", "model": "lstm2", "inputs": {"tokens": [VOCAB]}, "session": "waits"}),
                client.call(
                    {
                        "id": "last",
                        "model": "lstm2",
                        "inputs": {"tokens": last},
                        "session": "waits",
                        "session_end": True,
                    }
                ),
            ]
            futures = [asyncio.ensure_future(call) for call in calls]

            async def late_one_expired() -> bool:  # the other three still wait behind the long chunk
                return futures[2].done() and (await client.stats())["requests_waiting_for_their_session"] == 3

            await wait_until_async(late_one_expired, "the late request expiring while three wait behind the long chunk")
            assert (await client.cancel("cancelled"))["cancelled"] is True
            replies = await asyncio.gather(*futures, return_exceptions=True)
            return replies, await client.stats()

    replies, stats = asyncio.run(run())
    assert [getattr(reply, "code", "ok") for reply in replies] == [
        "ok",
        CANCELLED,
        DEADLINE_EXCEEDED,
        INVALID_INPUT,
        "ok",
    ]
    assert replies[0]["session_step"] == 1 and replies[4]["session_step"] == 2
    assert_reference(models, "lstm2", long_part + last, decode_outputs(replies[4]["outputs"]))
    assert stats["requests_waiting_for_their_session"] == 0


@pytest.fixture(params=RUNNING_BATCH)
def short_lived(tmp_path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A server whose sessions expire after 300 ms idle."""
    scheduler = f'running_batch = "{request.param}"'
    config = write_config(tmp_path, MODELS, server="session_ttl_ms = 300", scheduler=scheduler)
    server = start_server(config, workers=1)
    yield server
    stop_server(server)


def test_an_expired_session_answers_session_lost(short_lived):
    with short_lived.client() as client:
        client.infer("gru", {"tokens": [1, 2, 3]}, session="brief")
        wait_until(lambda: client.stats()["sessions"] == 0, "the idle session expiring")
        assert_refused(lambda: client.infer("gru", {"tokens": [4]}, session="brief"), SESSION_LOST, "session_ttl_ms")
        # whatever the step
        assert_refused(lambda: raw_infer(client, "gru", [4], session="brief"), SESSION_LOST, "expired")
        assert client.stats()["requests"][SESSION_LOST] == 2
        assert client.infer("gru", {"tokens": [4]}, session="brief-2", session_end=True).session_step == 1


def test_a_restarted_server_answers_session_lost_to_a_client_that_saw_steps(tmp_path):
    config = write_config(tmp_path, MODELS)
    server = start_server(config, workers=1)
    with Client(server.address, timeout=60) as client:
        try:
            assert client.infer("gru", {"tokens": [1, 2]}, session="before-restart").session_step == 1
        finally:
            stop_server(server)
        server = start_server(config, workers=1)
        try:
            assert_refused(
                lambda: client.infer("gru", {"tokens": [3]}, session="before-restart"), SESSION_LOST, "server restarted"
            )
            assert client.stats()["sessions"] == 0
        finally:
            stop_server(server)
