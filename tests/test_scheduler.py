"""Scheduling decisions of Algorithm 1, replayed step by step on an in-process manager core."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_tree_models import TREE_MODELS, tree

from batchmaker.common.models.tree import NO_WORD
from batchmaker.common.protocol import CANCELLED


def lstm_models(batch_sizes: str = "[1, 2, 3, 4]", layers: int = 1, cells: str = "") -> str:
    return f"""
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
vocab_size = 100
embedding_size = 8
hidden_size = 8
num_layers = {layers}
batch_sizes = {batch_sizes}
{cells}
"""


@pytest.fixture
def harness(make_harness):
    def make(models: str | None = None, **kwargs):
        return make_harness(models or lstm_models(), **kwargs)

    return make


def test_figure5_requests_join_and_leave(harness):
    """The paper's Figure 5: 8 requests, batch size 4, one cell step per time unit.

    req1-4 (lengths 2, 3, 3, 5) arrive at t=0; req5 (4) at t=1.5; req6 and req7 (3 each)
    at t=2.5; req8 (2) at t=3.5. Cellular batching lets req5 join at t=2, right after
    req1 leaves, and req6/req7 at t=3 after req2/req3 leave.
    """
    h = harness(max_tasks_to_submit=1)
    worker = h.workers[0]
    arrivals = [
        (0.0, "req1", 2), (0.0, "req2", 3), (0.0, "req3", 3), (0.0, "req4", 5),
        (1.5, "req5", 4), (2.5, "req6", 3), (2.5, "req7", 3), (3.5, "req8", 2),
    ]  # fmt: skip
    timeline, finished_at = [], {}
    total = len(arrivals)
    t = 0
    while len(finished_at) < total:
        while arrivals and arrivals[0][0] <= t:
            arrival, name, length = arrivals.pop(0)
            h.admit("lstm", {"tokens": list(range(1, length + 1))}, name=name, arrival=arrival)
        assert h.schedule(worker) == 1
        timeline.append(sorted(h.requests_in(h.in_flight(worker)[0])))
        h.complete_oldest(worker)
        t += 1
        for request, error in h.finished:
            assert error is None
            finished_at.setdefault(request.request_id, t)

    assert timeline == [
        ["req1", "req2", "req3", "req4"],
        ["req1", "req2", "req3", "req4"],
        ["req2", "req3", "req4", "req5"],  # req5 joins as req1 leaves
        ["req4", "req5", "req6", "req7"],  # req6, req7 join as req2, req3 leave
        ["req4", "req5", "req6", "req7"],  # full batch: req8 waits for a free row
        ["req5", "req6", "req7", "req8"],
        ["req8"],
    ]
    assert finished_at == {
        "req1": 2, "req2": 3, "req3": 3, "req4": 5, "req5": 6, "req6": 6, "req7": 6, "req8": 7,
    }  # fmt: skip
    assert h.slots_in_use() == 0


def test_batch_issues_successive_steps_ahead_on_one_worker(harness):
    """Same-worker dependencies are met at submission, so one Batch call runs a chain 5 steps ahead."""
    h = harness()
    worker = h.workers[0]
    request = h.admit("lstm", {"tokens": list(range(1, 9))})
    assert h.schedule(worker) == 5
    tasks = h.in_flight(worker)
    assert [t.nodes for t in tasks] == [1] * 5
    assert h.table.issued[request.row] == 5
    # Each step reads the rows the previous step writes (h and c, overwritten in place), and step 0 reads zeros.
    messages = [message for _, message in h.sent]  # lane tasks of one step each (single steps here)
    assert [entry.first.slots.tolist()[0] for entry in messages[0].inputs[1:]] == [0, 0]
    for previous, message in itertools.pairwise(messages):
        written = sorted(slots.tolist()[0] for _, slots in previous.outputs)
        assert sorted(entry.first.slots.tolist()[0] for entry in message.inputs[1:]) == written
    # tokens inline
    assert [m.inputs[0].first.values[1] for m in messages] == [np.int64(t).tobytes() for t in range(1, 6)]
    while worker.tasks:
        h.complete_oldest(worker)
        h.schedule(worker)
    assert h.finished and h.finished[0][1] is None
    assert h.slots_in_use() == 0


@pytest.mark.parametrize("affinity", ["subgraph", "request"])
def test_subgraph_stays_pinned_to_its_worker(harness, affinity):
    h = harness(workers=2, affinity=affinity)
    first, second = h.workers
    request = h.admit("lstm", {"tokens": [1, 2, 3, 4, 5, 6, 7]})
    h.schedule(first)
    assert h.table.home[request.row] == first.worker_id and h.table.inflight[request.row] == 5
    assert h.schedule(second) == 0  # its remaining nodes wait for `first`
    other = h.admit("lstm", {"tokens": [1, 2]})
    assert h.schedule(second) == 2
    assert all(h.processor.requests_of(t) == [other] for t in h.in_flight(second))
    while first.tasks:
        h.complete_oldest(first)
    assert h.table.inflight[request.row] == 0  # unpinned once nothing runs
    assert request.unfolded.plan.nodes - h.table.issued[request.row] == 2


def test_cell_type_choice_full_batch_then_idle_type_then_priority(harness):
    """Schedule(): a type with a full batch first, then a type with no running task, then priority."""
    cells = """
