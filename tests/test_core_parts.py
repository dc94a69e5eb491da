"""The batching core's parts on their own: compile_graph, the slot allocator, the plan store's
compaction and the request table's index of unanswered requests."""

from __future__ import annotations

import time

import numpy as np
import pytest

from batchmaker.common.graph import ZERO, CellGraph, CellTypeSpec, NodeOutput, ValueKind
from batchmaker.common.plan import ZERO_REF, Unfolded, compile_graph, external_ref
from batchmaker.common.protocol import INTERNAL, RequestError
from batchmaker.common.slots import FIRST_FREE_SLOT, SlotAllocator
from batchmaker.manager.batching.plan_store import NodeColumns, make_tables
from batchmaker.manager.batching.records import Lifecycle, Request
from batchmaker.manager.batching.request_table import RequestTable

TOKEN = ValueKind("int64", ())
STATE = ValueKind("float32", (4,))
STEP = CellTypeSpec("m/step", (TOKEN, STATE), (STATE,), (1, 2, 4), 0)
SPECS = {STEP.key: STEP}


def chain(length: int) -> CellGraph:
    graph = CellGraph()
    h = ZERO
    for token in range(length):
        h = NodeOutput(graph.add_node(STEP.key, graph.add_external(np.int64(token + 10)), h), 0)
    graph.results = {"h": h}
    return graph


# -- compile_graph ------------------------------------------------------------------------------


def test_a_chain_compiles_to_one_lane_of_single_node_waves_that_reuse_one_register():
    unfolded = compile_graph(chain(4), SPECS, "m")
    plan = unfolded.plan
    assert plan.lane_cells == ("m/step",) and plan.lane_bounds.tolist() == [0, 4]
    assert plan.depth.tolist() == [0, 1, 2, 3] and plan.need.tolist() == [0, 1, 2, 3]
    assert plan.wave_end.tolist() == [1, 2, 3, 4]
    assert plan.registers == 1  # the state is overwritten in place
    assert plan.inputs[:, 0].tolist() == [external_ref(i) for i in range(4)]
    assert plan.inputs[0, 1] == ZERO_REF and plan.inputs[1:, 1].tolist() == [0, 0, 0]
    assert plan.copies == {3: (("h", 0),)} and plan.has_copies.tolist() == [False, False, False, True]
    assert unfolded.externals[TOKEN].tolist() == [10, 11, 12, 13]


def test_independent_nodes_share_a_wave():
    graph = CellGraph()
    first = graph.add_node(STEP.key, graph.add_external(np.int64(1)), ZERO)
    second = graph.add_node(STEP.key, graph.add_external(np.int64(2)), ZERO)
    graph.results = {"a": NodeOutput(first, 0), "b": NodeOutput(second, 0)}
    plan = compile_graph(graph, SPECS, "m").plan
    assert plan.depth.tolist() == [0, 0] and plan.wave_end.tolist() == [2, 2] and plan.need.tolist() == [0, 0]


@pytest.mark.parametrize(
    "build, problem",
    [
        (lambda g: g.add_node("m/other", ZERO, ZERO), "unknown cell type"),
        (lambda g: g.add_node(STEP.key, ZERO), "gives 1 inputs"),
        (lambda g: g.add_node(STEP.key, ZERO, NodeOutput(5, 0)), "not an earlier node"),
        (lambda g: g.add_node(STEP.key, NodeOutput(0, 0), ZERO), "wrong kind"),
    ],
)
def test_a_graph_the_model_should_not_have_made_is_an_internal_error(build, problem):
    graph = chain(1)
    build(graph)
    with pytest.raises(RequestError, match=problem) as raised:
        compile_graph(graph, SPECS, "m")
    assert raised.value.code == INTERNAL


def test_a_graph_without_results_or_watched_outputs_is_refused():
    graph = chain(2)
    graph.results = {}
    with pytest.raises(RequestError, match="neither results nor watched outputs"):
        compile_graph(graph, SPECS, "m")


# -- the slot allocator ---------------------------------------------------------------------------


def test_the_allocator_hands_out_low_rows_first_and_never_the_reserved_ones():
    slots = SlotAllocator(8)
    assert slots.capacity == 8 - FIRST_FREE_SLOT and slots.available == slots.capacity
    taken = slots.take(3)
    assert taken.tolist() == [2, 3, 4] and slots.in_use == 3
    assert slots.take_one() == 5
    slots.give(taken)
    slots.give_one(5)
    assert slots.available == slots.capacity and slots.in_use == 0
    assert sorted(slots.take(slots.capacity).tolist()) == list(range(FIRST_FREE_SLOT, 8))


