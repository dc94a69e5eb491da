"""Partial replies in the batching core, turn by turn (tests/harness.py): one per streamed request and
turn, held while its client reads late, the last one before the answer, and a restart after a replay.

The harness's workers leave token 0 in the arena at every step, never EOS: a request decodes its `max_len`."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL_SEQ2SEQ

from batchmaker.common.notice import CompletionNotice
from batchmaker.common.protocol import INTERNAL
from batchmaker.manager.batching.outcomes import Answered, Failed, Outcome, Partial, Replayed
from batchmaker.manager.batching.records import Request
from batchmaker.manager.batching.worker_handle import WorkerHandle

MAX_LEN = 12


@pytest.fixture
def harness(make_harness):
    return lambda **kwargs: make_harness(SMALL_SEQ2SEQ, **kwargs)


def admit(h, name: str, stream: bool = True) -> Request:
    message = {"model": "seq2seq", "inputs": {"tokens": [5, 6, 7], "max_len": MAX_LEN}, "stream": stream}
    return h.core.admit(b"client", name, message, 0.0)


def turn(h, worker: WorkerHandle, client_waiting: bool = False) -> list[Outcome]:
    """One event loop turn: Schedule, the worker finishes every task in flight, then the turn's partials."""
    h.schedule(worker)
    outcomes: list[Outcome] = []
    while worker.tasks:
        task_id = min(worker.tasks)
        outcomes += h.core.tasks_finished(worker, CompletionNotice(worker.worker_id, [task_id], {}, 0))
    return outcomes + h.core.partials(lambda client: client_waiting)


def run(h, worker: WorkerHandle) -> list[list[Outcome]]:
    """Turns until every request is concluded; the outcomes of each turn."""
    turns = []
    while h.core.requests:
        turns.append(turn(h, worker))
        assert len(turns) < 10 * MAX_LEN, "the requests never ended"
    return turns


def tokens(partials: list[Partial]) -> list[int]:
    return [int(t) for p in partials for t in p.outputs["tokens"]]


def test_one_partial_per_request_and_turn_then_the_answer(harness):
    h = harness(max_tasks_to_submit=4)  # several decoder steps complete in one turn
    streamed, plain = admit(h, "streamed"), admit(h, "plain", stream=False)
    turns = run(h, h.workers[0])
    partials = [[o for o in outcomes if isinstance(o, Partial)] for outcomes in turns]
    assert all(len(p) <= 1 and all(o.request is streamed for o in p) for p in partials)
    assert any(len(p[0].outputs["tokens"]) > 1 for p in partials if p)  # a turn's tokens went out together
    answers = [o for outcomes in turns for o in outcomes if isinstance(o, Answered)]
    assert {a.request for a in answers} == {streamed, plain}
    final = next(a for a in answers if a.request is streamed)
    flat = [o for outcomes in turns for o in outcomes if o.request is streamed]
    assert isinstance(flat[-2], Partial) and flat[-1] is final  # the last tokens come just before the answer
    assert tokens([o for o in flat if isinstance(o, Partial)]) == final.outputs["tokens"].tolist() == [0] * MAX_LEN
    assert not any(o.restarted for o in flat if isinstance(o, Partial))


def test_a_client_that_reads_late_gets_its_news_in_one_partial_later(harness):
    h = harness(max_tasks_to_submit=2)
    worker = h.workers[0]
    request = admit(h, "s")
    held = [turn(h, worker, client_waiting=True) for _ in range(3)]
    assert not [o for outcomes in held for o in outcomes]  # nothing while its replies wait unread
    [partial] = h.core.partials(lambda client: False)
    assert isinstance(partial, Partial) and partial.request is request
    assert len(partial.outputs["tokens"]) == len(request.unfolded.state.tokens) > 1
    assert h.core.partials(lambda client: False) == []  # nothing new since


def test_a_replayed_stream_says_it_restarted_on_its_next_partial(harness):
    h = harness(workers=2, max_tasks_to_submit=2)
    first, second = h.workers
    admit(h, "s")
    before = [o for _ in range(3) for o in turn(h, first) if isinstance(o, Partial)]
    assert before and tokens(before)
    h.workers.remove(first)
    del h.core.workers[first.worker_id]
    [replayed] = h.core.worker_lost(first, "exited")
    assert isinstance(replayed, Replayed) and replayed.request.restarted
    after = [o for outcomes in run(h, second) for o in outcomes]
    partials = [o for o in after if isinstance(o, Partial)]
    assert partials[0].restarted and not any(p.restarted for p in partials[1:])
    assert tokens(partials) == after[-1].outputs["tokens"].tolist()  # the restarted stream adds up alone


def test_a_replay_before_any_partial_is_no_restart(harness):
    h = harness(workers=2)
    first, second = h.workers
    admit(h, "s")
    h.schedule(first)  # its first cells are in flight on `first`; nothing observed yet
    h.workers.remove(first)
    del h.core.workers[first.worker_id]
    [replayed] = h.core.worker_lost(first, "exited")
    assert not replayed.request.restarted
    partials = [o for outcomes in run(h, second) for o in outcomes if isinstance(o, Partial)]
    assert partials and not any(p.restarted for p in partials)


def test_a_model_whose_partials_fail_fails_only_that_request(harness, monkeypatch):
    h = harness()
    model = h.models["seq2seq"]

    def broken(graph, results, start):
        raise ValueError("no partials today")

    monkeypatch.setattr(model, "partial_outputs", broken)
    admit(h, "s")
    admit(h, "plain", stream=False)
    outcomes = [o for outcomes in run(h, h.workers[0]) for o in outcomes]
    failed = [o for o in outcomes if isinstance(o, Failed)]
    assert [f.request.request_id for f in failed] == ["s"]
    assert failed[0].error.code == INTERNAL and "ValueError in seq2seq: no partials today" in failed[0].error.message
    assert [o.request.request_id for o in outcomes if isinstance(o, Answered)] == ["plain"]
    assert np.array_equal(next(o for o in outcomes if isinstance(o, Answered)).outputs["tokens"], [0] * MAX_LEN)
