"""How long each task kept its worker busy, as the worker times it (worker.notices), in the completion
notice (common.task), and what the manager does with it: lane tasks' step costs, never admission."""

from __future__ import annotations

import msgpack
import pytest
from test_scheduler import lstm_models
from test_tree_models import TREE_MODELS, tree

from batchmaker.common.models.tree import NO_WORD
from batchmaker.common.notice import CompletionNotice, decode_notice, encode_notice
from batchmaker.common.task import LaneTaskMessage
from batchmaker.worker.notices import InProgressFIFO

CELL = "lstm/layer0"


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_task_is_busy_from_its_receipt_or_the_previous_end_to_its_own_end():
    """Work queued behind a running task is not counted twice, idle time between tasks not at all,
    and tasks found finished together share their span."""
    clock = StepClock()
    fifo = InProgressFIFO(clock)
    fifo.push(1, [])
    clock.now = 1.0
    fifo.push(2, [])  # queued behind task 1
    clock.now = 3.0
    assert [(t.task_id, t.busy_us) for t in fifo.pop_finished(1)] == [(1, 3_000_000)]
    clock.now = 4.0
    assert [(t.task_id, t.busy_us) for t in fifo.pop_finished(1)] == [(2, 1_000_000)]
    clock.now = 10.0
    fifo.push(3, [])  # after 6 s idle
    clock.now = 10.5
    assert fifo.pop_finished(1)[0].busy_us == 500_000
    fifo.push(4, [])
    fifo.push(5, [])
    clock.now = 12.5
    assert [t.busy_us for t in fifo.pop_finished(2)] == [1_000_000, 1_000_000]


def test_a_notice_carries_a_busy_time_per_task_or_none():
    timed = CompletionNotice(3, [5, 6], {}, 2, busy_us=[120, 80], key=b"k")
    assert decode_notice(encode_notice(timed)).busy_us == [120, 80]
    assert decode_notice(encode_notice(CompletionNotice(3, [5], {}, 1, key=b"k"))).busy_us == []
    for busy in ([1], ["x", 2], 7):
        bad = msgpack.packb([3, b"k", [5, 6], {}, 2, [], busy, 0])
        with pytest.raises(ValueError, match="busy times"):
            decode_notice(bad)


def test_lane_step_costs_go_by_the_worker_and_the_rest_by_the_manager(make_harness):
    """However late the manager reads a notice, a lane task's steps cost what the worker says. A task of
    waves, and a notice the worker did not time, go by the manager's own time for the task."""
    h = make_harness(lstm_models() + TREE_MODELS, max_steps_per_task=16, full_task_s={CELL: 1e-3})
    worker = h.workers[0]
    for _ in range(4):
        h.admit("lstm", {"tokens": [1, 2, 3, 4]})
    h.schedule(worker)
    task = worker.tasks[min(worker.tasks)]
    # 2 steps of 1 ms fill the 2 ms join delay
    assert isinstance(task.message, LaneTaskMessage) and task.step_nodes == [4, 4]
    h.core.tasks_finished(worker, CompletionNotice(worker.worker_id, [task.task_id], {}, 1, busy_us=[400]))
    assert h.core.scheduler.step_costs.seconds(CELL, 4) == pytest.approx(200e-6)
    h.schedule(worker)  # what is left of the lanes in one task now: 2 steps of 200 µs
    assert worker.tasks[max(worker.tasks)].step_nodes == [4, 4]

    h.admit("bin", tree([NO_WORD, 1, NO_WORD, 2, 3], [-1, 0, 0, 2, 2]))
    ran = set()
    while h.schedule(worker) or worker.tasks:  # waves and an untimed notice: the manager's time, far below 1000 s
        oldest = worker.tasks[min(worker.tasks)]
        busy = [10**9] if not isinstance(oldest.message, LaneTaskMessage) else []
        h.core.tasks_finished(worker, CompletionNotice(worker.worker_id, [oldest.task_id], {}, 1, busy_us=busy))
        ran.add((oldest.spec.key, oldest.step_sizes[0]))
    assert any(key.startswith("bin/") for key, _ in ran)
    assert all(h.core.scheduler.step_costs.seconds(key, size) < 1.0 for key, size in ran)
