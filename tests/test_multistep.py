"""Multi-step tasks, decision by decision on the real batching core (tests/harness.py): how many
steps a task takes, counted in steps, never timed."""

from __future__ import annotations

import msgpack
import pytest
from conftest import write_config
from harness import Harness, step_sizes
from test_scheduler import lstm_models

from batchmaker.common.protocol import CANCELLED
from batchmaker.common.task import LaneTaskMessage, decode_task, encode_task

LSTM = lstm_models()
CELL = "lstm/layer0"


@pytest.fixture
def harness(make_harness):
    """A harness whose workers say a step costs `step_us` (their warm-up timing), multi-step on."""

    def make(step_us: float = 100.0, max_steps_per_task: int = 16, **kwargs):
        return make_harness(LSTM, max_steps_per_task=max_steps_per_task, full_task_s={CELL: step_us / 1e6}, **kwargs)

    return make


def tokens(length: int) -> dict:
    return {"tokens": list(range(1, length + 1))}


def sent_steps(h) -> list[list[int]]:
    return [step_sizes(message) for _, message in h.sent]


def run_to_the_end(h, worker) -> None:
    while h.schedule(worker) or worker.tasks:
        h.complete_oldest(worker)


def test_a_lone_request_runs_in_one_task(harness):
    """2000 µs of join delay over 100 µs a step: up to 20 steps, so 10 steps fit one task."""
    h = harness()
    worker = h.workers[0]
    request = h.admit("lstm", tokens(10))
    assert h.schedule(worker) == 1
    assert sent_steps(h) == [[1] * 10]
    h.complete_oldest(worker)
    assert h.finished == [(request, None)]
    assert not worker.tasks and h.slots_in_use() == 0


def test_max_steps_per_task_bounds_a_task(harness):
    h = harness(step_us=1.0, max_steps_per_task=16)
    worker = h.workers[0]
    h.admit("lstm", tokens(40))
    h.schedule(worker)
    assert sent_steps(h) == [[1] * 16, [1] * 16, [1] * 8]
    run_to_the_end(h, worker)
    assert len(h.finished) == 1 and h.finished[0][1] is None


def test_the_join_delay_bounds_each_task(harness):
    """500 µs a step: 4 steps fill the 2000 µs; with two such tasks the worker holds the delay's work."""
    h = harness(step_us=500.0)
    worker = h.workers[0]
    h.admit("lstm", tokens(10))
    h.schedule(worker)
    assert sent_steps(h) == [[1] * 4, [1] * 4]
    run_to_the_end(h, worker)
    assert sent_steps(h)[2:] == [[1] * 2]


def test_one_step_per_task_when_turned_off(harness):
    h = harness(max_steps_per_task=1)
    worker = h.workers[0]
    h.admit("lstm", tokens(4))
    h.schedule(worker)
    assert sent_steps(h) == [[1], [1], [1], [1]]


def test_no_step_cost_no_multi_step_tasks(make_harness):
    """Without a timing of the cell type, the delay cannot be bounded: single steps."""
    h = make_harness(LSTM, max_steps_per_task=16)
    worker = h.workers[0]
    h.admit("lstm", tokens(3))
    h.schedule(worker)
    assert sent_steps(h) == [[1], [1], [1]]


def test_lanes_that_end_drop_out_and_the_batch_shrinks(harness):
    h = harness()
    worker = h.workers[0]
    short, long = h.admit("lstm", tokens(2)), h.admit("lstm", tokens(5))
    h.schedule(worker)
    assert sent_steps(h) == [[2, 2, 1, 1, 1]]
    h.complete_oldest(worker)
    assert [request for request, _ in h.finished] == [short, long]


def test_lanes_go_on_while_most_of_the_batch_can_when_work_waits(harness):
    """Five lanes, batches of at most 4: the fifth waits for the first task, whose lanes go on as long as
    three quarters of them can (the one-step lane leaves after its step); the fifth runs in the next."""
    h = harness()
    worker = h.workers[0]
    for length in (1, 3, 3, 3, 3):
        h.admit("lstm", tokens(length))
    h.schedule(worker)
    assert sent_steps(h) == [[4, 3, 3], [1, 1, 1]]
    run_to_the_end(h, worker)
    assert len(h.finished) == 5 and all(error is None for _, error in h.finished)