[models.lstm.cells.layer1]
priority = 5
"""
    h = harness(
        lstm_models(batch_sizes="[1, 2]", layers=2, cells=cells), max_tasks_to_submit=1, workers=2, affinity="request"
    )
    a, b = h.workers
    layer0, layer1 = "lstm/layer0", "lstm/layer1"
    h.admit("lstm", {"tokens": [1]})
    h.admit("lstm", {"tokens": [2]})
    # Only layer0 has ready nodes (a full batch of 2).
    h.schedule(a)
    assert h.in_flight(a)[0].spec.key == layer0
    # Both layer-1 nodes became ready at submission: layer1 has a full batch and wins.
    h.admit("lstm", {"tokens": [3]})
    h.admit("lstm", {"tokens": [4]})
    h.schedule(a)
    assert [t.spec.key for t in h.in_flight(a)] == [layer0, layer1]
    # Worker b: layer0 has a full batch (requests 3, 4) and no running task -> it is chosen.
    h.schedule(b)
    assert h.in_flight(b)[0].spec.key == layer0
    while a.tasks:
        h.complete_oldest(a)
    # a: layer1 has 2 ready nodes (full batch) on b's requests? They are pinned to b, so a gets nothing.
    assert h.schedule(a) == 0
    h.complete_oldest(b)
    # Now layer1 (priority 5) and nothing else is ready: it goes to b, where the values live.
    assert h.schedule(b) == 1
    assert h.in_flight(b)[0].spec.key == layer1
    h.complete_oldest(b)
    assert len(h.finished) == 4 and h.slots_in_use() == 0


def test_failed_request_drops_unsubmitted_nodes_and_frees_slots(harness):
    h = harness()
    worker = h.workers[0]
    doomed = h.admit("lstm", {"tokens": list(range(1, 20))})
    kept = h.admit("lstm", {"tokens": [1, 2, 3]})
    h.schedule(worker)
    h.cancel(doomed)
    assert h.finished[0][0] is doomed and h.finished[0][1].code == CANCELLED
    while worker.tasks:
        h.complete_oldest(worker)
        h.schedule(worker)
    assert [r for r, e in h.finished if e is None] == [kept]
    assert h.scheduler.queues["lstm/layer0"].size == 0
    assert h.scheduler.ready_nodes() == {"lstm/layer0": 0}
    assert h.slots_in_use() == 0


def test_a_task_of_waves_is_padded_to_a_supported_batch_size_and_a_lane_task_is_not(harness):
    """A tree's leaves run as a wave, padded to a supported batch size: padding rows read the zero slot and
    write the scratch slot. Lanes of one token run as a lane task of exactly their number."""
    h = harness(TREE_MODELS.replace("batch_sizes = [1, 2, 4]", "batch_sizes = [1, 4]"), max_tasks_to_submit=1)
    worker = h.workers[0]
    h.admit("bin", tree([NO_WORD, 1, NO_WORD, 2, 3], [-1, 0, 0, 2, 2]))  # three leaves
    h.schedule(worker)
    _sent_worker, message = h.sent[-1]
    assert message.batch_size == 4
    inputs = [slots.tolist() for _, slots, _, _, _ in message.inputs]
    outputs = [slots.tolist() for _, slots in message.outputs]
    assert all(row[3] == 0 for row in inputs)  # padding reads the zero slot
    assert all(row[3] == 1 for row in outputs)  # and writes the scratch slot
    assert len({s for row in outputs for s in row[:3]}) == 3 * len(outputs)  # real rows get distinct slots
    lanes = harness(lstm_models(batch_sizes="[1, 4]"), max_tasks_to_submit=1)
    for _ in range(3):
        lanes.admit("lstm", {"tokens": [1]})
    lanes.schedule(lanes.workers[0])
    assert lanes.sent[-1][1].steps.tolist() == [1, 1, 1]


def test_full_arena_limits_the_batch_instead_of_failing(harness):
    h = harness(rows=2 + 8)  # 8 free rows per arena
    worker = h.workers[0]
    for _ in range(6):
        h.admit("lstm", {"tokens": [1, 2]})
    h.schedule(worker)
    # A request holds 2 state rows (h, c) of the state arena while it runs: at most 4 run at once.
    running = {request.request_id for task in h.in_flight(worker) for request in h.processor.requests_of(task)}
    assert len(running) == 4 and sum(arena.in_use for arena in worker.slots.values()) == 8
    while worker.tasks or any(h.scheduler.ready_nodes().values()):
        if worker.tasks:
            h.complete_oldest(worker)
        h.schedule(worker)
    assert len(h.finished) == 6 and all(e is None for _, e in h.finished)
    assert h.slots_in_use() == 0


def test_unpinned_subgraph_moves_and_reads_the_first_workers_arena(harness):
    """Affinity "subgraph": once nothing of a chain runs, its next step may go to another worker,
    which gathers the previous step's h and c from the first worker's arena."""
    h = harness(workers=2, max_tasks_to_submit=2)
    first, second = h.workers
    request = h.admit("lstm", {"tokens": [1, 2, 3, 4]})
    assert h.schedule(first) == 2
    step1_rows = sorted(slots.tolist()[0] for _, slots in h.sent[-1][1].outputs)
    assert h.schedule(second) == 0  # pinned to `first` while its tasks run
    while first.tasks:
        h.complete_oldest(first)
    assert h.schedule(second) == 2
    _, message = h.sent[-2]
    remote_inputs = [entry.first.remote for entry in message.inputs if entry.first.remote]
    assert len(remote_inputs) == 2  # h and c of step 1 live on `first`
    assert all(peer == first.worker_id and positions.tolist() == [0] for (peer, _, _, positions), in remote_inputs)
    assert sorted(r[0][2].tolist()[0] for r in remote_inputs) == step1_rows
    assert request.rows.keys() == {first.worker_id, second.worker_id}  # its next values are written on `second`
    while second.tasks:
        h.complete_oldest(second)
    assert h.finished and h.finished[0][1] is None
    assert h.slots_in_use() == 0


def test_request_affinity_keeps_a_request_on_one_worker(harness):
    h = harness(workers=2, max_tasks_to_submit=2, affinity="request")
    first, second = h.workers
    h.admit("lstm", {"tokens": [1, 2, 3, 4]})
    h.schedule(first)
    while first.tasks:
        h.complete_oldest(first)
    assert h.schedule(second) == 0
    assert h.schedule(first) == 2


def test_a_request_moves_only_between_workers_of_its_host(harness):
    """A request with values on a host may move to another worker of that host, which reads them from
    the first worker's arena; a worker of another host gets only requests with no values anywhere."""
    h = harness(max_tasks_to_submit=2, hosts=[0, 1, 0])
    first, elsewhere, beside = h.workers
    request = h.admit("lstm", {"tokens": [1, 2, 3, 4]})
    assert h.schedule(first) == 2
    while first.tasks:
        h.complete_oldest(first)
    assert h.table.inflight[request.row] == 0
    assert h.schedule(elsewhere) == 0  # nothing runs, yet its values are on host 0
    assert h.schedule(beside) == 2
    assert beside.rows_read_from == {first.worker_id: 2}  # h and c of step 2, from `first`'s arena
    newcomer = h.admit("lstm", {"tokens": [5, 6]})
    assert h.schedule(elsewhere) == 2
    assert all(h.processor.requests_of(task) == [newcomer] for task in h.in_flight(elsewhere))
    assert not elsewhere.rows_read_from
    for worker in (beside, elsewhere):
        while worker.tasks:
            h.complete_oldest(worker)
            h.schedule(worker)
    assert sorted(r.request_id for r, e in h.finished if e is None) == sorted([request.request_id, newcomer.request_id])
    assert h.slots_in_use() == 0


