"""Chain runs in the running batch (worker.chain_runs): which nodes of a plan go on as a chain, and runs of
several waves of the same lanes answering as their reference does, lanes ending at different waves, a decoder
ending at its EOS in the middle of a run, a cell failing in the middle of one, and the bounds of a run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import write_config
from test_lanes_core import CHAINS
from test_running_batch import admit, binary_tree, mixed_requests, run_all, served, take  # noqa: F401 (a fixture)

from batchmaker.bench.verify import differences
from batchmaker.common.protocol import INTERNAL
from batchmaker.manager.loop.server import load_models
from batchmaker.worker.chain_runs import ChainBounds, carried
from batchmaker.worker.held_requests import HeldRequests
from batchmaker.worker.main import load_cells
from batchmaker.worker.running_batch import RunningBatch


def columns(batch: RunningBatch, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cell indices, chains and carry codes of the nodes of request `key` held in `batch`, in row order."""
    nodes = batch.nodes
    rows = np.flatnonzero(nodes.request[: nodes.count] == batch._slot_of[key])
    return nodes.cell[rows], nodes.chain[rows], nodes.carry[rows]


def test_a_stacked_chains_layers_each_go_on_to_their_last_node_carrying_h_and_c(served):  # noqa: F811
    planners, specs, cells, kinds, _, _ = served
    batch = RunningBatch(specs, cells, kinds, 4096)
    admit(batch, "sentence", planners["lstm"].plan({"tokens": [5, 6, 7, 8]}))
    cell, chain, carry = columns(batch, "sentence")
    assert chain.tolist() == [4, 3, 2, 1, 4, 3, 2, 1]  # two layers of four steps, the upper after the lower
    assert cell[:4].tolist() == [cell[0]] * 4 and cell[4] != cell[0]
    code = int(carry[0])
    assert carried(code) == ((1, 0), (2, 1))  # h and c: inputs 1 and 2 read outputs 0 and 1 of the step before
    assert carry.tolist() == [code, code, code, 0, code, code, code, 0]


def test_a_bidirectional_layer_runs_no_chain(tmp_path):
    config = write_config(tmp_path, CHAINS["tagger"])
    planners, specs, kinds = load_models(config)
    _, cells, _ = load_cells(config)
    batch = RunningBatch(specs, cells, kinds, 4096)
    admit(batch, "tagged", planners["tagger"].plan({"tokens": [1, 2, 3, 4, 5]}))
    assert set(columns(batch, "tagged")[1].tolist()) == {1}  # its forward and backward steps share each depth


def steps_taken(requests: HeldRequests, arrivals: list[tuple[str, dict]]) -> int:
    """Send all the requests at once and step until they are answered: the steps the running batch took."""
    for handle, (model, inputs) in enumerate(arrivals):
        assert take(requests, handle, model, inputs) == []
    calls = 0
    while requests.busy:
        requests.step()
        calls += 1
    return calls


def test_a_lone_sentence_runs_many_waves_a_step_within_the_bounds(served):  # noqa: F811
    planners, specs, cells, kinds, _, _ = served
    sentence = [("lstm", {"tokens": list(range(1, 41))})]  # two layers of 40 steps: 80 waves
    bounded = HeldRequests(planners, specs, cells, kinds, 4096, chains=ChainBounds(16, 10**9))
    assert steps_taken(bounded, sentence) == 2 * (1 + 3)  # per layer: a wave measured, then 16, 16 and 7 a step
    assert bounded.batch.steps == 80
    single = HeldRequests(planners, specs, cells, kinds, 4096, chains=ChainBounds(1, 10**9))
    assert steps_taken(single, sentence) == 80
    no_delay = HeldRequests(planners, specs, cells, kinds, 4096, chains=ChainBounds(64, 0))
    assert steps_taken(no_delay, sentence) == 80  # no wave fits in no delay


@pytest.mark.parametrize("max_steps", [2, 5, 64])
def test_chain_runs_answer_as_the_reference_wherever_lanes_and_decoders_end(served, max_steps):  # noqa: F811
    planners, specs, cells, kinds, models, weights = served
    requests = HeldRequests(planners, specs, cells, kinds, 4096, chains=ChainBounds(max_steps, 10**9))
    waves = requests.batch._runner.waves
    longest = 0

    def recording(*args):
        nonlocal longest
        chosen = waves(*args)
        longest = max(longest, len(chosen[0]))
        return chosen

    requests.batch._runner.waves = recording
    arrivals = mixed_requests(64, seed=11)
    answers = run_all(requests, arrivals, seed=12)
    assert longest == max_steps if max_steps < 10 else 10 < longest <= max_steps  # as long as the bound or a chain
    for handle, (model, inputs) in enumerate(arrivals):
        _, outputs, error, _ = answers[handle]
        assert error is None
        worst, problem = differences(models[model].reference(weights[model], inputs), outputs)
        assert problem is None and worst < 1e-5, (model, problem, worst)


def test_a_cell_failing_in_the_middle_of_a_run_ends_the_requests_of_its_lanes_only(served):  # noqa: F811
    planners, specs, cells, kinds, models, weights = served
    broken = list(cells)
    lower = next(i for i, spec in enumerate(specs) if spec.key == "lstm/layer0")
    calls = 0

    def third_fails(*args: torch.Tensor):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device on fire")
        return cells[lower](*args)

    broken[lower] = third_fails
    requests = HeldRequests(planners, specs, broken, kinds, 4096, chains=ChainBounds(8, 10**9))
    assert take(requests, 1, "lstm", {"tokens": [4, 5, 6, 7, 8, 9]}) == []
    requests.step()  # the first wave alone, measured
    tree = binary_tree(random.Random(1), 4)
    assert take(requests, 2, "bin", tree) == []
    answers = {}
    while requests.busy:
        answers.update((answer[0], answer) for answer in requests.step().answers)
    assert answers[1][2][0] == INTERNAL and "device on fire" in answers[1][2][1]
    _, outputs, error, _ = answers[2]
    assert error is None
    assert differences(models["bin"].reference(weights["bin"], tree), outputs)[1] is None
    assert not requests.batch.nodes.pending[: requests.batch.nodes.count].any()  # nothing of it left to run


def first_run(models: tuple, lengths: list[int]) -> list[int]:
    """A sentence of 40 tokens runs a wave alone (its cost measured), then sentences of `lengths` join: the sizes
    of the waves of the next step."""
    planners, specs, cells, kinds, _, _ = models
    batch = RunningBatch(specs, cells, kinds, 4096, chains=ChainBounds(64, 10**9))
    lstm = planners["lstm"]
    admit(batch, "long", lstm.plan({"tokens": list(range(1, 41))}))
    batch.step()
    for handle, length in enumerate(lengths):
        admit(batch, handle, lstm.plan({"tokens": list(range(1, length + 1))}))
    waves = batch._runner.waves
    runs = []

    def recording(*args):
        result = waves(*args)
        runs.append([len(wave) for wave in result[0]])
        return result

    batch._runner.waves = recording
    batch.step()
    return runs[0]


def test_a_run_lasts_as_long_as_half_its_lanes_or_more_go_on(served):  # noqa: F811
    assert first_run(served, [1, 1]) == [3]  # one lane of three goes on: one wave
    assert first_run(served, [10, 1]) == [3] + [2] * 9  # two go on: as long as the shorter of them
    assert first_run(served, []) == [1] * 39  # a lone lane runs to its end
