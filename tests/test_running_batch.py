"""The worker's running batch and its routed requests, in process: every model's answers against its reference
whatever joins and leaves between steps, Algorithm 1's choice, rows given back, and every way a request ends."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_config
from test_tree_models import TREE_MODELS

from batchmaker.bench.trees import random_tree
from batchmaker.bench.verify import differences
from batchmaker.common.models import build_model
from batchmaker.common.plan import Unfolded
from batchmaker.common.protocol import INTERNAL, INVALID_INPUT, NO_ROOM
from batchmaker.common.window import window
from batchmaker.manager.loop.server import load_models
from batchmaker.worker.chain_runs import ChainBounds
from batchmaker.worker.held_requests import HeldRequests, Routed
from batchmaker.worker.joining import Joining
from batchmaker.worker.main import load_cells
from batchmaker.worker.running_batch import RunningBatch

MODELS = TREE_MODELS + """
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
vocab_size = 100
embedding_size = 16
hidden_size = 16
num_layers = 2
max_length = 200
batch_sizes = [1, 2, 4, 8]

[models.seq2seq]
builder = "batchmaker.common.models.seq2seq:build"
weights = "seq2seq.pt"
src_vocab_size = 100
tgt_vocab_size = 12
embedding_size = 16
hidden_size = 16
max_length = 100
max_decode_length = 30
batch_sizes = [1, 2, 4, 8]
"""
ROWS = 4096


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    return served_parts(tmp_path_factory.mktemp("running-batch"))


def served_parts(directory: Path) -> tuple:
    """The models' planners, cell types, served cells, value kinds, models and weights, from a config in `directory`."""
    config = write_config(directory, MODELS)
    planners, specs, kinds = load_models(config)
    _, cells, _ = load_cells(config)
    models = {name: build_model(model) for name, model in config.models.items()}
    weights = {name: model.load_weights() for name, model in models.items()}
    return planners, specs, cells, kinds, models, weights


def binary_tree(rng: random.Random, leaves: int) -> dict:
    tokens: list[int] = []
    parents: list[int] = []

    def node(low: int, high: int, parent: int) -> None:
        index = len(tokens)
        parents.append(parent)
        if high - low == 1:
            tokens.append(rng.randrange(50))
            return
        tokens.append(-1)
        middle = rng.randrange(low + 1, high)
        node(low, middle, index)
        node(middle, high, index)

    node(0, leaves, -1)
    return {"tree": {"tokens": tokens, "parents": parents}}


def mixed_requests(count: int, seed: int) -> list[tuple[str, dict]]:
    rng, generator = random.Random(seed), np.random.default_rng(seed)
    requests = []
    for i in range(count):
        sentence = {"tokens": [rng.randrange(100) for _ in range(rng.randrange(1, 15))]}
        requests.append([
            ("lstm", sentence),
            ("bin", binary_tree(rng, rng.randrange(1, 12))),
            ("cs", {"tree": random_tree(generator, rng.randrange(1, 12), 50, 4)}),
            ("seq2seq", sentence),
        ][i % 4])  # fmt: skip
    return requests


def take(requests: HeldRequests, handle: Any, model: str, inputs: Any, priority: int = 0, stream: bool = False) -> list:
    """One routed request taken, as a message of one: its answers now (errors), if any."""
    return requests.take_many([Routed(handle, model, inputs, priority, stream)])


def admit(batch: RunningBatch, key: Any, unfolded: Unfolded, priority: int = 0) -> None:
    """One planned request held by the running batch (no watched values observed)."""
    batch.admit_many([Joining(key, unfolded, None, priority)])


def held(served, rows: int = ROWS) -> HeldRequests:
    planners, specs, cells, kinds, _, _ = served
    return HeldRequests(planners, specs, cells, kinds, rows)


def run_all(requests: HeldRequests, arrivals: list[tuple[str, dict]], seed: int) -> dict[int, list]:
    """Send the requests a few between steps, step until all are answered: the answers by handle."""
    rng = random.Random(seed)
    answers: dict[int, list] = {}
    pending = list(enumerate(arrivals))
    while pending or requests.busy:
        for _ in range(rng.randrange(4)):
            if pending:
                handle, (model, inputs) = pending.pop(0)
                answers.update((a[0], a) for a in take(requests, handle, model, inputs))
        answers.update((a[0], a) for a in requests.step().answers)
    return answers