def test_a_request_arriving_during_a_multi_step_task_joins_the_next_task(harness):
    h = harness(step_us=100.0, max_tasks_to_submit=1)
    worker = h.workers[0]
    first = h.admit("lstm", tokens(30))
    h.schedule(worker)
    assert sent_steps(h) == [[1] * 16]
    second = h.admit("lstm", tokens(3))
    h.schedule(worker)  # the new lane joins the task issued behind the first, and leaves it after 3 steps
    assert sent_steps(h)[1] == [2, 2, 2] + [1] * 11
    assert sorted(h.requests_in(h.in_flight(worker)[1]), key=str) == sorted(
        [first.request_id, second.request_id], key=str
    )


def test_a_worker_holding_two_tasks_and_the_join_delay_of_work_gets_no_more(harness):
    """Two tasks of 16 steps of 100 µs hold the worker 3200 µs, more than the 2000 µs delay: a request
    arriving meanwhile waits for that work, not for more; once one completes, the rest is sent."""
    h = harness(step_us=100.0)
    worker = h.workers[0]
    h.admit("lstm", tokens(40))
    h.schedule(worker)
    assert sent_steps(h) == [[1] * 16, [1] * 16]
    assert h.schedule(worker) == 0
    h.complete_oldest(worker)
    h.schedule(worker)
    assert sent_steps(h)[2:] == [[1] * 8]
    run_to_the_end(h, worker)
    assert len(h.finished) == 1 and h.finished[0][1] is None


def test_a_cancel_inside_a_multi_step_task_frees_its_rows_when_the_task_ends(harness):
    h = harness()
    worker = h.workers[0]
    request = h.admit("lstm", tokens(10))
    h.schedule(worker)
    h.cancel(request)
    assert h.finished[0][0] is request and h.finished[0][1].code == CANCELLED
    assert h.slots_in_use() > 0  # the task still runs and writes its rows
    h.complete_oldest(worker)
    assert h.slots_in_use() == 0 and not h.table.live


def test_a_lost_worker_multi_step_task_is_replayed_on_another(harness):
    h = harness(workers=2, max_tasks_to_submit=1)
    lost, other = h.workers
    request = h.admit("lstm", tokens(6))
    h.schedule(lost)
    assert sent_steps(h) == [[1] * 6]
    del h.core.workers[lost.worker_id]
    h._record(h.core.worker_lost(lost, "test"))
    h.schedule(other)
    assert sent_steps(h)[1] == [1] * 6
    h.complete_oldest(other)
    assert [(done.request_id, error) for done, error in h.finished] == [(request.request_id, None)]


def test_padded_policy_runs_multi_step_tasks_and_graph_policy_single_steps(tmp_path):
    """Padded groups run in lockstep, so their lanes go on together; the graph policy's agenda
    chooses again after every step, which is the point of it."""
    steps = {}
    for policy in ("padded", "graph"):
        (tmp_path / policy).mkdir()
        config = write_config(tmp_path / policy, LSTM, scheduler=f'policy = "{policy}"')
        h = Harness(config, max_steps_per_task=16, full_task_s={CELL: 1e-6})
        try:
            worker = h.workers[0]
            h.admit("lstm", tokens(4))
            h.admit("lstm", tokens(3))
            h.schedule(worker)
            steps[policy] = sent_steps(h)
        finally:
            h.close()
    assert steps == {"padded": [[2] * 10], "graph": [[2], [2], [2], [1]]}


def test_a_chain_runs_as_lane_tasks_whose_message_does_not_grow_with_its_steps_but_by_their_tokens(harness):
    """A lane task names its lanes and their steps: from 2 steps to 16, its message grows by the 14 tokens
    the later steps read (8 bytes each) and the steps' count, nothing per step beyond them."""
    sizes = {}
    for steps in (2, 16):
        h = harness(max_steps_per_task=steps)
        h.admit("lstm", tokens(32))  # the lane goes on after either task: neither downloads its final state
        task = h.core.schedule(h.workers[0])[0]
        frame = encode_task(task.message)
        message = decode_task(frame)
        assert isinstance(message, LaneTaskMessage) and message.steps.tolist() == [steps]
        assert msgpack.unpackb(frame)[2] == "lanes"
        sizes[steps] = len(frame)
    assert sizes[16] - sizes[2] == 14 * 8
