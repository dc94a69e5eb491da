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
from batchmaker.manager.batching.scheduler import STEPS_BEFORE_A_STOP
from batchmaker.manager.loop.server import load_models

CELL = "lstm/layer0"


def tokens(length: int, offset: int = 1) -> dict:
    return {"tokens": [offset + i for i in range(length)]}


def test_a_chain_layer_reads_its_tokens_as_a_sequence_and_carries_h_and_c(make_harness):
    h = make_harness(lstm_models())
    plan = h.admit("lstm", tokens(5)).unfolded.plan
    assert plan.lane_layouts == (LaneLayout((PortRule(SEQUENCE), PortRule(STATE, 0), PortRule(STATE, 1))),)
    assert h.admit("lstm", tokens(1)).unfolded.plan.lane_layouts == (ONE_STEP,)
    assert ONE_STEP.rules(3) == (PortRule(CONSTANT),) * 3


def test_a_decoder_feeds_its_token_back_and_a_stacked_layer_reads_the_whole_layer_below(make_harness):
    h = make_harness(SMALL_SEQ2SEQ + lstm_models(layers=2))
    encoder, decoder = h.admit("seq2seq", {"tokens": [5, 6, 7]}).unfolded.plan.lane_layouts
    assert encoder.inputs[0] == PortRule(SEQUENCE)
    assert decoder.inputs == (PortRule(STATE, 2), PortRule(STATE, 0), PortRule(STATE, 1))
    # Layer 0's h is read by layer 1 at every step: written at every step; layer 1 starts after it.
    plan = h.admit("lstm", tokens(4)).unfolded.plan
    below, above = plan.lane_layouts
    assert below.every_step == (0,) and above.inputs[0] == PortRule(SEQUENCE) and above.every_step == ()
    assert plan.depth.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # the layer above's steps after all of the one below's


def test_an_attention_decoder_reads_the_encoder_outputs_as_a_constant(make_harness):
    h = make_harness(SMALL_SEQ2SEQ.replace("max_decode_length = 60", 'max_decode_length = 60\nattention = "luong"'))
    encoder, decoder = h.admit("seq2seq", {"tokens": [5, 6, 7]}).unfolded.plan.lane_layouts
    assert encoder.every_step == (0,) and decoder.inputs[3] == PortRule(CONSTANT)


def test_a_one_token_lane_joins_the_lane_task_of_longer_ones(make_harness):
    h = make_harness(lstm_models(), max_steps_per_task=16, full_task_s={CELL: 1e-4})
    worker = h.workers[0]
    for length in (1, 4, 2):
        h.admit("lstm", tokens(length))
    h.schedule(worker)
    assert [step_sizes(message) for _, message in h.sent] == [[3, 2, 1, 1]]
    h.complete_oldest(worker)
    assert len(h.finished) == 3 and all(error is None for _, error in h.finished)


def test_a_decoder_lane_takes_few_steps_a_task_while_other_lanes_take_many(tmp_path):
    """Steps past a decoder's stop run for nothing: its lanes go STEPS_BEFORE_A_STOP steps a task at most."""
    config = write_config(tmp_path, SMALL_SEQ2SEQ)
    specs = load_models(config)[1]
    h = Harness(config, max_steps_per_task=64, full_task_s={spec.key: 1e-6 for spec in specs})
    try:
        h.admit("seq2seq", {"tokens": list(range(5, 45)), "max_len": 50})
        h.run_on_cpu()
        steps = {}
        for _, message in h.sent:
            steps.setdefault(specs[message.cell_index].key, []).append(len(step_sizes(message)))
        assert steps["seq2seq/encoder"] == [40]
        assert max(steps["seq2seq/decoder"]) == STEPS_BEFORE_A_STOP
    finally:
        h.close()


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
        h.core.scheduler.step_costs.record(CELL, 1, 1, 1e-4)
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


ATTENTION = SMALL_SEQ2SEQ.replace("[models.seq2seq]", "[models.attention]").replace(
    'weights = "seq2seq.pt"', 'weights = "attention.pt"'
)
ATTENTION = ATTENTION.replace("max_decode_length = 60", 'max_decode_length = 60\nattention = "luong"').replace(
    "[models.seq2seq.cells.decoder]", "[models.attention.cells.decoder]"
)
CHAINS = {  # every kind of chain lane: stacked, bidirectional, per-step heads, float inputs, decoders
    "lstm": SMALL_LSTM,
    "stacked": lstm_models(layers=3).replace("[models.lstm]", "[models.stacked]").replace("lstm.pt", "stacked.pt"),
    "tagger": SMALL_LSTM.replace("[models.lstm]", "[models.tagger]").replace("lstm.pt", "tagger.pt").replace(
        "num_layers = 1", "num_layers = 2\nbidirectional = true\nper_step = true\nhead_size = 5"
    ),
    "seq2seq": SMALL_SEQ2SEQ,
    "attention": ATTENTION,
}


CHAINS["attention2"] = (  # two layers each side, attending from the top one
    CHAINS["attention"]
    .replace("[models.attention", "[models.attention2")
    .replace("attention.pt", "attention2.pt")
    .replace('attention = "luong"', 'attention = "luong"\nnum_layers = 2')
)
PADDED = 'policy = "padded"\nbucket_width = 4'


@pytest.mark.parametrize(
    ("model", "scheduler"), [(model, "") for model in CHAINS] + [("stacked", PADDED), ("attention2", PADDED)]
)
def test_answers_of_lane_tasks_match_the_reference(tmp_path, model, scheduler):
    """Lanes of many lengths, issued ahead and ending along the way, run for real through the CPU
    worker's body: every answer is the unbatched reference model's. Padded, a stacked encoder's state at
    the true end of the source is read mid-lane, and registers overwritten in place change outputs."""
    config = write_config(tmp_path, CHAINS[model], scheduler=scheduler)
    h = Harness(config, max_steps_per_task=8, full_task_s={spec.key: 1e-5 for spec in load_models(config)[1]})
    try:
        built = build_model(config.models[model])
        weights = built.load_weights()
        rng = np.random.default_rng(3)
        requests = [h.admit(model, {"tokens": rng.integers(1, 40, int(n)).tolist()}) for n in rng.integers(1, 12, 20)]
        assert all(layout is not None for r in requests for layout in r.unfolded.plan.lane_layouts)
        h.run_on_cpu()
        assert [error for _, error in h.finished] == [None] * len(requests)
        assert max(len(step_sizes(message)) for _, message in h.sent) > 1  # lanes ran several steps a task
        for request, _ in h.finished:
            expected = built.reference(weights, request.inputs)
            got = request.model.outputs(request.unfolded, request.results)
            if "seq2seq" in request.model.kind or "tokens" in got:
                assert decoding_mismatch(got["tokens"], expected, 1e-4) is None
                continue
            for key, value in expected.items():
                np.testing.assert_allclose(np.asarray(got[key]), value, atol=1e-5, err_msg=key)
    finally:
        h.close()