def run_one_task_at_a_time(h, worker, total: int) -> list[list[str]]:
    """Schedule one task, complete it, and so on until `total` requests are answered: the requests of each task."""
    timeline = []
    while len(h.finished) < total:
        assert h.schedule(worker) == 1
        timeline.append(sorted(h.requests_in(h.in_flight(worker)[0])))
        h.complete_oldest(worker)
    assert all(error is None for _, error in h.finished)
    return timeline


def test_higher_priority_lanes_go_first_and_a_passed_lane_gets_its_turn(harness):
    """Batch size 2: H1 and H2 (priority 1) take every task from L1 (priority 0, queued first)
    until L1 has been left out of MAX_PASSES tasks; it then joins the next one, before either."""
    from batchmaker.manager.batching.cell_queues import MAX_PASSES

    h = harness(lstm_models("[1, 2]"), max_tasks_to_submit=1)
    worker = h.workers[0]
    h.admit("lstm", {"tokens": list(range(1, 21))}, name="L1")
    for name in ("H1", "H2"):
        h.admit("lstm", {"tokens": list(range(1, 13))}, name=name, priority=1)
    timeline = run_one_task_at_a_time(h, worker, 3)
    high = ["H1", "H2"]
    expected = [high] * MAX_PASSES + [["H1", "L1"]] + [high] * 3 + [["H2", "L1"]] + [["L1"]] * 18
    assert timeline == expected
    assert [request.request_id for request, _ in h.finished] == ["H1", "H2", "L1"]