def test_every_model_answers_as_its_reference_whatever_joins_between_steps(served):
    _, _, _, _, models, weights = served
    arrivals = mixed_requests(48, seed=1)
    answers = run_all(held(served), arrivals, seed=2)
    assert sorted(answers) == list(range(len(arrivals)))
    for handle, (model, inputs) in enumerate(arrivals):
        _, outputs, error, compute_us = answers[handle]
        assert error is None and type(compute_us) is int and compute_us > 0  # since it joined the running batch
        worst, problem = differences(models[model].reference(weights[model], inputs), outputs)
        assert problem is None and worst < 1e-5, (model, problem, worst)


def test_rows_and_slots_go_back_when_requests_leave(served):
    requests = held(served)
    available = {kind: free.available for kind, free in requests.batch.types.free.items()}
    run_all(requests, mixed_requests(24, seed=3), seed=4)
    ran = requests.batch.take_ran()
    assert sum(steps for sizes in ran.values() for steps in sizes.values()) == requests.batch.steps
    assert requests.batch.take_ran() == {}
    assert {kind: free.available for kind, free in requests.batch.types.free.items()} == available
    assert requests.batch.requests == 0 and not requests.busy


def test_a_step_runs_one_cell_type_at_most_its_largest_batch_a_full_one_first(served):
    planners, specs, cells, kinds, _, _ = served
    batch = RunningBatch(specs, cells, kinds, ROWS)
    lstm = planners["lstm"]
    for handle in range(3):
        admit(batch, handle, lstm.plan({"tokens": [1, 2, 3]}))
    tree = planners["bin"].plan(binary_tree(random.Random(0), 8))
    admit(batch, 3, tree)
    ran = _recording(batch)
    batch.step()
    leaf = next(spec for spec in specs if spec.key.startswith("bin") and "leaf" in spec.key)
    assert [(key, len(keys)) for key, keys in ran] == [(leaf.key, leaf.max_batch)]  # eight leaves ready: a full
    # batch of four goes before three lanes


def test_removed_request_never_answers_and_others_go_on(served):
    _, _, _, _, models, weights = served
    requests = held(served)
    arrivals = mixed_requests(8, seed=5)
    answers = {}
    for handle, (model, inputs) in enumerate(arrivals):
        answers.update((a[0], a) for a in take(requests, handle, model, inputs))
    requests.step()
    requests.drop([2, 5])
    while requests.busy:
        answers.update((a[0], a) for a in requests.step().answers)
    assert sorted(answers) == [0, 1, 3, 4, 6, 7]
    for handle in answers:
        model, inputs = arrivals[handle]
        assert differences(models[model].reference(weights[model], inputs), answers[handle][1])[1] is None


def test_invalid_inputs_and_unknown_models_are_answered_with_their_error(served):
    requests = held(served)
    [(_, outputs, error, compute_us)] = take(requests, 1, "lstm", {"tokens": [100000]})
    assert compute_us == 0  # it never joined
    assert outputs is None and error[0] == INVALID_INPUT
    [(_, _, error, _)] = take(requests, 2, "nope", {"tokens": [1]})
    assert error[0] == INTERNAL and "does not serve model 'nope'" in error[1]
    assert not requests.busy


def test_a_request_waits_for_rows_and_one_larger_than_the_arena_is_refused(served):
    requests = held(served, rows=40)  # two rows reserved, 38 for a kind
    assert take(requests, 1, "lstm", {"tokens": list(range(30))}) == []
    assert take(requests, 2, "lstm", {"tokens": list(range(30))}) == []  # waits: the first holds the rows
    assert requests.batch.requests == 1
    answered = {}
    while requests.busy:
        answered.update((a[0], a) for a in requests.step().answers)
    assert sorted(answered) == [1, 2] and all(a[2] is None for a in answered.values())
    [(_, _, error, _)] = take(requests, 3, "bin", binary_tree(random.Random(1), 30))
    assert error[0] == NO_ROOM and "more arena rows than the worker has" in error[1]  # the manager runs its steps