def test_rows_given_back_are_handed_out_again_in_ascending_runs():
    """A GPU worker copies a task's io rows to the host one run of consecutive rows at a time."""
    slots = SlotAllocator(16)
    first = slots.take(6)
    slots.give(first[[2, 0, 5, 1, 4, 3]])  # in whatever order a task read them
    assert slots.take(4).tolist() == [2, 3, 4, 5]
    assert [slots.take_one() for _ in range(2)] == [6, 7]


def test_asking_more_rows_than_are_free_is_refused_and_changes_nothing():
    slots = SlotAllocator(4)
    with pytest.raises(RuntimeError, match="3 rows asked of an arena with 2 free"):
        slots.take(3)
    assert slots.available == 2


# -- the plan store ------------------------------------------------------------------------------


class Model:
    name = "m"


def admitted(table, store, live: list[Request], length: int, unfolded: Unfolded | None = None) -> Request:
    """A request of a chain of `length` steps admitted to the store: of its own plan, or of `unfolded`'s."""
    unfolded = unfolded or compile_graph(chain(length), SPECS, "m")
    request = Request(b"c", len(live), Model(), {}, unfolded, 0.0)
    rows = table.add([request])
    store.add([request], rows, lambda: list(live))
    live.append(request)
    return request


def nodes_of(table, store, request: Request) -> np.ndarray:
    base = table.node_base[request.row]
    return store.nodes.arrays["data"][base : base + request.unfolded.plan.nodes]


