"""`./scripts/bench idle`: a lone request served and run in process, side by side, on a real server; the
forward it times is the reference itself; the table and the verdict on wrong answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import SMALL_LSTM, SMALL_SEQ2SEQ, SST_TREELSTM, write_config

from batchmaker.bench import idle
from batchmaker.bench.datasets import DATASETS
from batchmaker.common.models import build_model

ATTENTION = SMALL_SEQ2SEQ.replace("[models.seq2seq", "[models.attention").replace(
    "max_decode_length = 60\n", 'max_decode_length = 60\nattention = "luong"\n'
)


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_a_lone_request_is_served_and_run_in_process_and_checked(tmp_path: Path, running_batch: str):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = idle.run(quick=True, out=tmp_path, rows=idle.ROWS[:1], running_batch=running_batch)
    assert result["running_batch"] == running_batch
    (row,) = result["rows"]
    assert row["row"] == "LSTM, one 22-token request" and row["requests"] == idle.QUICK.requests
    assert row["verify"] == {"checked": idle.QUICK.requests, "max_abs_error": row["verify"]["max_abs_error"],
                             "wrong": [], "ok": True}
    for key in ("p50", "p99"):
        assert 0 < row["in_process_ms"][key] and 0 < row["server_total_ms"][key] < row["served_ms"][key]
        assert row["ratio"][key] == pytest.approx(row["served_ms"][key] / row["in_process_ms"][key])
    assert row["goal_met"] == (row["ratio"]["p50"] <= idle.GOAL)
    assert len(result["commit"]) == 40 and "[models.lstm]" in result["models"]
    assert json.loads((tmp_path / "idle.json").read_text())["rows"] == result["rows"]
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # the server was stopped


def test_the_lone_request_has_its_documented_length():
    (request,) = idle.lone_sentence()
    assert len(request["tokens"]) == idle.LONE_LENGTH


@pytest.mark.parametrize(
    ("models", "name", "inputs"),
    [
        (SMALL_LSTM, "lstm", {"tokens": [5, 17, 342, 9]}),
        (SMALL_SEQ2SEQ, "seq2seq", {"tokens": [5, 17, 342, 9, 11]}),
        (ATTENTION, "attention", {"tokens": [5, 17, 342, 9, 11]}),
        (SST_TREELSTM, "tree", DATASETS["sst"]()[3]),
    ],
)
def test_the_timed_forward_is_the_reference(tmp_path: Path, models: str, name: str, inputs: dict):
    model = build_model(write_config(tmp_path, models).models[name])
    state = model.load_weights()
    forward = model.reference_forward(state)
    for _ in range(2):  # the modules built once serve every call
        timed, reference = forward(inputs), model.reference(state, inputs)
        assert timed.keys() == reference.keys()
        for key, value in reference.items():
            np.testing.assert_allclose(timed[key], value, atol=1e-5)


def synthetic_row(name: str, served: float, local: float, ok: bool = True) -> dict:
    check = {"checked": 12, "max_abs_error": 1e-6 if ok else 0.3,
             "wrong": [] if ok else ["tokens is [1], expected [2]"], "ok": ok}
    return {"row": name, "model": "lstm", "requests": 12, "served_ms": {"p50": served, "p99": 2 * served},
            "in_process_ms": {"p50": local, "p99": local}, "server_total_ms": {"p50": served, "p99": served},
            "ratio": {"p50": served / local, "p99": 2 * served / local}, "goal_met": served <= idle.GOAL * local,
            "verify": check}


def synthetic_result(*rows: dict) -> dict:
    return {"describe": "abc1234", "plan": {"requests": 12, "warmup": 3}, "load_average": {"before": [0.5, 0, 0]},
            "rows": list(rows)}


def test_the_table_gives_both_latencies_the_ratios_and_the_goal():
    result = synthetic_result(synthetic_row("fast", 1.2, 1.0), synthetic_row("slow", 6.0, 1.0, ok=False))
    lines = idle.table(result).splitlines()
    assert "idle at abc1234" in lines[0] and "12 requests a row" in lines[0] and "goal 1.5x" in lines[1]
    assert lines[3] == "| fast | 1.20 / 2.40 | 1.00 / 1.00 | 1.2x | 2.4x | met | 12 ok |"
    assert lines[4] == ("| slow | 6.00 / 12.00 | 1.00 / 1.00 | 6.0x | 12.0x | missed | "
                        "WRONG: max abs error 3.0e-01 tokens is [1], expected [2] |")


def test_a_wrong_answer_fails_the_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    slow, wrong = synthetic_row("slow", 6.0, 1.0), synthetic_row("wrong", 1.0, 1.0, ok=False)
    monkeypatch.setattr(idle, "run", lambda quick, out, running_batch: synthetic_result(slow))
    assert idle.main(True, tmp_path)  # a missed goal is reported, not an error
    monkeypatch.setattr(idle, "run", lambda quick, out, running_batch: synthetic_result(wrong))
    assert not idle.main(True, tmp_path)