def test_a_failing_cell_ends_the_requests_of_its_batch_only(served):
    planners, specs, cells, kinds, _, _ = served
    broken = list(cells)
    failing = next(i for i, spec in enumerate(specs) if spec.key.startswith("cs") and "node" in spec.key)

    def fail(*_: torch.Tensor):
        raise RuntimeError("device on fire")

    broken[failing] = fail
    requests = HeldRequests(planners, specs, broken, kinds, ROWS)
    assert take(requests, 1, "cs", {"tree": random_tree(np.random.default_rng(0), 5, 50, 3)}) == []
    assert take(requests, 2, "lstm", {"tokens": [4, 5]}) == []
    answers = {}
    while requests.busy:
        answers.update((a[0], a) for a in requests.step().answers)
    assert answers[1][2][0] == INTERNAL and "device on fire" in answers[1][2][1]
    assert answers[2][2] is None


def test_a_failing_observe_ends_its_request_with_the_error(served):
    planners, specs, cells, kinds, _, _ = served
    requests = HeldRequests(planners, specs, cells, kinds, ROWS)
    model = planners["seq2seq"]
    original = model.observe
    model.observe = lambda *_: 1 / 0  # type: ignore[method-assign]
    try:
        take(requests, 1, "seq2seq", {"tokens": [1, 2, 3]})
        take(requests, 2, "lstm", {"tokens": [1, 2, 3]})
        answers = {}
        while requests.busy:
            answers.update((a[0], a) for a in requests.step().answers)
    finally:
        model.observe = original  # type: ignore[method-assign]
    assert "ZeroDivisionError in observe" in answers[1][2][1]
    assert answers[2][2] is None


def test_plans_of_a_running_batch_need_no_rows_left_behind(served):
    requests = held(served)
    for handle, (model, inputs) in enumerate(mixed_requests(12, seed=7)):
        take(requests, handle, model, inputs)
    requests.drop(list(range(12)))
    assert not requests.busy
    assert requests.batch.step() == []
    assert all(free.available == ROWS - 2 for free in requests.batch.types.free.values())



def _recording(batch: RunningBatch) -> list[tuple[str, list]]:
    """Record each wave's cell type and the keys of the requests its nodes belong to, in the order they run."""
    steps: list[tuple[str, list]] = []
    original = batch._runner.run

    def recording(cell, waves, *rest):
        key = batch.types.specs[cell].key
        steps.extend((key, [batch._held[slot].key for slot in batch.nodes.request[rows]]) for rows in waves)
        return original(cell, waves, *rest)

    batch._runner.run = recording
    return steps


def test_higher_priorities_take_a_steps_places_first_then_the_oldest(served):
    planners, specs, cells, kinds, models, weights = served
    batch = RunningBatch(specs, cells, kinds, ROWS)
    lstm = planners["lstm"]
    for handle in range(10):
        admit(batch, f"low{handle}", lstm.plan({"tokens": [handle + 1]}))
    admit(batch, "urgent", lstm.plan({"tokens": [1]}), priority=5)
    admit(batch, "later", lstm.plan({"tokens": [2]}), priority=-1)
    steps = _recording(batch)
    finished = {}
    with torch.inference_mode():
        while batch.requests:
            finished.update((done.key, done) for done in batch.step())
    _, first = steps[0]
    assert first == ["low0", "low1", "low2", "low3", "low4", "low5", "low6", "urgent"]  # "later", at -1, left out
    for name, done in finished.items():
        tokens = [2] if name == "later" else [1] if name == "urgent" else [int(name[3:]) + 1]
        expected = models["lstm"].reference(weights["lstm"], {"tokens": tokens})
        assert differences(expected, lstm.outputs(done.unfolded, done.results))[1] is None


