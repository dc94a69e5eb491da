"""Chain lanes in the manager's batching core (tests/harness.py): which lanes are chains, how lane tasks
are formed (layouts, one-step lanes, peers), and that every answer still matches its reference."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL_LSTM, SMALL_SEQ2SEQ, write_config
from harness import Harness, step_sizes
from test_scheduler import lstm_models

from batchmaker.common.lanes import CONSTANT, ONE_STEP, SEQUENCE, STATE, LaneLayout, PortRule
from batchmaker.common.models import build_model
from batchmaker.common.models.seq2seq import decoding_mismatch
from batchmaker.common.task import LaneTaskMessage

CELL = "lstm/layer0"


def tokens(length: int, offset: int = 1) -> dict:
    return {"tokens": [offset + i for i in range(length)]}


def test_a_chain_layer_reads_its_tokens_as_a_sequence_and_carries_h_and_c(make_harness):
    h = make_harness(lstm_models())
    plan = h.admit("lstm", tokens(5)).unfolded.plan
    assert plan.lane_layouts == (LaneLayout((PortRule(SEQUENCE), PortRule(STATE, 0), PortRule(STATE, 1))),)
    assert h.admit("lstm", tokens(1)).unfolded.plan.lane_layouts == (ONE_STEP,)
    assert ONE_STEP.rules(3) == (PortRule(CONSTANT),) * 3


def test_a_decoder_feeds_its_token_back_and_a_stacked_layer_is_not_a_chain(make_harness):
    h = make_harness(SMALL_SEQ2SEQ + lstm_models(layers=2))
    encoder, decoder = h.admit("seq2seq", {"tokens": [5, 6, 7]}).unfolded.plan.lane_layouts
    assert encoder.inputs[0] == PortRule(SEQUENCE)
    assert decoder.inputs == (PortRule(STATE, 2), PortRule(STATE, 0), PortRule(STATE, 1))
    # Layer 0's h is read by layer 1 at every step: outside its lane before its last node.
    assert h.admit("lstm", tokens(4)).unfolded.plan.lane_layouts == (None, None)


def test_a_one_token_lane_joins_the_lane_task_of_longer_ones(make_harness):
    h = make_harness(lstm_models(), max_steps_per_task=16, full_task_s={CELL: 1e-4})
    worker = h.workers[0]
    for length in (1, 4, 2):
        h.admit("lstm", tokens(length))
    h.schedule(worker)
    assert [step_sizes(message) for _, message in h.sent] == [[3, 2, 1, 1]]
    h.complete_oldest(worker)
    assert len(h.finished) == 3 and all(error is None for _, error in h.finished)


def test_a_lane_moving_to_another_worker_reads_its_state_from_the_first_at_its_first_step(make_harness):
    """A request moves to a second worker after a task on the first: its lane task there reads h and c
    from the first worker's arena at the first step only (they are carried after), and writes its own."""
    h = make_harness(lstm_models(), workers=2, max_steps_per_task=16, full_task_s={CELL: 1e-3}, max_tasks_to_submit=1)
    first, second = h.workers
    request = h.admit("lstm", tokens(8))
    h.schedule(first)
    assert [step_sizes(message) for _, message in h.sent] == [[1, 1]]  # 2000 µs of join delay over 1000 µs a step
    h.complete_oldest(first)
    for _ in range(50):  # whatever that task measured, a step now costs 100 µs: the rest fits one task
        h.core.scheduler.step_costs.completed(CELL, 1, 1, 1e-4)
    h.schedule(second)
    message = h.sent[1][1]
    assert isinstance(message, LaneTaskMessage) and message.steps.tolist() == [6]
    assert [entry.first.remote is not None for entry in message.inputs] == [False, True, True]
    assert [entry.first.remote[0].peer for entry in message.inputs[1:]] == [first.worker_id] * 2
    own = set(request.rows[second.worker_id][next(iter(request.rows[second.worker_id]))].tolist())
    assert {int(slots[0]) for _, slots in message.outputs} <= own
    while second.tasks or h.schedule(second):
        h.complete_oldest(second)
    assert h.finished == [(request, None)]


def test_lanes_of_a_padded_bucket_share_a_layout_whatever_their_padding(tmp_path):
    config = write_config(tmp_path, SMALL_LSTM, scheduler='policy = "padded"\nbucket_width = 5')
    h = Harness(config, max_steps_per_task=16, full_task_s={CELL: 1e-6})
    try:
        worker = h.workers[0]
        a, b = h.admit("lstm", tokens(3)), h.admit("lstm", tokens(4))
        assert a.unfolded.plan.lane_layouts == b.unfolded.plan.lane_layouts != (None,)
        h.schedule(worker)
        assert [step_sizes(message) for _, message in h.sent] == [[2] * 5]
    finally:
        h.close()


@pytest.mark.parametrize("model", ["lstm", "seq2seq"])
def test_answers_of_lane_tasks_match_the_reference(tmp_path, model):
    """Lanes of many lengths, issued ahead and ending along the way, through the real CPU worker's
    body: every answer is the unbatched reference model's."""
    config = write_config(tmp_path, SMALL_LSTM + SMALL_SEQ2SEQ)
    h = Harness(config, max_steps_per_task=8, full_task_s={CELL: 1e-5, "seq2seq/encoder": 1e-5, "seq2seq/decoder": 1e-5})
    try:
        built = build_model(config.models[model])
        weights = built.load_weights()
        rng = np.random.default_rng(3)
        requests = [h.admit(model, {"tokens": rng.integers(1, 100, int(n)).tolist()}) for n in rng.integers(1, 12, 20)]
        h.run_on_cpu()
        for request, error in h.finished:
            assert error is None
            expected = built.reference(weights, request.inputs)
            got = request.model.outputs(request.unfolded, request.results)
            if model == "seq2seq":
                assert decoding_mismatch(got["tokens"], expected, 1e-4) is None
                continue
            for key, value in expected.items():
                np.testing.assert_allclose(np.asarray(got[key]), value, atol=1e-5, err_msg=key)
        assert len(h.finished) == len(requests)
    finally:
        h.close()
