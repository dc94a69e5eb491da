"""The join delay chosen by load (manager.batching.join_delay): the rule on its own, the fixed cost a task it
goes by (manager.batching.step_costs), and the steps the scheduler gives tasks of lanes and of waves by it,
decision by decision on the real batching core (tests/harness.py), counted in steps, never timed."""

from __future__ import annotations

import pytest
from harness import step_sizes
from test_scheduler import lstm_models
from test_tree_models import TREE_MODELS, tree

from batchmaker.common.models.tree import NO_WORD
from batchmaker.manager.batching.join_delay import JoinDelay
from batchmaker.manager.batching.step_costs import StepCosts

CELL = "lstm/layer0"
MS = 1e-3


def delay(fixed_s: float | None, ready: int, floor_us: int = 2000, target_ms: int = 100) -> float:
    """The join delay of a task at batch 64 with `ready` nodes of a batch of 64, the manager's fixed cost
    a task `fixed_s` (None: not measured yet)."""
    costs = StepCosts()
    if fixed_s is not None:
        costs.record_manager("sent", fixed_s)
    return JoinDelay(floor_us, target_ms, costs).seconds(CELL, 64, ready, 64)


def test_while_every_ready_node_fits_the_task_the_floor_holds_whatever_a_task_costs():
    for ready in (1, 16, 64):
        assert delay(5 * MS, ready) == pytest.approx(2 * MS)


def test_a_second_full_batch_waiting_makes_the_fixed_cost_a_tenth_of_the_task():
    assert delay(1 * MS, 128) == pytest.approx(10 * MS)
    assert delay(1 * MS, 1000) == pytest.approx(10 * MS)  # more waiting than that: the same


def test_between_the_delay_rises_with_the_nodes_left_out():
    """Half a batch left out: half way from the floor to the full-load delay; three quarters, three quarters."""
    assert delay(1 * MS, 96) == pytest.approx(6 * MS)
    assert delay(1 * MS, 112) == pytest.approx(8 * MS)


def test_the_latency_target_bounds_the_delay_at_a_fifth():
    assert delay(10 * MS, 128) == pytest.approx(20 * MS)
    assert delay(10 * MS, 128, target_ms=50) == pytest.approx(10 * MS)


def test_a_fixed_cost_not_measured_or_small_keeps_the_floor():
    assert delay(None, 128) == pytest.approx(2 * MS)
    assert delay(0.1 * MS, 128) == pytest.approx(2 * MS)  # a tenth of the floor's compute already


def test_a_floor_above_the_target_share_stands():
    assert delay(10 * MS, 128, floor_us=50_000, target_ms=100) == pytest.approx(50 * MS)


def test_the_fixed_cost_is_the_managers_stages_and_the_workers_intercept():
    """Lane tasks timed by the worker at 0.3 ms plus 0.2 ms a step, of 1 and 5 steps: the intercept is the
    worker's fixed cost; the manager's stages add up."""
    costs = StepCosts()
    for _ in range(200):
        for steps in (1, 5):
            costs.record(CELL, 64, steps, 0.3 * MS + steps * 0.2 * MS, by_worker=True)
    assert costs.fixed_seconds(CELL, 64) == pytest.approx(0.3 * MS)
    costs.record_manager("sent", 0.4 * MS)
    costs.record_manager("completed", 0.1 * MS)
    assert costs.fixed_seconds(CELL, 64) == pytest.approx(0.8 * MS)
    assert costs.fixed_seconds(CELL, 32) == pytest.approx(0.5 * MS)  # no fit at another batch size


def test_tasks_of_one_length_or_timed_by_the_manager_give_no_intercept():
    costs = StepCosts()
    for _ in range(50):
        costs.record(CELL, 64, 3, 1 * MS, by_worker=True)  # no spread of steps: no line to fit
        costs.record(CELL, 32, 1 + _ % 5, 1 * MS)  # the manager's timings: not the worker's fixed cost
    assert costs.fixed_seconds(CELL, 64) == 0.0
    assert costs.fixed_seconds(CELL, 32) == 0.0


def test_a_smaller_measured_intercept_never_goes_below_zero():
    costs = StepCosts()
    for _ in range(100):
        for steps in (1, 5):
            costs.record(CELL, 64, steps, steps * 0.25 * MS - 0.15 * MS, by_worker=True)  # a line through -0.15 ms
    assert costs.fixed_seconds(CELL, 64) == 0.0


def tokens(length: int) -> dict:
    return {"tokens": list(range(1, length + 1))}


def sent_steps(h) -> list[list[int]]:
    return [step_sizes(message) for _, message in h.sent]


@pytest.mark.parametrize(
    ("lanes", "fixed_s", "steps"), [(8, None, 4), (8, 1 * MS, 16), (6, 1 * MS, 12), (4, 1 * MS, 4)]
)
def test_lanes_left_out_get_longer_tasks_once_the_fixed_cost_is_measured(make_harness, lanes, fixed_s, steps):
    """Lanes for batches of 4, 500 µs a step: the floor's 2 ms holds 4 steps. With a fixed cost of 1 ms a task
    measured, a second batch waiting wants 10 ms: 20 steps, bounded by max_steps_per_task; half a batch
    waiting, 6 ms: 12 steps; nobody waiting, the floor."""
    h = make_harness(lstm_models(), max_steps_per_task=16, full_task_s={CELL: 500e-6}, max_tasks_to_submit=1)
    if fixed_s is not None:
        h.core.scheduler.step_costs.record_manager("sent", fixed_s)
    for _ in range(lanes):
        h.admit("lstm", tokens(30))
    h.schedule(h.workers[0])
    assert sent_steps(h) == [[4] * steps]  # lanes all of one length: the three-quarters bound does not cut


def test_a_lone_request_keeps_the_floor_however_dear_a_task(make_harness):
    h = make_harness(lstm_models(), max_steps_per_task=16, full_task_s={CELL: 500e-6}, max_tasks_to_submit=1)
    h.core.scheduler.step_costs.record_manager("sent", 5 * MS)
    h.admit("lstm", tokens(30))
    h.schedule(h.workers[0])
    assert sent_steps(h) == [[1] * 4]


def complete_binary_tree(depth: int) -> dict:
    tokens: list[int] = []
    parents: list[int] = []

    def node(parent: int, below: int) -> None:
        index = len(tokens)
        parents.append(parent)
        tokens.append(1 if below == 0 else NO_WORD)
        if below:
            node(index, below - 1)
            node(index, below - 1)

    node(-1, depth)
    return tree(tokens, parents)


@pytest.mark.parametrize("fixed_s", [None, 5 * MS])
def test_a_tree_wave_task_nobody_could_join_keeps_the_floor(make_harness, fixed_s):
    """A tree of 8 leaves: its internal nodes' first wave fills a batch of 4 and the task goes on with the next
    waves, as a task of waves does only when nothing else could join it. At 1 ms a step the floor's 2 ms holds
    two waves, however dear a task."""
    h = make_harness(TREE_MODELS, max_steps_per_task=16, full_task_s={"bin/internal": 1 * MS, "bin/leaf": 1 * MS})
    worker = h.workers[0]
    h.admit("bin", complete_binary_tree(3))
    h.schedule(worker)
    while worker.tasks:
        h.complete_oldest(worker)  # the leaves
    if fixed_s is not None:
        h.core.scheduler.step_costs.record_manager("sent", fixed_s)
    sent = len(h.sent)
    h.schedule(worker)
    assert sent_steps(h)[sent] == [4, 2]
