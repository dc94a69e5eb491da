"""The batching core's API on its own: what each call returns, with workers the test drives."""

from __future__ import annotations

import pytest
from conftest import SMALL_LSTM

from batchmaker.common.notice import CompletionNotice
from batchmaker.common.protocol import (
    BAD_REQUEST,
    CANCELLED,
    INTERNAL,
    OVERLOADED,
    UNKNOWN_MODEL,
    WORKER_LOST,
    RequestError,
)
from batchmaker.manager.batching.outcomes import Answered, Failed, Replayed
from batchmaker.manager.batching.records import Request


@pytest.fixture
def harness(make_harness):
    return lambda **kwargs: make_harness(SMALL_LSTM, **kwargs)


def test_admission_refuses_with_a_clear_error_and_admits_nothing(harness):
    h = harness(server="max_queued_requests = 1\nmax_queued_nodes = 5")
    core = h.core
    cases = [
        ({"inputs": {"tokens": [1]}}, BAD_REQUEST, "lacks 'model'"),
        ({"model": "gru", "inputs": {}}, UNKNOWN_MODEL, "no model named 'gru'"),
        ({"model": "lstm"}, BAD_REQUEST, "lacks 'inputs'"),
        ({"model": "lstm", "inputs": {"tokens": [1]}, "deadline_ms": -1}, BAD_REQUEST, "'deadline_ms' must be"),
        ({"model": "lstm", "inputs": {"tokens": [1] * 6}}, OVERLOADED, "cells queued"),
    ]
    for message, code, text in cases:
        with pytest.raises(RequestError, match=text) as refused:
            core.admit(b"c", 1, message, 0.0)
        assert refused.value.code == code
    assert len(core.requests) == 0 and core.processor.unsubmitted_nodes == 0
    core.admit(b"c", 1, {"model": "lstm", "inputs": {"tokens": [1, 2]}}, 0.0)
    with pytest.raises(RequestError, match="already in flight"):
        core.admit(b"c", 1, {"model": "lstm", "inputs": {"tokens": [1]}}, 0.0)
    with pytest.raises(RequestError, match="requests in flight"):
        core.admit(b"c", 2, {"model": "lstm", "inputs": {"tokens": [1]}}, 0.0)


def test_complete_returns_the_answer_once_and_the_registry_forgets_the_request(harness):
    h = harness()
    worker = h.workers[0]
    request = h.admit("lstm", {"tokens": [1, 2]})
    assert h.schedule(worker) == 2
    first, second = sorted(worker.tasks)
    assert h.core.tasks_finished(worker, CompletionNotice(worker.worker_id, [first], {}, 1)) == []
    [answered] = h.core.tasks_finished(worker, CompletionNotice(worker.worker_id, [second, 999], {}, 2))  # 999: unknown
    assert isinstance(answered, Answered) and answered.request is request
    assert set(answered.outputs) == {"h", "c", "h_n", "c_n"} and answered.timing["total_us"] >= 0
    assert len(h.core.requests) == 0 and not worker.tasks and h.slots_in_use() == 0


def test_a_task_that_failed_on_the_worker_fails_its_requests(harness):
    h = harness()
    worker = h.workers[0]
    request = h.admit("lstm", {"tokens": [1]})
    h.schedule(worker)
    [task_id] = worker.tasks
    [failed] = h.core.tasks_finished(worker, CompletionNotice(worker.worker_id, [task_id], {task_id: "boom"}, 1))
    assert isinstance(failed, Failed) and failed.request is request
    assert failed.error.code == INTERNAL and "boom" in failed.error.message


def test_cancel_returns_the_error_outcome_or_none_for_an_unknown_request(harness):
    h = harness()
    request = h.admit("lstm", {"tokens": [1, 2, 3]}, name="x")
    assert h.core.cancel(b"c", "x") is None and h.core.cancel(b"client", "y") is None
    [failed] = h.core.cancel(b"client", "x")
    assert failed.request is request and failed.error.code == CANCELLED
    assert h.core.cancel(b"client", "x") is None


def test_a_lost_worker_replays_its_requests_on_the_others_then_fails_them_past_the_limit(harness):
    h = harness(workers=2, server="max_replays = 1")
    first, second = h.workers
    request = h.admit("lstm", {"tokens": [1, 2, 3]})
    h.schedule(first)
    del h.core.workers[first.worker_id]  # the pool forgets it first
    [replayed] = h.core.worker_lost(first, "silent")
    assert isinstance(replayed, Replayed) and replayed.request is not request
    assert replayed.request.failures == 1 and h.core.requests.get(b"client", request.request_id) is replayed.request
    h.schedule(second)
    del h.core.workers[second.worker_id]
    [failed] = h.core.worker_lost(second, "silent")
    assert isinstance(failed, Failed) and failed.error.code == INTERNAL and "2 times" in failed.error.message
    assert len(h.core.requests) == 0


def test_a_lost_last_worker_fails_its_requests_with_worker_lost(harness):
    h = harness()
    worker = h.workers[0]
    h.admit("lstm", {"tokens": [1, 2]})
    h.schedule(worker)
    del h.core.workers[worker.worker_id]
    [failed] = h.core.worker_lost(worker, "exited")
    assert isinstance(failed, Failed) and failed.error.code == WORKER_LOST