def test_equal_priorities_keep_the_oldest_first_order(harness):
    """Priorities that are all alike (here all 3) change nothing: the oldest lanes go first."""
    h = harness(lstm_models("[1, 2]"), max_tasks_to_submit=1)
    worker = h.workers[0]
    for name, length in (("A", 3), ("B", 2), ("C", 2)):
        h.admit("lstm", {"tokens": list(range(1, length + 1))}, name=name, priority=3)
    assert run_one_task_at_a_time(h, worker, 3) == [["A", "B"], ["A", "B"], ["A", "C"], ["C"]]


def test_a_lower_priority_lane_waits_at_most_max_passes_tasks(harness):
    """A stream of high-priority requests that always fills the batch: the low one still advances one
    step per MAX_PASSES + 1 tasks, and no high one is left out for it more than once in a row."""
    from batchmaker.manager.batching.cell_queues import MAX_PASSES

    h = harness(lstm_models("[1]"), max_tasks_to_submit=1)
    worker = h.workers[0]
    low = h.admit("lstm", {"tokens": [1, 2, 3]}, name="low", priority=-5)
    served_low_at = []
    for turn in range(3 * (MAX_PASSES + 1)):
        if not any(request.request_id.startswith("high") and not request.done for request in h.table.live.values()):
            h.admit("lstm", {"tokens": [1] * 50}, name=f"high{turn}", priority=5)
        assert h.schedule(worker) == 1
        if h.requests_in(h.in_flight(worker)[0]) == ["low"]:
            served_low_at.append(turn)
        h.complete_oldest(worker)
    assert served_low_at == [MAX_PASSES, 2 * MAX_PASSES + 1, 3 * MAX_PASSES + 2]
    assert low.done


def test_a_request_moves_only_to_a_worker_that_can_read_where_its_values_are(harness):
    """A worker that cannot read a peer's arenas (or has not yet said it can) gets no request with values
    there; a worker beside it that can takes the request, and once it can, it does too."""
    h = harness(max_tasks_to_submit=2, hosts=[0, 0, 0])
    first, blind, beside = h.workers
    blind.unread = {first.worker_id}
    request = h.admit("lstm", {"tokens": [1, 2, 3, 4, 5, 6]})
    assert h.schedule(first) == 2
    while first.tasks:
        h.complete_oldest(first)
    assert h.schedule(blind) == 0  # its values are on `first`
    newcomer = h.admit("lstm", {"tokens": [5, 6]})
    assert h.schedule(blind) == 2 and all(h.processor.requests_of(t) == [newcomer] for t in h.in_flight(blind))
    assert h.schedule(beside) == 2
    assert h.processor.requests_of(h.in_flight(beside)[0]) == [request]
    while beside.tasks:
        h.complete_oldest(beside)
    while blind.tasks:
        h.complete_oldest(blind)
    assert h.schedule(blind) == 0  # it still holds rows on `first`
    blind.unread = set()
    assert h.schedule(blind) == 2
    assert h.processor.requests_of(h.in_flight(blind)[0]) == [request]
    assert blind.rows_read_from == {beside.worker_id: 2}  # h and c of its last step, from `beside`
