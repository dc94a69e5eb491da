"""`./scripts/bench http --quick` end to end on real processes: a batchmaker server with its gRPC front door,
driven through gRPC (tritonclient) and ZeroMQ, every answer checked against the reference model; Triton's dynamic
and sequence batchers compared where Triton runs here (an environment with the `triton` extra, numpy < 2), and
recorded as skipped with the reason where it does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_LSTM, free_port, start_server, stop_server, write_config

from batchmaker.bench import http, oip_load, results, triton_lstm, triton_sequence
from batchmaker.bench.datasets import wmt
from batchmaker.bench.http import Load, Plan
from batchmaker.bench.verify import compare_replies
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
    sent = [len(due) for due in Load.of(http.QUICK, wmt()).due]  # every way is sent the same requests
    for way, rows in http.way_rows(result).items():  # each rose until the first rate it failed, peaking below it
        assert [(row["offered_rps"], row["sent"]) for row in rows] == list(zip(http.QUICK.rates, sent))[: len(rows)]
        assert rows
        assert all(http.sustained(row) for row in rows[:-1])
        assert len(rows) == len(http.QUICK.rates) or not http.sustained(rows[-1])
        assert result["peaks"]["requests_per_s"][way] == http.peak(rows)
        if http.peak(rows) == http.QUICK.rates[-1]:  # its peak is at least the plan's highest rate
            assert f"peak {way}: {http.QUICK.rates[-1]:.0f} req/s or more: every rate sent" in done.stdout
    for row in result["doors"]["rows"]:
        if "grpc" in row:  # the front door's own process was found and measured
            cpu = row["grpc"]["cpu_ms_per_request"]
            assert 0 < cpu["frontdoor"] < cpu["server"]
        assert ("added_latency_ms" in row) == ("zmq" in row and "grpc" in row)
    for check in result["doors"]["verify"].values():
        assert check["ok"] and check["checked"] == http.QUICK.verify_requests
        assert check["max_abs_error"] <= TOLERANCE
    reason = triton_lstm.missing()
    for batching, section in result["triton"]["batchings"].items():
        if reason is not None:
            assert section == {"skipped": reason}
            assert f"Triton {batching}: skipped: {reason}" in done.stdout
        else:  # Triton ran: its answers are the reference's too
            assert section["version"] and section["verify"]["checked"] == http.QUICK.verify_requests
            assert section["verify"]["ok"] and section["verify"]["max_abs_error"] <= TOLERANCE
    assert f"answers batchmaker grpc: {http.QUICK.verify_requests} checked" in done.stdout
    found = result["peaks"]["requests_per_s"]
    compared = [b for b in triton_lstm.BATCHINGS if found.get(f"Triton {b}") and found["gRPC door"]]
    assert [peer["name"] for peer in result["peers"]] == [
        f"Triton {result['triton']['batchings'][b]['version']} {b} batcher" for b in compared
    ]


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


def test_an_unknown_batching_is_refused_before_anything_starts(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM).path
    with pytest.raises(ValueError, match="Triton has no ragged batcher here \\(only dynamic, sequence\\)"):
        triton_lstm.TritonLSTM(config, "ragged")


@pytest.mark.skipif(triton_lstm.missing() is None, reason="Triton runs here")
def test_each_batcher_is_a_skip_naming_what_is_missing(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM).path
    load = Load.of(Plan((10.0,), seconds=0.5, verify_requests=1), [{"tokens": [5, 17]}])
    for batching in triton_lstm.BATCHINGS:
        assert http.run_triton(config, batching, load, [], []) == {"skipped": triton_lstm.missing()}


def test_an_empty_sentence_as_a_sequence_is_refused_before_it_is_sent():
    target = oip_load.Target(f"127.0.0.1:{free_port()}", "lstm", http.OUTPUTS, batched=True, steps=True)
    run = oip_load.open_loop(target, [[]], np.zeros(1))
    assert run.errors == ["EMPTY_SEQUENCE"]


def test_a_way_peaks_at_the_last_rate_it_sustained_and_the_peers_compare_it_with_the_door():
    def row(rate: float, p90: float, refused: int = 0) -> dict:
        return {
            "offered_rps": rate,
            "sent": 100,
            "ok": 100 - refused,
            "latency_ms": {"p50": 1.0, "p90": p90, "p99": p90},
        }

    result = {
        "doors": {"rows": [{"offered_rps": r, "zmq": row(r, 5.0), "grpc": row(r, p90)} for r, p90 in ((100, 9.0), (200, 90.0))]},
        "triton": {"batchings": {
            "dynamic": {"version": "2.59.0", "rows": [row(100, 30.0), row(200, 60.0, refused=1)]},
            "sequence": {"version": "2.59.0", "rows": [row(100, 101.0)]},
        }},
    }  # fmt: skip
    result["peaks"] = http.peaks(result)
    found = result["peaks"]["requests_per_s"]
    assert found == {"zmq door": 200, "gRPC door": 200, "Triton dynamic": 100, "Triton sequence": None}
    assert result["peaks"]["ratios"] == {"gRPC door / zmq door": 1.0, "gRPC door / Triton dynamic": 2.0}
    (peer,) = http.peers(result)  # the sequence batcher sustained no rate: nothing to compare
    assert peer["name"] == "Triton 2.59.0 dynamic batcher" and "p90 <= 100 ms" in peer["setting"]
    assert (peer["requests_per_s"], peer["cellular_requests_per_s"]) == (100, 200)
    assert (peer["p90_ms"], peer["cellular_p90_ms"]) == (30.0, 9.0)  # both at 100 req/s, the lower peak
    assert results.peers({"peers": [peer]})[0].throughput_ratio == 2.0  # the results page reads it


@pytest.mark.skipif(triton_lstm.missing() is not None, reason=f"Triton cannot run here: {triton_lstm.missing()}")
def test_the_sequence_batcher_answers_every_sentence_as_the_reference_and_refuses_a_bad_token_alone(tmp_path: Path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    config = write_config(tmp_path, SMALL_LSTM)
    model = build_model(config.models["lstm"])
    state = model.load_weights()
    sentences = [[5, 17, 342, 9], [3] * 30, [999], [7, 10**6, 8], *([[1, 2, 3]] * 8)]  # one token beyond 999
    with triton_lstm.TritonLSTM(config.path, "sequence") as triton:
        target = oip_load.Target(triton.address, "lstm", http.OUTPUTS, batched=True, steps=True)
        run = oip_load.open_loop(target, sentences, np.zeros(len(sentences)), keep_outputs=True)
        with grpcclient.InferenceServerClient(triton.address) as client:

            def step(token: int, start: bool) -> dict:
                tensor = target.tensor([token])
                return client.infer("lstm", [tensor], sequence_id=77, sequence_start=start, sequence_end=False)

            step(5, start=True)
            with pytest.raises(InferenceServerException, match="token 1000 is outside the vocabulary \\(0 to 999\\)"):
                step(1000, start=False)
            with pytest.raises(InferenceServerException, match="sequence 77 has no state: a step of it was refused"):
                step(5, start=False)
            step(5, start=True)  # the id starts afresh
    assert run.errors[3] is not None and run.errors.count(None) == len(sentences) - 1
    good = [i for i in range(len(sentences)) if i != 3]
    expected = [model.reference(state, {"tokens": sentences[i]}) for i in good]
    check = compare_replies(expected, [run.outputs[i] for i in good])
    assert check["ok"] and check["checked"] == len(good) and check["max_abs_error"] <= TOLERANCE


@pytest.mark.skipif(triton_lstm.missing() is not None, reason=f"Triton cannot run here: {triton_lstm.missing()}")
@pytest.mark.parametrize("batching", triton_lstm.BATCHINGS)
def test_triton_that_fails_to_start_is_a_skip_naming_its_log(tmp_path: Path, batching: str):
    config = write_config(tmp_path, SMALL_LSTM).path
    (tmp_path / "lstm.pt").unlink()  # Triton's model cannot load its weights
    load = Load.of(Plan((10.0,), seconds=0.5, verify_requests=1), [{"tokens": [5, 17]}])
    skipped = http.run_triton(config, batching, load, [], [])["skipped"]
    assert skipped.startswith("Triton exited with status") and "lstm.pt" in skipped and "(log: " in skipped


@pytest.mark.skipif(triton_lstm.missing() is not None, reason=f"Triton cannot run here: {triton_lstm.missing()}")
def test_a_model_repository_that_cannot_be_written_is_a_skip_saying_why(tmp_path: Path, monkeypatch):
    config = write_config(tmp_path, SMALL_LSTM).path
    monkeypatch.setattr(triton_sequence, "MODEL_PY", tmp_path / "absent.py")
    load = Load.of(Plan((10.0,), seconds=0.5, verify_requests=1), [{"tokens": [5, 17]}])
    skipped = http.run_triton(config, "sequence", load, [], [])["skipped"]
    assert skipped.startswith("Triton's sequence batcher cannot be set up: ") and "absent.py" in skipped