def test_the_expected_wait_counts_the_cells_the_workers_hold_until_they_complete(harness):
    """Cells issued to a worker are still ahead of a new request: admission refuses on them as on queued
    ones, and counts them off as their tasks complete (or their worker is lost)."""
    h = harness(server="max_queue_delay_ms = 250", workers=2)
    h.core.admission.estimator.assume(10.0)  # cells per second: 2 cells are a 200 ms wait, 3 are 300 ms
    first, second = h.workers
    h.admit("lstm", {"tokens": [1, 2, 3]})
    assert h.schedule(first) == 3
    assert (h.processor.unsubmitted_nodes, h.core.unfinished_nodes) == (0, 3)
    with pytest.raises(RequestError, match="estimated wait 300 ms") as refused:
        h.admit("lstm", {"tokens": [1]})
    assert refused.value.code == OVERLOADED
    h.complete_oldest(first)
    assert h.core.unfinished_nodes == 2
    h.admit("lstm", {"tokens": [1]})  # 200 ms
    assert h.schedule(second) == 1
    del h.core.workers[first.worker_id]  # the pool forgets it first
    h.core.worker_lost(first, "killed")
    assert second.nodes_in_flight == 1 and h.processor.unsubmitted_nodes == 3  # the replay's 3 cells queue again
    assert h.core.unfinished_nodes == 4


def test_a_replayed_request_still_counts_as_arrived_before_those_admitted_after_it(harness):
    """A replay is admitted again at the end of the table but keeps its arrival: a request answered
    while it runs was answered before a request that arrived earlier (`leaving_requests`)."""
    h = harness(workers=2)
    first, second = h.workers
    h.admit("lstm", {"tokens": [1] * 8}, name="oldest", arrival=1.0)
    h.schedule(first)
    short = h.admit("lstm", {"tokens": [1]}, name="short", arrival=2.0)
    h.admit("lstm", {"tokens": [1] * 8}, name="long", arrival=3.0)
    del h.core.workers[first.worker_id]
    [replayed] = h.core.worker_lost(first, "killed")
    answered = []
    while not answered:
        h.schedule(second)
        task = second.tasks[min(second.tasks)]
        outcomes = h.core.tasks_finished(second, CompletionNotice(second.worker_id, [task.task_id], {}, 0))
        answered = [o for o in outcomes if isinstance(o, Answered)]
    assert [o.request for o in answered] == [short] and answered[0].left_early
    assert not replayed.request.done


def test_a_burst_is_admitted_in_order_its_limits_counting_the_requests_before_each(harness):
    """Each request of a burst is checked in turn: a refusal costs that request alone, an id repeated
    within the burst is refused, and the limits count the burst's earlier requests. Those admitted get
    their records together, in the burst's order."""
    h = harness(server="max_queued_requests = 3\nmax_queued_nodes = 5")

    def infer(client: bytes, request_id: int, tokens) -> tuple:
        return client, request_id, {"model": "lstm", "inputs": {"tokens": tokens}}, 0.0

    results = h.core.admit_burst(
        [
            infer(b"c", 1, [1, 2]),
            infer(b"c", 2, "x"),  # invalid: refused alone
            infer(b"c", 1, [1, 2]),  # the same id as the first, in the same burst
            infer(b"c", 3, [1]),
            infer(b"c", 4, [1, 2, 3]),  # 3 cells queued before it: 3 more exceed the 5
            infer(b"d", 1, [1]),
            infer(b"d", 2, [1]),  # 3 requests in flight before it
        ]
    )
    codes = [result.code if isinstance(result, RequestError) else "ok" for result in results]
    assert codes == ["ok", "INVALID_INPUT", BAD_REQUEST, "ok", OVERLOADED, "ok", OVERLOADED]
    assert "cells queued" in results[4].message and "requests in flight" in results[6].message
    admitted = [result for result in results if not isinstance(result, RequestError)]
    assert [(r.client, r.request_id) for r in admitted] == [(b"c", 1), (b"c", 3), (b"d", 1)]
    assert [r.request_id for r in h.core.table.live.values()] == [1, 3, 1]  # recorded in the burst's order
    assert len(h.core.requests) == 3 and h.core.processor.unsubmitted_nodes == 4
    queue = h.core.scheduler.queues["lstm/layer0"]
    assert queue.row[: queue.size].tolist() == [r.row for r in admitted]


def test_the_request_limit_counts_requests_routed_to_workers_whole(harness):
    h = harness(server="max_queued_requests = 3")
    message = {"model": "lstm", "inputs": {"tokens": [1]}}
    results = h.core.admit_burst([(b"c", i, message, 0.0) for i in range(2)], routed=2)
    assert [type(result) for result in results] == [Request, RequestError]
    assert results[1].code == OVERLOADED and "3 requests in flight (limit 3)" in results[1].message
    with pytest.raises(RequestError, match="request id 0 is already in flight"):
        h.core.check_id(b"c", 0, ())
    with pytest.raises(RequestError, match="request id 7 is already in flight"):
        h.core.check_id(b"c", 7, {(b"c", 7)})
    assert h.core.in_flight == 1


def test_a_bug_in_a_models_plan_fails_its_request_and_not_the_burst(harness, monkeypatch):
    h = harness()
    model = h.core.versions.resolve("lstm", None, None)
    plan = model.plan
    monkeypatch.setattr(model, "plan", lambda inputs: plan(inputs) if inputs["tokens"] != [666] else 1 / 0)
    results = h.core.admit_burst([(b"c", i, {"model": "lstm", "inputs": {"tokens": tokens}}, 0.0) for i, tokens in
                                  enumerate([[1], [666], [2]])])  # fmt: skip
    assert [getattr(result, "code", "ok") for result in results] == ["ok", INTERNAL, "ok"]
    assert "ZeroDivisionError" in results[1].message and len(h.core.requests) == 2