def test_compaction_moves_live_requests_down_and_keeps_their_data():
    table, store = make_tables([STEP], [TOKEN, STATE])
    live: list[Request] = []
    capacity = store.nodes.capacity
    requests = [admitted(table, store, live, 1000) for _ in range(capacity // 1000)]
    expected = {id(r): (nodes_of(table, store, r).copy(), store.externals[TOKEN].arrays["values"][
        table.ext_base[r.row, table.kinds[TOKEN]] : table.ext_base[r.row, table.kinds[TOKEN]] + 1000].copy())
        for r in requests}
    kept = requests[2]
    for gone in requests[:2] + requests[3:]:  # all but one end: the store is mostly free, but not at its tail
        store.release([gone])
        table.remove([gone])
        live.remove(gone)
    newcomer = admitted(table, store, live, 1000)  # no room at the tail: the store compacts
    assert store.nodes.capacity == capacity  # mostly free after compaction: it did not grow
    assert store.nodes.tail == store.nodes.live == 1000 * len(live)
    assert table.node_base[kept.row] == 0  # moved down to the bottom
    for request in live[:-1]:
        data, tokens = expected[id(request)]
        assert (nodes_of(table, store, request) == data).all()
        start = table.ext_base[request.row, table.kinds[TOKEN]]
        assert (store.externals[TOKEN].arrays["values"][start : start + 1000] == tokens).all()
    assert nodes_of(table, store, newcomer)[:, NodeColumns.NEED].tolist() == list(range(1000))


def test_a_plan_is_stored_once_for_every_request_of_its_shape_and_kept_while_it_may_come_again():
    table, store = make_tables([STEP], [TOKEN, STATE])
    live: list[Request] = []
    shared = compile_graph(chain(100), SPECS, "m")
    first, second = (admitted(table, store, live, 100, shared) for _ in range(2))
    assert table.node_base[first.row] == table.node_base[second.row] and store.nodes.tail == 100
    assert table.reg_base[first.row] != table.reg_base[second.row]  # their registers are their own
    for done in (first, second):
        store.release([done])
        table.remove([done])
        live.remove(done)
    assert store.nodes.live == 0 and store.nodes.tail == 100  # unused, kept: the shape may come again
    third = admitted(table, store, live, 100, shared)
    assert table.node_base[third.row] == 0 and store.nodes.tail == store.nodes.live == 100
    store.release([third])
    table.remove([third])
    live.remove(third)
    newcomers = [admitted(table, store, live, 1000) for _ in range(store.nodes.capacity // 1000)]
    assert store.nodes.tail == store.nodes.live == 1000 * len(newcomers)  # compacted: the unused plan is gone
    assert all(nodes_of(table, store, r)[:, NodeColumns.NEED].tolist() == list(range(1000)) for r in newcomers)


def test_a_store_that_is_mostly_live_grows_instead_of_compacting_again_and_again():
    table, store = make_tables([STEP], [TOKEN, STATE])
    live: list[Request] = []
    capacity = store.nodes.capacity
    for _ in range(capacity // 1000 + 1):
        admitted(table, store, live, 1000)
    assert store.nodes.capacity >= 2 * 1000 * len(live) > capacity
    assert all(nodes_of(table, store, r)[:, NodeColumns.NEED].tolist() == list(range(1000)) for r in live)


# -- the request table's index of unanswered requests ----------------------------------------------


def request(client: bytes, request_id: int, deadline: float | None = None) -> Request:
    made = Request(client, request_id, Model(), {}, compile_graph(chain(1), SPECS, "m"), 0.0)
    made.deadline = deadline
    return made


def table_of(*requests: Request) -> RequestTable:
    table = RequestTable([TOKEN, STATE], capacity=2)
    for r in requests:
        table.add([r])
    return table


def test_admitted_requests_are_found_by_client_and_id_and_by_client():
    a, b, c = request(b"x", 1), request(b"x", 2), request(b"y", 1)
    index = table_of(a, b, c).unanswered  # three rows in a table made for two: it grew
    assert len(index) == 3 and (b"x", 2) in index and (b"z", 1) not in index and index.get(b"y", 1) is c
    assert index.of_clients([b"x"]) == [a, b] and index.of_clients([b"x", b"y"]) == [a, b, c]
    assert index.of_clients([]) == [] and index.of_clients([b"z"]) == [] and index.all() == [a, b, c]


def test_a_concluded_request_leaves_the_index_and_keeps_its_row_until_removed():
    a, b = request(b"x", 1), request(b"x", 2)
    table = table_of(a, b)
    table.conclude([a])
    assert table.unanswered.get(b"x", 1) is None and len(table.unanswered) == 1
    assert table.requests[a.row] is a and id(a) in table.live  # tasks of it may still be in flight
    assert table.remove([a]) == [a] and table.requests[a.row] is None and id(a) not in table.live
    assert table.remove([a]) == []  # forgotten already
    assert table.unanswered.get(b"x", 2) is b


def test_a_removed_row_is_reused_and_its_old_lanes_are_stale():
    a = request(b"x", 1)
    table = table_of(a)
    queued = table.set_runnable(a.row, True)  # the generation a's lanes carry in the scheduler's queues
    table.conclude([a])
    table.remove([a])
    b = request(b"x", 2)
    table.add([b])
    assert b.row == a.row and table.generation[b.row] != queued and not table.runnable[b.row]


def test_a_replay_replaces_its_record_and_concluding_the_old_one_keeps_the_new():
    old, new = request(b"x", 1), request(b"x", 1)
    table = table_of(old, new)
    assert table.unanswered.get(b"x", 1) is new and len(table.unanswered) == 1
    table.conclude([old])
    assert table.unanswered.get(b"x", 1) is new
    table.conclude([new])
    assert len(table.unanswered) == 0


def test_deadlines_come_due_in_order_and_answered_requests_are_skipped():
    now = time.perf_counter()
    late, early, answered, future = (
        request(b"x", 1, now - 1),
        request(b"x", 2, now - 2),
        request(b"x", 3, now - 3),
        request(b"x", 4, now + 3600),
    )
    answered.lifecycle = Lifecycle.DONE
    table = table_of(late, early, answered, future)
    assert list(table.unanswered.expired()) == [early, late]
    assert list(table.unanswered.expired()) == []  # each comes due once
    assert 0 < table.unanswered.wait_ms(10**9) <= 3600 * 1000 and table.unanswered.wait_ms(5) == 5


def test_requests_answered_long_before_their_deadline_are_not_kept_until_it():
    far = time.perf_counter() + 3600
    running = request(b"x", 0, far)
    table = table_of(running)
    for i in range(1, 1001):
        answered = request(b"x", i, far)
        table.add([answered])
        answered.lifecycle = Lifecycle.DONE
        table.conclude([answered])
    assert len(table.unanswered._deadlines) < 100  # not the 1000 answered while one runs
    assert table.unanswered.wait_ms(10**9) > 0 and list(table.unanswered.expired()) == []


def test_with_no_deadline_the_event_loop_sleeps_its_longest_and_a_past_deadline_wakes_it_at_once():
    index = table_of(request(b"x", 1)).unanswered
    assert index.wait_ms(250) == 250 and list(index.expired()) == []
    index = table_of(request(b"x", 1, time.perf_counter() - 1)).unanswered
    assert index.wait_ms(250) == 0


def test_the_earliest_arrival_is_the_oldest_unanswered_and_answered_ones_behind_it_are_not_kept():
    oldest = request(b"x", 0)
    oldest.arrival = 1.0
    later = [request(b"x", i) for i in range(1, 1001)]
    for i, each in enumerate(later):
        each.arrival = 2.0 + i
    table = table_of(*later[:10], oldest, *later[10:])  # admitted out of arrival order, as a replay is
    assert table.unanswered.earliest_arrival() == 1.0
    for each in later:
        each.lifecycle = Lifecycle.DONE
        table.conclude([each])
    assert table.unanswered.earliest_arrival() == 1.0
    assert len(table.unanswered._arrivals) < 100  # not the 1000 answered while the oldest runs
    oldest.lifecycle = Lifecycle.DONE
    table.conclude([oldest])
    assert table.unanswered.earliest_arrival() is None
