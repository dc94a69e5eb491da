"""The baseline batching policies, step by step on the in-process manager core: padded
(bucketing, round-robin, padding, whole-batch answers) and graph (merged groups,
agenda-based batching, answers together)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL_LSTM, SMALL_SEQ2SEQ, write_config
from harness import Harness
from test_tree_models import TREE_MODELS

from batchmaker.common.config import ConfigError
from batchmaker.common.protocol import CANCELLED


def tokens(n: int) -> dict:
    return {"tokens": [(7 * i + 1) % 1000 for i in range(n)]}


def harness(tmp_path: Path, policy: str, models: str = SMALL_LSTM, extra: str = "") -> Harness:
    return Harness(write_config(tmp_path, models, scheduler=f'policy = "{policy}"\nbucket_width = 5\n{extra}'))


def run_all(h: Harness) -> list[list[tuple[int, set]]]:
    """Schedule and complete tasks until nothing is left; per round, (batch size, request ids) of each task."""
    worker = h.workers[0]
    rounds = []
    while True:
        while worker.in_flight <= 1 and h.schedule(worker):
            pass
        if not worker.tasks:
            return rounds
        task = h.complete_oldest(worker)
        rounds.append((task.nodes, set(h.requests_in(task)), [r.request_id for r, _ in h.finished]))


def test_padded_batches_a_bucket_pads_it_and_answers_it_whole(tmp_path: Path):
    h = harness(tmp_path, "padded")
    try:
        h.admit("lstm", tokens(3), "a")
        h.admit("lstm", tokens(12), "c")
        h.admit("lstm", tokens(4), "b")
        rounds = run_all(h)
        # Bucket 5 (a, b) runs first, padded to 5 steps of batch 2; bucket 15 (c) after it, 15 steps.
        assert [size for size, _, _ in rounds] == [2] * 5 + [1] * 15
        assert all(ids == {"a", "b"} for _, ids, _ in rounds[:5])
        assert all(ids == {"c"} for _, ids, _ in rounds[5:])
        # a and b are answered together after the fifth (padding) step; c after its fifteenth.
        assert [answered for _, _, answered in rounds[:4]] == [[]] * 4
        assert sorted(rounds[4][2]) == ["a", "b"]
        assert rounds[-2][2] == rounds[4][2] and rounds[-1][2][-1] == "c"
        assert all(error is None for _, error in h.finished)
        assert h.slots_in_use() == 0
    finally:
        h.close()


def test_padded_goes_round_robin_over_non_empty_buckets_in_groups_of_the_largest_batch(tmp_path: Path):
    h = harness(tmp_path, "padded", extra="max_group_requests = 2")
    try:
        for name, n in (("a1", 2), ("a2", 3), ("a3", 1), ("b1", 8), ("c1", 13)):
            h.admit("lstm", tokens(n), name)
        rounds = run_all(h)
        groups = []
        for _, ids, _ in rounds:
            if not groups or groups[-1] != ids:
                groups.append(ids)
        assert groups == [{"a1", "a2"}, {"b1"}, {"c1"}, {"a3"}]
        assert h.slots_in_use() == 0
    finally:
        h.close()


def test_padded_seq2seq_decodes_after_the_padded_encoder_and_answers_when_all_end(tmp_path: Path):
    h = harness(tmp_path, "padded", models=SMALL_SEQ2SEQ)
    try:
        h.admit("seq2seq", {"tokens": [5, 6], "max_len": 3}, "short")
        h.admit("seq2seq", {"tokens": [5, 6, 7, 8], "max_len": 9}, "long")
        rounds = run_all(h)
        cells = [h.specs[message.cell_index].key for _, message in h.sent]
        # Both encoders run 5 steps (padded) before any decoder step.
        assert cells[:5] == ["seq2seq/encoder"] * 5 and "seq2seq/encoder" not in cells[5:]
        finished = {r.request_id: e for r, e in h.finished}
        assert set(finished) == {"short", "long"} and all(e is None for e in finished.values())
        # The short request's answer waited for the long one: both left after the same task.
        first_answer = next(i for i, (_, _, answered) in enumerate(rounds) if answered)
        assert sorted(rounds[first_answer][2]) == ["long", "short"]
        assert h.slots_in_use() == 0
    finally:
        h.close()


def test_padded_refuses_models_that_cannot_be_padded(tmp_path: Path):
    with pytest.raises(ConfigError, match="policy 'padded' needs sequence models"):
        harness(tmp_path, "padded", models=TREE_MODELS)


def test_a_request_cancelled_while_waiting_for_a_batch_never_runs(tmp_path: Path):
    h = harness(tmp_path, "padded")
    try:
        h.admit("lstm", tokens(3), "a")
        gone = h.admit("lstm", tokens(4), "b")
        h.cancel(gone)
        rounds = run_all(h)
        assert all(ids == {"a"} for _, ids, _ in rounds) and len(rounds) == 5
        assert [(r.request_id, e.code if e else None) for r, e in h.finished] == [("b", CANCELLED), ("a", None)]
        assert h.slots_in_use() == 0
    finally:
        h.close()


def test_a_failed_member_does_not_hold_its_group(tmp_path: Path):
    h = harness(tmp_path, "graph")
    try:
        h.admit("lstm", tokens(2), "short")
        doomed = h.admit("lstm", tokens(30), "long")
        worker = h.workers[0]
        h.schedule(worker)
        h.complete_oldest(worker)
        h.complete_oldest(worker)  # "short" has its answer, held for the group
        assert h.finished == []
        h.cancel(doomed)
        assert [(r.request_id, e is None) for r, e in h.finished] == [("long", False), ("short", True)]
        run_all(h)
        assert h.slots_in_use() == 0
    finally:
        h.close()


def test_graph_merges_queued_requests_and_answers_them_together(tmp_path: Path):
    h = harness(tmp_path, "graph")
    try:
        for name, n in (("a", 2), ("b", 6), ("c", 4)):
            h.admit("lstm", tokens(n), name)
        rounds = run_all(h)
        assert [size for size, _, _ in rounds] == [3, 3, 2, 2, 1, 1]  # no padding: requests leave the batch
        assert [answered for _, _, answered in rounds[:-1]] == [[]] * 5
        assert sorted(rounds[-1][2]) == ["a", "b", "c"]
        h.admit("lstm", tokens(2), "d")
        assert [ids for _, ids, _ in run_all(h)] == [{"d"}, {"d"}]
        assert h.slots_in_use() == 0
    finally:
        h.close()


def test_graph_runs_the_shallowest_cell_type_first_on_trees(tmp_path: Path):
    h = harness(tmp_path, "graph", models=TREE_MODELS)
    try:
        tree = {"tokens": [-1, -1, -1, 1, 2, 3, 4], "parents": [-1, 0, 0, 1, 1, 2, 2]}
        for name in ("x", "y"):
            h.admit("bin", {"tree": tree}, name)
        run_all(h)
        cells = [h.specs[message.cell_index].key.split("/")[1] for _, message in h.sent]
        # The 8 leaves of both trees first (two tasks of the largest batch, 4), then level by level.
        assert cells == ["leaf", "leaf", "internal", "internal", "classifier"]
        assert all(error is None for _, error in h.finished) and len(h.finished) == 2
        assert h.slots_in_use() == 0
    finally:
        h.close()
