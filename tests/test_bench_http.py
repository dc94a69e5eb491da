"""`./scripts/bench http --quick` end to end on real processes: a batchmaker server with its gRPC front door,
driven through gRPC (tritonclient) and ZeroMQ, every answer checked against the reference model; Triton in each
setup (its dynamic batcher, its sequence batcher's oldest and direct strategies) compared where Triton runs here
(an environment with the `triton` extra, numpy < 2), and recorded as skipped with the reason where it does not;
the peaks and peers, and the results page and README quoting each system's strongest setup, from hand-made JSON.
(tests/test_bench_triton.py tests the setups themselves.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import SMALL_LSTM, free_port, start_server, stop_server, write_config

from batchmaker.bench import http, oip_load, results, results_page, results_readme, triton_lstm, triton_setups
from batchmaker.bench.datasets import wmt
from batchmaker.bench.http import Load
from batchmaker.common.models import build_model

TOLERANCE = 1e-5
LSTM_RESULT = {  # a workload's JSON, with only what the results page reads
    "preset": "lstm", "description": "LSTM", "commit": "abc1234", "machine": {"cores": 2},
    "summary": {"cellular": {"peak_throughput": 1000.0, "p90_ms_at_50pct_padded_peak": 50.0}},
}  # fmt: skip


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
    setups = triton_setups.setups()  # one model instance a core, 8 tokens a request
    assert list(result["triton"]["setups"]) == [setup.name for setup in setups]
    for setup, section in zip(setups, result["triton"]["setups"].values()):
        assert section["setup"] == setup.record()  # each setup written beside its numbers
        assert f"Triton {setup.name}: {setup.text()}" in done.stdout
        if reason is not None:
            assert section == {"setup": setup.record(), "skipped": reason}
            assert f"Triton {setup.name}: skipped: {reason}" in done.stdout
        else:  # Triton ran: its answers are the reference's too
            assert section["version"] and section["verify"]["checked"] == http.QUICK.verify_requests
            assert section["verify"]["ok"] and section["verify"]["max_abs_error"] <= TOLERANCE
    assert f"answers batchmaker grpc: {http.QUICK.verify_requests} checked" in done.stdout
    found = result["peaks"]["requests_per_s"]
    compared = [s for s in setups if found.get(f"Triton {s.name}") and found["gRPC door"]]
    assert [(peer["name"], peer["setup"]) for peer in result["peers"]] == [
        (f"Triton {result['triton']['setups'][s.name]['version']}", s.text()) for s in compared
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


def test_a_sentence_is_sent_in_calls_of_the_setups_tokens():
    target = oip_load.Target("127.0.0.1:1", "lstm", http.OUTPUTS, batched=True, tokens_per_call=4)
    assert target.calls(list(range(10))) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert target.calls([7]) == [(7,)] and target.calls([]) == []
    whole = oip_load.Target("127.0.0.1:1", "lstm", http.OUTPUTS, batched=True)
    assert whole.calls(list(range(10))) == [tuple(range(10))]


def test_an_empty_sentence_as_a_sequence_is_refused_before_it_is_sent():
    target = oip_load.Target(f"127.0.0.1:{free_port()}", "lstm", http.OUTPUTS, batched=True, tokens_per_call=4)
    run = oip_load.open_loop(target, [[]], np.zeros(1))
    assert run.errors == ["EMPTY_SEQUENCE"]


def row(rate: float, p90: float, refused: int = 0) -> dict:
    """One way's row at one rate, with only what the peaks and peers read."""
    return {"offered_rps": rate, "sent": 100, "ok": 100 - refused, "latency_ms": {"p50": 1.0, "p90": p90, "p99": p90}}


