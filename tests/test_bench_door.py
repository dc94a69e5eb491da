"""`./scripts/bench door --quick` end to end on real processes: a batchmaker server with its front door on HTTP
and gRPC, each way driven closed loop one at a time and with many in flight, the front door's process found and
its CPU counted, every run's first answers checked against the reference model; refusals fail the check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SMALL_LSTM, free_port, start_server, stop_server, write_config

from batchmaker.bench import door
from batchmaker.bench.__main__ import main as bench_main
from batchmaker.common.models import build_model

TOLERANCE = 1e-5


def test_quick_run_measures_each_door_and_checks_the_answers(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert bench_main(["door", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "door.json").read_text())
    assert result["quick"] and [row["concurrency"] for row in result["rows"]] == list(door.QUICK.concurrency)
    for row in result["rows"]:
        for way in door.WAYS:
            cell = row[way]
            assert cell["errors"] == 0 and cell["requests"] == door.QUICK.requests
            assert cell["verify"]["ok"] and cell["verify"]["checked"] == door.QUICK.checked
            assert cell["verify"]["max_abs_error"] <= TOLERANCE
        for way in ("http", "grpc"):
            cpu = row[way]["cpu_us_per_request"]
            assert 0 < cpu["frontdoor"] < cpu["server"]  # the front door's own process was found and measured
            assert "added_p50_ms" in row[way]
    assert door.wrong(result) == []
    assert "| 16 | grpc |" in capsys.readouterr().out


def test_refused_requests_are_counted_and_fail_the_check(tmp_path: Path):
    endpoints = door.Endpoints("", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    config = write_config(
        tmp_path, SMALL_LSTM + f'\n[http]\naddress = "{endpoints.http}"\n[grpc]\naddress = "{endpoints.grpc}"\n'
    )
    endpoints = door.Endpoints(config.server.address, endpoints.http, endpoints.grpc)
    model = build_model(config.models["lstm"])
    expected = [model.reference(model.load_weights(), {"tokens": [5, 17]})]
    plan = door.Plan((2,), requests=3, warmup=1, checked=1)
    server = start_server(config)
    try:
        runs = {way: door.closed_loop(way, endpoints, [[5, 10**6]], plan, 2, {}) for way in door.WAYS}
        good = door.closed_loop("http", endpoints, [[5, 17]], plan, 2, {})
    finally:
        stop_server(server)
    for way, run in runs.items():  # a token beyond the vocabulary: every request refused
        assert run.errors == plan.warmup + plan.requests and run.latency == [], way
        refused = door.check(expected, run)
        assert not refused["ok"] and refused["checked"] == 0 and refused["wrong"] == ["request 0 refused"]
    assert good.errors == 0 and len(good.latency) == plan.requests
    assert door.check(expected, good)["ok"] and door.check(expected, good)["max_abs_error"] <= TOLERANCE
    cells = {way: {**door.summary(run, plan.requests), "verify": {"ok": True}} for way, run in runs.items()}
    result = {"rows": [{"concurrency": 2, **cells}]}
    assert door.wrong(result) == [f"{way} at concurrency 2" for way in door.WAYS]
