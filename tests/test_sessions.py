"""Sessions in the batching core, step by step (tests/harness.py): waiting requests end with their
client, the server or their deadline; they count towards the in-flight bound; tombstones are bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_scheduler import lstm_models

from batchmaker.common.protocol import CANCELLED, OVERLOADED, SESSION_LOST, UNAVAILABLE, RequestError
from batchmaker.common.task import CompletionNotice
from batchmaker.manager.batching.outcomes import Answered, Failed, Refused


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