def test_a_way_peaks_at_the_last_rate_it_sustained_and_the_peers_compare_it_with_the_door():
    dynamic, oldest, direct = (setup.record() for setup in triton_setups.setups(instances=2))
    result = {
        "doors": {"rows": [
            {"offered_rps": r, "zmq": row(r, 5.0), "grpc": row(r, p90)} for r, p90 in ((100, 9.0), (200, 90.0))
        ]},
        "triton": {"setups": {
            "dynamic": {"setup": dynamic, "version": "2.59.0", "rows": [row(100, 30.0), row(200, 60.0, refused=1)]},
            "sequence oldest": {"setup": oldest, "version": "2.59.0", "rows": [row(100, 101.0)]},
            "sequence direct": {"setup": direct, "skipped": "Triton exited with status 1"},
        }},
    }  # fmt: skip
    result["peaks"] = http.peaks(result)
    found = result["peaks"]["requests_per_s"]
    assert found == {"zmq door": 200, "gRPC door": 200, "Triton dynamic": 100, "Triton sequence oldest": None}
    assert result["peaks"]["ratios"] == {"gRPC door / zmq door": 1.0, "gRPC door / Triton dynamic": 2.0}
    (peer,) = http.peers(result)  # the oldest strategy sustained no rate, the direct one did not start
    assert (peer["name"], peer["setup"]) == ("Triton 2.59.0", dynamic["text"]) and "p90 <= 100 ms" in peer["setting"]
    assert (peer["requests_per_s"], peer["cellular_requests_per_s"]) == (100, 200)
    assert (peer["p90_ms"], peer["cellular_p90_ms"]) == (30.0, 9.0)  # both at 100 req/s, the lower peak
    (read,) = results.peers({"peers": [peer]})  # the results page reads it, setup and all
    assert read.throughput_ratio == 2.0 and read.described == f"Triton 2.59.0 ({dynamic['text']})"


def test_the_results_page_and_readme_quote_each_systems_strongest_setup_and_list_every_one(tmp_path: Path):
    bench = tmp_path / "bench"
    bench.mkdir()
    dynamic, oldest, direct = (setup.record() for setup in triton_setups.setups(instances=2))
    result = {
        "preset": "http", "commit": "abc1234", "machine": {"cores": 2},
        "doors": {"rows": [{"offered_rps": r, "grpc": row(r, 9.0)} for r in (100, 200, 400, 800)]},
        "triton": {"setups": {
            "dynamic": {"setup": dynamic, "version": "2.51.0", "rows": [row(100, 30.0), row(200, 130.0)]},
            "sequence oldest": {"setup": oldest, "version": "2.51.0", "rows": [row(100, 70.0), row(200, 140.0)]},
            "sequence direct": {"setup": direct, "version": "2.51.0", "rows": [row(r, 40.0) for r in (100, 200, 400)]},
        }},
    }  # fmt: skip
    result["peaks"] = http.peaks(result)
    result["peers"] = http.peers(result)
    (bench / "http.json").write_text(json.dumps(result))
    (bench / "lstm.json").write_text(json.dumps(LSTM_RESULT))
    readme = tmp_path / "README.md"
    readme.write_text(f"{results_readme.BEGIN}\n{results_readme.END}\n")
    results_page.write(bench, bench / "results.md", readme)
    page = (bench / "results.md").read_text()
    how = result["peers"][0]["setting"]
    assert (  # every setup in the table, the strongest in bold, each with its setup
        f"| [http.json](http.json) | Triton 2.51.0 | {dynamic['text']} | {how} | 100 | 800 | 8.00x | 30.0 / 9.0 |\n"
        f"| [http.json](http.json) | Triton 2.51.0 | {oldest['text']} | {how} | 100 | 800 | 8.00x | 70.0 / 9.0 |\n"
        f"| [http.json](http.json) | **Triton 2.51.0** | {direct['text']} | {how} | 400 | 800 | 2.00x | 40.0 / 9.0 |"
    ) in page
    assert "its strongest (in bold: the highest req/s) is the one the verdict and the README quote" in page
    assert "records it as skipped: `http` (Triton 2.51.0)." in page  # the system once, not once a setup
    quoted = f"2.00x Triton 2.51.0 ({direct['text']}) on http (800 against 400 req/s)"
    text = readme.read_text()
    assert f"each in its strongest setup measured, throughput measured the same way: {quoted}." in text
    assert "8.00x" not in text  # the weaker setups stay in the page's table


def test_a_peer_of_one_setup_is_quoted_as_it_is_with_no_setup_recorded(tmp_path: Path):
    bench = tmp_path / "bench"
    bench.mkdir()
    peer = {"name": "Triton 2.50", "setting": "HTTP", "requests_per_s": 400.0, "cellular_requests_per_s": 600.0}
    (bench / "http.json").write_text(json.dumps({"preset": "http", "commit": "abc1234", "peers": [peer]}))
    (bench / "lstm.json").write_text(json.dumps(LSTM_RESULT))
    page = results_page.render(results.load(bench), bench, bench / "results.md")
    assert "| [http.json](http.json) | Triton 2.50 | not recorded | HTTP | 400 | 600 | 1.50x | - |" in page
    assert "in bold" not in page
