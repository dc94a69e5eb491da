"""`./scripts/bench http --quick` end to end on real processes: a batchmaker server with its gRPC front door,
driven through gRPC (tritonclient) and ZeroMQ, every answer checked against the reference model; Triton
compared where it runs here, and recorded as skipped with the reason where it does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_LSTM, free_port, start_server, stop_server, write_config

from batchmaker.bench import http, oip_load, triton_lstm
from batchmaker.bench.http import Load, Plan
from batchmaker.common.models import build_model

TOLERANCE = 1e-5


def test_quick_run_serves_every_way_and_checks_the_answers(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "batchmaker.bench", "http", "--quick", "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "http.json").read_text())
    assert result["quick"] and result["commit"] != "unknown"
    rows = result["doors"]["rows"]
    assert [row["offered_rps"] for row in rows] == list(http.QUICK.rates)
    for row in rows:
        for way in ("zmq", "grpc"):
            assert row[way]["sent"] > 0 and row[way]["ok"] == row[way]["sent"] and row[way]["errors"] == {}
        assert row["grpc"]["cpu_ms_per_request"]["frontdoor"] > 0  # the front door's own process was found and measured
        assert row["grpc"]["cpu_ms_per_request"]["server"] > row["grpc"]["cpu_ms_per_request"]["frontdoor"]
        assert set(row["added_latency_ms"]) == {"p50", "p99"}
    for check in result["doors"]["verify"].values():
        assert check["ok"] and check["checked"] == http.QUICK.verify_requests
        assert check["max_abs_error"] <= TOLERANCE
    batchings = result["triton"]["batchings"]
    assert "pytriton" in batchings["sequence"]["skipped"] or "not installed" in batchings["sequence"]["skipped"]
    reason = triton_lstm.missing()
    if reason is not None:
        assert batchings["dynamic"] == {"skipped": reason}
        assert f"Triton dynamic: skipped: {reason}" in done.stdout
    else:  # Triton ran: the same load, every request answered, and its answers are the reference's too
        assert [row["sent"] for row in batchings["dynamic"]["rows"]] == [row["grpc"]["sent"] for row in rows]
        assert all(row["ok"] == row["sent"] for row in batchings["dynamic"]["rows"])
        assert batchings["dynamic"]["verify"]["ok"] and batchings["dynamic"]["verify"]["max_abs_error"] <= TOLERANCE
    assert f"answers batchmaker grpc: {http.QUICK.verify_requests} checked" in done.stdout


def test_refusals_through_the_door_are_counted_and_fail_the_answer_check(tmp_path: Path):
    grpc = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path, SMALL_LSTM + f'\n[grpc]\naddress = "{grpc}"\n')
    model = build_model(config.models["lstm"])
    state = model.load_weights()
    target = oip_load.Target(grpc, "lstm", http.OUTPUTS, batched=False)
    requests = [{"tokens": [5, 17, 342, 9]}, {"tokens": [3] * 30}]
    server = start_server(config)
    try:
        good = oip_load.open_loop(target, http.tokens(requests), np.zeros(len(requests)), keep_outputs=True)
        bad = oip_load.open_loop(target, [[5, 10**6]], np.zeros(1), keep_outputs=True)  # beyond the vocabulary
    finally:
        stop_server(server)
    check = http.check_run(good, [model.reference(state, request) for request in requests])
    assert check["ok"] and check["checked"] == 2 and check["max_abs_error"] <= TOLERANCE
    assert bad.errors[0] is not None and "INVALID_ARGUMENT" in bad.errors[0]
    refused = http.check_run(bad, [model.reference(state, requests[0])])
    assert not refused["ok"] and refused["wrong"] == [f"request 0: {bad.errors[0]}"]
    assert http.summary(bad, {})["errors"] == {bad.errors[0]: 1}


def test_a_batcher_pytriton_cannot_configure_is_recorded_as_skipped(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM).path
    load = Load.of(Plan((10.0,), seconds=0.5, verify_requests=1), [{"tokens": [5, 17]}])
    skipped = http.run_triton(config, "sequence", load, [], [])
    assert skipped == {"skipped": triton_lstm.missing() or "pytriton configures no sequence batcher (only dynamic)"}


@pytest.mark.skipif(triton_lstm.missing() is not None, reason=f"Triton cannot run here: {triton_lstm.missing()}")
def test_triton_that_fails_to_start_is_a_skip_naming_its_log(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM).path
    (tmp_path / "lstm.pt").unlink()  # Triton's model cannot load its weights
    load = Load.of(Plan((10.0,), seconds=0.5, verify_requests=1), [{"tokens": [5, 17]}])
    skipped = http.run_triton(config, "dynamic", load, [], [])["skipped"]
    assert skipped.startswith("Triton exited with status") and "lstm.pt" in skipped and "(log: " in skipped
