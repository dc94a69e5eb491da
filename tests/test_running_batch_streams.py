"""Streamed requests in a worker's running batch, in process: their partials, concatenated, are their answers,
come before them, and a model that fails to make one ends its own request only."""

from __future__ import annotations

import numpy as np
from test_running_batch import held, served, take  # noqa: F401 (a fixture)

from batchmaker.bench.verify import differences
from batchmaker.common.protocol import INTERNAL

SENTENCES = [[5, 6, 7], list(range(1, 30)), [9], list(range(40, 60))]


def run(requests, sent: dict[int, tuple[str, dict, bool]]) -> list[tuple[str, list]]:
    """Take every request, step until all are answered: the replies in the order the worker sends them."""
    replies = []
    for handle, (model, inputs, stream) in sent.items():
        replies += [("answer", answer) for answer in take(requests, handle, model, inputs, 0, stream)]
    while requests.busy:
        partials, answers = requests.step()
        replies += [("partial", partial) for partial in partials] + [("answer", answer) for answer in answers]
    return replies


def test_streamed_partials_join_to_the_answer_and_come_before_it(served):  # noqa: F811
    _, _, _, _, models, weights = served
    requests = held(served)
    sent = {i: ("seq2seq", {"tokens": tokens}, i % 2 == 0) for i, tokens in enumerate(SENTENCES)}
    sent[len(sent)] = ("lstm", {"tokens": [1, 2, 3]}, False)
    replies = run(requests, sent)
    for handle, (model, inputs, stream) in sent.items():
        mine = [(kind, reply) for kind, reply in replies if reply[0] == handle]
        kind, (_, outputs, error, _) = mine[-1]
        assert kind == "answer" and error is None and [k for k, _ in mine[:-1]] == ["partial"] * (len(mine) - 1)
        assert differences(models[model].reference(weights[model], inputs), outputs)[1] is None
        if not stream:
            assert len(mine) == 1
            continue
        tokens = np.concatenate([reply[1]["tokens"] for _, reply in mine[:-1]] or [np.zeros(0, np.int64)])
        assert np.array_equal(tokens, outputs["tokens"]) and len(mine) - 1 == len(tokens)  # a token a step


def test_a_model_failing_to_make_a_partial_ends_its_request_only(served):  # noqa: F811
    planners = served[0]
    requests = held(served)
    model = planners["seq2seq"]
    original = model.partial_outputs

    def failing(unfolded, results, start):
        raise ValueError("no more")

    model.partial_outputs = failing  # type: ignore[method-assign]
    try:
        replies = run(requests, {1: ("seq2seq", {"tokens": list(range(1, 30))}, True),
                                 2: ("seq2seq", {"tokens": list(range(1, 30))}, False)})  # fmt: skip
    finally:
        model.partial_outputs = original  # type: ignore[method-assign]
    answers = {reply[0]: reply for kind, reply in replies if kind == "answer"}
    assert [kind for kind, _ in replies] == ["answer", "answer"]
    assert answers[1][2][0] == INTERNAL and "ValueError in seq2seq: no more" in answers[1][2][1]
    assert answers[2][2] is None
    assert not requests.busy and requests.batch.requests == 0
