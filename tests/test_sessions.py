"""Sessions in the batching core, step by step (tests/harness.py): waiting requests end with their
client, the server or their deadline; they count towards the in-flight bound; tombstones are bounded; what a
request asks of its session is checked at its turn, and a start replaces the session (or its tombstone)
from zeros then."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from conftest import SMALL_LSTM, write_config
from test_scheduler import lstm_models

from batchmaker.common.models.base import build_planner
from batchmaker.common.notice import CompletionNotice
from batchmaker.common.protocol import (
    BAD_REQUEST,
    CANCELLED,
    INVALID_INPUT,
    OVERLOADED,
    SESSION_LOST,
    UNAVAILABLE,
    RequestError,
)
from batchmaker.manager.batching.outcomes import Answered, Failed, Refused
from batchmaker.manager.batching.sessions import SessionFields, SessionStore, Waiting


@pytest.fixture
def harness(make_harness):
    def make(server: str = "") -> object:
        return make_harness(lstm_models("[1, 2, 4]"), server=server)

    return make


def session_request(session: str, tokens: list[int], **fields) -> dict:
    return {"model": "lstm", "inputs": {"tokens": tokens}, "session": session, **fields}


def run_all(h) -> list:
    """Schedule and complete tasks until nothing is in flight; the outcomes, in order."""
    outcomes = []
    worker = h.workers[0]
    while h.schedule(worker) or h.in_flight(worker):
        while h.in_flight(worker):
            task = worker.tasks[min(worker.tasks)]
            outcomes += h.core.tasks_finished(worker, CompletionNotice(worker.worker_id, [task.task_id], {}, 0))
    return outcomes


def summary(outcomes: list) -> list[tuple]:
    """Each outcome as (kind, client, request id, session step or error code)."""
    return [
        (type(o).__name__, o.client, o.request_id, o.error.code)
        if isinstance(o, Refused)
        else (type(o).__name__, o.request.client, o.request.request_id, o.session_step)
        for o in outcomes
    ]


def test_requests_waiting_for_their_session_end_with_their_client_and_the_session_goes_on(harness):
    h = harness()
    core = h.core
    assert core.admit(b"a", 1, session_request("s", [1, 2, 3]), 0.0) is not None
    assert core.admit(b"b", 1, session_request("s", [4]), 0.0) is None  # waits behind a's request
    assert core.admit(b"a", 2, session_request("s", [5]), 0.0) is None
    outcomes = core.clients_gone([b"b"])
    assert outcomes == [Refused(b"b", 1, outcomes[0].error)] and outcomes[0].error.code == CANCELLED
    done = run_all(h)
    assert [(type(o).__name__, o.request.client, o.session_step) for o in done] == [
        ("Answered", b"a", 1), ("Answered", b"a", 2),
    ]  # fmt: skip
    assert core.snapshot()["sessions"] == 1 and core.snapshot()["requests_waiting_for_their_session"] == 0


def test_a_stopping_server_answers_waiting_requests_unavailable(harness):
    h = harness()
    h.core.admit(b"a", 1, session_request("s", [1, 2]), 0.0)
    h.core.admit(b"a", 2, session_request("s", [3]), 0.0)
    outcomes = h.core.shutdown()
    assert [(type(o), o.error.code) for o in outcomes] == [(Refused, UNAVAILABLE), (Failed, UNAVAILABLE)]


def test_waiting_requests_count_towards_max_queued_requests(harness):
    h = harness(server="max_queued_requests = 2")
    h.core.admit(b"a", 1, session_request("s", [1, 2]), 0.0)
    h.core.admit(b"a", 2, session_request("s", [3]), 0.0)
    with pytest.raises(RequestError) as refused:
        h.core.admit(b"a", 3, {"model": "lstm", "inputs": {"tokens": [1]}}, 0.0)
    assert refused.value.code == OVERLOADED and "2 requests in flight" in refused.value.message


def test_a_waiting_request_past_its_deadline_is_refused_before_its_turn(harness):
    h = harness()
    now = time.perf_counter()
    h.core.admit(b"a", 1, session_request("s", [1, 2]), now)
    h.core.admit(b"a", 2, session_request("s", [3], deadline_ms=0), now)
    outcomes = h.core.expire()
    assert [(type(o), o.request_id, o.error.code) for o in outcomes] == [(Refused, 2, "DEADLINE_EXCEEDED")]
    assert [type(o) for o in run_all(h)] == [Answered]


def test_tombstones_of_expired_sessions_are_bounded_by_max_sessions(harness):
    h = harness(server="max_sessions = 2\nsession_ttl_ms = 1")
    core = h.core
    for name in ("s1", "s2"):
        core.admit(b"a", name, session_request(name, [1]), 0.0)
        run_all(h)
    core.sessions.expire(time.perf_counter() + 1)
    assert len(core.sessions) == 0
    core.admit(b"a", "s3", session_request("s3", [1]), 0.0)  # s3 expires too: s1's tombstone goes
    run_all(h)
    core.sessions.expire(time.perf_counter() + 1)
    assert core.admit(b"a", "again", session_request("s1", [1]), 0.0) is not None  # forgotten: a new session
    for name in ("s2", "s3"):
        with pytest.raises(RequestError) as lost:
            core.admit(b"a", f"{name}-again", session_request(name, [1]), 0.0)
        assert lost.value.code == SESSION_LOST and "expired" in lost.value.message


def test_the_session_state_is_the_previous_reply_s_final_state(harness):
    """The manager's host copy of h_n / c_n is the next request's h0 / c0, exactly."""
    h = harness()
    h.core.admit(b"a", 1, session_request("s", [1, 2, 3]), 0.0)
    (first,) = run_all(h)
    second = h.core.admit(b"a", 2, session_request("s", [4]), 0.0)
    for name in ("h", "c"):
        assert np.array_equal(second.inputs[f"{name}0"], first.outputs[f"{name}_n"])


def test_a_failed_request_with_session_end_leaves_the_session_live(harness):
    h = harness()
    h.core.admit(b"a", 1, session_request("s", [1, 2]), 0.0)
    run_all(h)
    with pytest.raises(RequestError) as refused:
        h.core.admit(b"a", 2, session_request("s", [100], session_end=True), 0.0)  # outside the vocabulary
    assert refused.value.code == "INVALID_INPUT"
    h.core.admit(b"a", 3, session_request("s", [3], deadline_ms=0), time.perf_counter() - 1)
    assert [o.error.code for o in h.core.expire()] == ["DEADLINE_EXCEEDED"]
    assert len(h.core.sessions) == 1
    h.core.admit(b"a", 4, session_request("s", [3], session_end=True), 0.0)
    assert [o.session_step for o in run_all(h)] == [2]
    assert len(h.core.sessions) == 0


def test_the_event_loop_wakes_for_a_waiting_request_s_deadline(harness):
    h = harness()
    now = time.perf_counter()
    h.core.admit(b"a", 1, session_request("s", [1, 2]), now)
    assert h.core.wait_ms(100) == 100
    h.core.admit(b"a", 2, session_request("s", [3], deadline_ms=0), now - 1)
    assert h.core.wait_ms(100) == 0


def test_a_bidirectional_chain_refuses_sessions(harness):
    """A chain that reads its sequence both ways has no state to carry to the next chunk."""
    h = harness()
    h.core.versions.resolve("lstm", None, None).directions = 2  # as a bidirectional chain reports itself
    with pytest.raises(RequestError) as refused:
        h.core.admit(b"a", 1, session_request("s", [1, 2]), 0.0)
    assert refused.value.code == "INVALID_INPUT" and "unidirectional" in refused.value.message
    assert len(h.core.sessions) == 0


def test_a_continuation_sent_behind_its_sessions_first_request_is_checked_when_its_turn_comes(harness):
    """Pipelined: the second request says it continues step 1, which the session reaches only once the first is
    answered; it waits, and is judged then."""
    h = harness()
    h.core.admit(b"a", 1, session_request("s", [1, 2], session_start=True), 0.0)
    assert h.core.admit(b"a", 2, session_request("s", [3], session_step=1), 0.0) is None
    assert h.core.admit(b"a", 3, session_request("s", [4], session_step=3, session_end=True), 0.0) is None
    outcomes = run_all(h)
    assert summary(outcomes) == [
        ("Answered", b"a", 1, 1), ("Answered", b"a", 2, 2), ("Refused", b"a", 3, SESSION_LOST),
    ]  # fmt: skip
    assert "holds it at step 2, not 3" in outcomes[2].error.message and len(h.core.sessions) == 1


def test_a_start_waits_its_turn_then_replaces_the_live_session_from_zeros(harness):
    h = harness()
    h.core.admit(b"a", 1, session_request("s", [1, 2]), 0.0)
    run_all(h)
    h.core.admit(b"a", 2, session_request("s", [3]), 0.0)  # runs from the session's state
    assert h.core.admit(b"b", 1, session_request("s", [5, 6], session_start=True), 0.0) is None
    assert h.core.admit(b"a", 3, session_request("s", [7], session_step=1), 0.0) is None  # continues the start
    outcomes = run_all(h)
    assert summary(outcomes) == [("Answered", b"a", 2, 2), ("Answered", b"b", 1, 1), ("Answered", b"a", 3, 2)]
    assert ["h0" in o.request.inputs for o in outcomes] == [True, False, True]  # the start's from zeros


def test_a_start_clears_the_tombstone_of_an_expired_session(harness):
    h = harness("session_ttl_ms = 1")
    h.core.admit(b"a", 1, session_request("s", [1]), 0.0)
    run_all(h)
    h.core.sessions.expire(time.perf_counter() + 1)
    with pytest.raises(RequestError) as lost:
        h.core.admit(b"a", 2, session_request("s", [2], session_end=True), 0.0)
    assert lost.value.code == SESSION_LOST and "expired" in lost.value.message and "session_start" in lost.value.message
    h.core.admit(b"a", 3, session_request("s", [2], session_start=True), 0.0)
    h.core.admit(b"a", 4, session_request("s", [3], session_step=1, session_end=True), 0.0)
    assert summary(run_all(h)) == [("Answered", b"a", 3, 1), ("Answered", b"a", 4, 2)]
    assert len(h.core.sessions) == 0


def test_a_start_refused_at_its_turn_leaves_no_state_to_continue(harness):
    """The start replaced the session when its turn came, then failed: what follows it continues nothing."""
    h = harness()
    h.core.admit(b"a", 1, session_request("s", [1, 2]), 0.0)
    outside_the_vocabulary = [100]
    assert h.core.admit(b"a", 2, session_request("s", outside_the_vocabulary, session_start=True), 0.0) is None
    assert h.core.admit(b"a", 3, session_request("s", [3], session_step=1), 0.0) is None
    outcomes = run_all(h)
    assert summary(outcomes) == [
        ("Answered", b"a", 1, 1), ("Refused", b"a", 2, INVALID_INPUT), ("Refused", b"a", 3, SESSION_LOST),
    ]  # fmt: skip
    assert "holds no state for it" in outcomes[2].error.message
    assert len(h.core.sessions) == 0


def test_two_starts_of_one_name_each_start_from_zeros(harness):
    h = harness()
    for client in (b"a", b"b"):
        h.core.admit(client, 1, session_request("s", [4, 5], session_start=True), 0.0)
    outcomes = run_all(h)
    assert summary(outcomes) == [("Answered", b"a", 1, 1), ("Answered", b"b", 1, 1)]
    assert ["h0" in o.request.inputs for o in outcomes] == [False, False]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"session_start": "yes"}, "'session_start' must be true or false"),
        ({"session_start": True, "session_step": 2}, "it continues no step ('session_step' 2)"),
    ],
)
def test_bad_session_start_fields_are_refused(harness, fields, words):
    h = harness()
    with pytest.raises(RequestError) as refused:
        h.core.admit(b"a", 1, session_request("s", [1], **fields), 0.0)
    assert refused.value.code == BAD_REQUEST and words in refused.value.message
    with pytest.raises(RequestError) as refused:
        h.core.admit(b"a", 2, {"model": "lstm", "inputs": {"tokens": [1]}, "session_start": True}, 0.0)
    assert refused.value.code == BAD_REQUEST and "'session_start' needs 'session'" in refused.value.message
    assert h.core.admit(b"a", 3, session_request("s", [1], session_start=True, session_step=0), 0.0) is not None


def test_requests_arriving_behind_a_waiting_start_go_to_the_version_it_starts_on(tmp_path):
    """A start resolves its version anew; what is sent after it continues the session it starts."""
    config = write_config(tmp_path, SMALL_LSTM).models["lstm"]
    first, second = (build_planner(dataclasses.replace(config, name=name)) for name in ("lstm", "lstm@2"))
    store = SessionStore(60_000, 10)
    store.started(None, SessionFields("s", False, False, None), first.name, (b"a", 1))
    assert store.model_of("s") == "lstm"
    store.wait(Waiting(b"a", 2, second, {"tokens": [1]}, SessionFields("s", True, False, None), 0.0, None, 0, False))
    assert store.model_of("s") == "lstm@2"