def test_a_request_passed_over_eight_times_for_higher_priorities_goes_first(served):
    planners, specs, cells, kinds, _, _ = served
    batch = RunningBatch(specs, cells, kinds, ROWS, chains=ChainBounds(1, 0))  # a wave a step: passes count waves
    lstm = planners["lstm"]
    admit(batch, "patient", lstm.plan({"tokens": [7]}))
    for handle in range(8):  # eight long requests fill every batch of eight before it
        admit(batch, handle, lstm.plan({"tokens": list(range(1, 40))}), priority=3)
    steps = _recording(batch)
    with torch.inference_mode():
        while "patient" in batch._slot_of:
            batch.step()
    first = next(i for i, (_, ran) in enumerate(steps) if "patient" in ran)
    passed = [ran for key, ran in steps[:first] if key == steps[first][0]]
    assert len(passed) == 8 and all(ran == list(range(8)) for ran in passed)  # left out eight times, then it ran
    assert steps[first][1] == ["patient", *range(7)]


def test_a_model_loaded_while_requests_are_held_joins_and_one_unloaded_leaves(served):
    planners, specs, cells, kinds, models, weights = served
    chosen = [i for i, spec in enumerate(specs) if spec.key.startswith("lstm/")]
    lstm_kinds = [kind for kind in kinds if any(kind in specs[i].inputs + specs[i].outputs for i in chosen)]
    requests = HeldRequests({"lstm": planners["lstm"]}, [specs[i] for i in chosen], [cells[i] for i in chosen],
                            lstm_kinds, ROWS)  # fmt: skip
    [(_, _, error, _)] = take(requests, 1, "bin", binary_tree(random.Random(2), 5))
    assert "does not serve model 'bin'" in error[1]
    sent = {2: ("lstm", {"tokens": list(range(1, 20))})}
    take(requests, 2, *sent[2])
    requests.step()
    loaded = [i for i, spec in enumerate(specs) if spec.key.startswith("bin/")]
    wider = max(len(specs[i].inputs) for i in loaded) > requests.batch.nodes.inputs.shape[1]
    assert set(kinds) - set(lstm_kinds) and wider  # a tree's cells: kinds of value not seen yet, more inputs a node
    requests.add_model(planners["bin"], [specs[i] for i in loaded], [cells[i] for i in loaded], kinds)
    sent[3] = ("bin", binary_tree(random.Random(2), 9))
    answers = {answer[0]: answer for answer in take(requests, 3, *sent[3])}
    while requests.busy:
        answers.update((a[0], a) for a in requests.step().answers)
    for handle, (model, inputs) in sent.items():
        assert differences(models[model].reference(weights[model], inputs), answers[handle][1])[1] is None
    requests.unload([specs[i].key for i in loaded])
    assert requests.batch.types.cells[-1] is None
    [(_, _, error, _)] = take(requests, 4, "bin", binary_tree(random.Random(2), 5))
    assert "does not serve model 'bin'" in error[1]
    assert take(requests, 5, "lstm", {"tokens": [1]}) == []


def test_a_running_batch_holds_a_window_of_requests_the_rest_join_as_others_leave_the_higher_priority_first(served):
    _, specs, _, _, models, weights = served
    requests = held(served)
    held_at_once = window(specs)
    sent = {handle: ("lstm", {"tokens": [handle % 99 + 1] * (1 + handle % 7)}) for handle in range(held_at_once + 10)}
    for handle, (model, inputs) in sent.items():
        assert take(requests, handle, model, inputs) == []
    sent["urgent"] = ("lstm", {"tokens": [5, 6]})
    take(requests, "urgent", *sent["urgent"], priority=2)
    assert requests.batch.requests == held_at_once  # the others wait, planned
    joined = []
    admit_many = requests.batch.admit_many
    requests.batch.admit_many = lambda joining: joined.extend(request.key for request in joining) or admit_many(joining)
    answers = {}
    while requests.busy:
        answers.update((a[0], a) for a in requests.step().answers)
        assert requests.batch.requests <= held_at_once
    assert joined == ["urgent", *range(held_at_once, held_at_once + 10)]
    for handle, (model, inputs) in sent.items():
        assert differences(models[model].reference(weights[model], inputs), answers[handle][1])[1] is None
