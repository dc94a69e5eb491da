"""Requests joining the worker's running batch together, in process: the requests of a message, and those a step
makes room for, admitted at once answer as their references, take the rows admitting them one by one would, and
give every row back; those that fit join in their turn and the rest wait."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_running_batch import ROWS, held, mixed_requests, served_parts

from batchmaker.bench.verify import differences
from batchmaker.common.protocol import INTERNAL, INVALID_INPUT
from batchmaker.common.window import window
from batchmaker.worker.held_requests import Routed
from batchmaker.worker.joining import Joining
from batchmaker.worker.node_columns import COLUMNS
from batchmaker.worker.running_batch import RunningBatch


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    return served_parts(tmp_path_factory.mktemp("joins"))


def with_initial_states(arrivals: list[tuple[str, dict]], seed: int) -> list[tuple[str, dict]]:
    """The arrivals and sentences given initial states: external values of two kinds (states, then tokens)."""
    rng = np.random.default_rng(seed)
    states = [
        ("lstm", {"tokens": rng.integers(1, 100, int(length)).tolist(), "h0": rng.standard_normal((2, 16)).tolist(),
                  **({"c0": rng.standard_normal((2, 16)).tolist()} if length % 2 else {})})
        for length in rng.integers(1, 12, 4)
    ]  # fmt: skip
    return [*arrivals[:5], *states[:2], *arrivals[5:], *states[2:]]


def _joining(planners, arrivals: list[tuple[str, dict]], priorities: list[int]) -> list[Joining]:
    """The arrivals planned, to admit together, their handles their indices."""
    joining = []
    for handle, ((model, inputs), priority) in enumerate(zip(arrivals, priorities)):
        unfolded = planners[model].plan(inputs)
        joining.append(Joining(handle, unfolded, planners[model].observe if unfolded.plan.watched else None, priority))
    return joining


def test_requests_admitted_together_answer_as_their_references_and_give_every_row_back(served):
    planners, specs, cells, kinds, models, weights = served
    batch = RunningBatch(specs, cells, kinds, ROWS)
    available = {kind: free.available for kind, free in batch.types.free.items()}
    # every model (chains, trees with ragged inputs, a decoder that watches); sentences with values of two kinds
    arrivals = with_initial_states(mixed_requests(24, seed=11), seed=11)
    joining = _joining(planners, arrivals, [handle % 3 - 1 for handle in range(len(arrivals))])
    assert batch.fitting(request.unfolded for request in joining) == len(joining)
    batch.admit_many(joining)
    assert batch.requests == len(joining)
    finished = {}
    with torch.inference_mode():
        while batch.requests:
            finished.update((done.key, done) for done in batch.step())
    for handle, (model, inputs) in enumerate(arrivals):
        done = finished[handle]
        assert done.error is None
        outputs = planners[model].outputs(done.unfolded, done.results)
        worst, problem = differences(models[model].reference(weights[model], inputs), outputs)
        assert problem is None and worst < 1e-5, (model, problem, worst)
    assert {kind: free.available for kind, free in batch.types.free.items()} == available


def test_admitting_together_lays_out_the_nodes_and_rows_as_admitting_one_by_one(served):
    planners, specs, cells, kinds, _, _ = served
    arrivals = with_initial_states(mixed_requests(12, seed=12), seed=12)
    together, one_by_one = (RunningBatch(specs, cells, kinds, ROWS) for _ in range(2))
    together.admit_many(_joining(planners, arrivals, [0, 2] * 8))
    for request in _joining(planners, arrivals, [0, 2] * 8):
        one_by_one.admit_many([request])
    count = together.nodes.count
    assert count == one_by_one.nodes.count
    for column in (*COLUMNS, "ragged"):
        left, right = getattr(together.nodes, column), getattr(one_by_one.nodes, column)
        assert np.array_equal(left[:count], right[:count]) if column != "ragged" else np.array_equal(left, right)
    for handle in range(len(arrivals)):
        rows, alone = together.get(handle).rows, one_by_one.get(handle).rows
        assert rows.keys() == alone.keys() and all(np.array_equal(rows[kind], alone[kind]) for kind in rows)
    for kind, arena in together.types.arenas.items():
        assert torch.equal(arena, one_by_one.types.arenas[kind])  # the external values copied to the same rows


def test_of_a_message_the_requests_that_fit_join_in_order_the_rest_wait_one_too_large_is_refused(served):
    planners, _, _, _, models, weights = served
    requests = held(served, rows=60)  # 58 rows a kind: a sentence takes a row of tokens a token
    sent = {handle: ("lstm", {"tokens": [handle + 1] * length}) for handle, length in enumerate([20, 20, 20, 1])}
    assert requests.batch.fitting(planners["lstm"].plan(inputs) for _, inputs in sent.values()) == 2
    assert requests.take_many([Routed(handle, model, inputs) for handle, (model, inputs) in sent.items()]) == []
    assert requests.batch.requests == 2  # the third waits for rows, the fourth behind it
    answers = {}
    while requests.busy:
        answers.update((a[0], a) for a in requests.step().answers)
    too_large = ("lstm", {"tokens": [1] * 70})
    sent[4] = ("lstm", {"tokens": [3, 4]})
    assert requests.take_many([Routed(4, *sent[4]), Routed(5, *too_large)]) == []  # 5 waits for the batch to empty
    while requests.busy:
        answers.update((a[0], a) for a in requests.step().answers)
    assert "more arena rows than the worker has" in answers.pop(5)[2][1]
    [refused] = requests.take_many([Routed(6, *too_large), Routed(7, "lstm", {"tokens": [5]})])  # the batch is empty
    assert refused[0] == 6 and "more arena rows than the worker has" in refused[2][1]
    sent[7] = ("lstm", {"tokens": [5]})
    while requests.busy:
        answers.update((a[0], a) for a in requests.step().answers)
    assert sorted(answers) == sorted(sent)
    for handle, (model, inputs) in sent.items():
        assert differences(models[model].reference(weights[model], inputs), answers[handle][1])[1] is None
    assert all(free.available == 58 for free in requests.batch.types.free.values())


def test_a_message_is_planned_request_by_request_and_its_higher_priorities_join_first(served):
    _, specs, _, _, models, weights = served
    requests = held(served)
    held_at_once = window(specs)
    sent = {handle: ("lstm", {"tokens": [handle % 99 + 1] * (1 + handle % 5)}) for handle in range(held_at_once)}
    sent["urgent"] = ("seq2seq", {"tokens": [5, 6, 7]})
    routed = [Routed(handle, model, inputs) for handle, (model, inputs) in sent.items()]
    routed[-1] = routed[-1]._replace(priority=3, stream=True)
    routed[3:3] = [Routed("unknown", "nope", {"tokens": [1]}), Routed("invalid", "lstm", {"tokens": [100000]})]
    joined = []
    admit_many = requests.batch.admit_many
    requests.batch.admit_many = lambda joining: joined.append([each.key for each in joining]) or admit_many(joining)
    refused = {answer[0]: answer for answer in requests.take_many(routed)}
    assert refused["unknown"][2][0] == INTERNAL and refused["invalid"][2][0] == INVALID_INPUT
    assert joined == [["urgent", *range(held_at_once - 1)]]  # one join for the message; the last waits its turn
    answers, partials = {}, []
    while requests.busy:
        replies = requests.step()
        partials += replies.partials
        answers.update((a[0], a) for a in replies.answers)
    assert joined[1:] == [[held_at_once - 1]] and {partial[0] for partial in partials} == {"urgent"}
    for handle, (model, inputs) in sent.items():
        _, outputs, error, compute_us = answers[handle]
        assert error is None and compute_us > 0
        if handle != "urgent":  # a streamed request's outputs went out in its partials
            assert differences(models[model].reference(weights[model], inputs), outputs)[1] is None
