"""The benchmark suite's parts, offline: datasets, the ideal from the raw kernel, load points,
saturation, the summary and targets, and the plots. (`./scripts/bench all --quick` runs it whole.)"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from batchmaker.bench import overload, plots, report
from batchmaker.bench.__main__ import main as bench_main
from batchmaker.bench.datasets import DATASETS, FIXED_LENGTH, LONGEST
from batchmaker.bench.generator import Replies, open_loop, poisson_schedule, request_frames
from batchmaker.bench.kernel import ideal
from batchmaker.bench.presets import PRESETS, presets_named
from batchmaker.bench.run import serve_options, steps_decided_by
from batchmaker.bench.sweep import point, saturated
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model


def lengths(name: str) -> np.ndarray:
    return np.array([len(request["tokens"]) for request in DATASETS[name]()])


def test_sequence_datasets_have_the_documented_shapes():
    wmt = lengths("wmt")
    assert len(wmt) > 1000 and wmt.min() >= 1 and 20 < wmt.mean() < 25
    assert set(lengths("fixed")) == {FIXED_LENGTH}
    tail = lengths("longtail")
    assert tail.max() == LONGEST and 0.97 < (tail < 100).mean() < 0.995 and 22 < tail.mean() < 30


def test_tree_datasets_are_valid_trees():
    sst = DATASETS["sst"]()
    assert len(sst) > 9000
    (tree16,) = DATASETS["tree16"]()
    parents = tree16["tree"]["parents"]
    leaves = [node for node in range(len(parents)) if node not in parents]
    assert len(parents) == 31 and len(leaves) == 16


def test_ideal_runs_every_cell_in_full_batches():
    kernel = {"m/enc": {"cells_per_s": 1000.0}, "m/dec": {"cells_per_s": 500.0}}
    result = ideal(kernel, {"m/enc": 10, "m/dec": 5})
    assert result["requests_per_s"] == pytest.approx(1 / (10 / 1000 + 5 / 500))
    assert result["cells_per_s"] == pytest.approx(15 * result["requests_per_s"])


def replies(rate: float, seconds: float, latency: float, refused: int = 0, lost: int = 0) -> tuple[Replies, np.ndarray]:
    """A run where every request is answered `latency` s after its due time: the first `refused` with
    OVERLOADED, the last `lost` never."""
    count = int(rate * seconds)
    due = np.arange(count) / rate
    timing = {"queue_us": 1000, "compute_us": int(latency * 1e6) - 1000, "total_us": int(latency * 1e6)}
    answers: list = []
    for i in range(count):
        if i >= count - lost:
            answers.append(None)
        elif i < refused:
            answers.append({"id": i, "ok": False, "error": {"code": "OVERLOADED", "message": "busy"}})
        else:
            answers.append({"id": i, "ok": True, "outputs": {}, "timing": timing})
    received = np.where([a is None for a in answers], np.nan, due + latency)
    return Replies(due.copy(), received, answers, cpu_seconds=0.5), due


def counts(tasks: int, steps: int, nodes: int, workers: dict | None = None) -> dict:
    """The fields of a `stats` reply that a point reads (no worker unless given)."""
    return {"tasks": tasks, "steps": steps, "nodes": nodes, "workers": workers or {}}


def test_a_point_scores_the_offered_rate_when_the_server_keeps_up():
    result = point(*replies(100, 10, 0.05), 100, counts(0, 0, 0), counts(25, 50, 400))
    assert result["achieved_rps"] == pytest.approx(100, rel=0.02)
    assert result["mean_batch_size"] == 8 and result["latency_ms"]["p50"] == pytest.approx(50)
    assert result["generator_cpu_s_per_request"] == pytest.approx(0.5 / 1000)
    assert not saturated(result)
    assert saturated(point(*replies(100, 10, 0.05, refused=50), 100, counts(0, 0, 0), counts(1, 1, 1)))


def test_a_point_counts_requests_never_answered_as_lost():
    result = point(*replies(100, 10, 0.05, lost=30), 100, counts(0, 0, 0), counts(1, 1, 1))
    assert result["errors"] == {"LOST": 30} and result["ok"] == 970
    assert saturated(result)


def test_poisson_schedule_keeps_the_rate_and_the_window():
    due = poisson_schedule(2000, 5, np.random.default_rng(3))
    assert due[0] == 0 and (np.diff(due) > 0).all() and due[-1] < 5
    assert len(due) == pytest.approx(10_000, rel=0.05)


def synthetic_result() -> dict:
    def run(peak: float, p90: float) -> dict:
        def at(rate: float, latency: float) -> dict:
            cdf = {"queue_ms": list(np.linspace(0.1, latency / 4, 101)),
                   "compute_ms": list(np.linspace(1, latency, 101))}
            pct = {"p50": latency / 2, "p90": latency, "p99": latency * 2}
            return {"offered_rps": rate, "achieved_rps": min(rate, peak), "latency_ms": pct,
                    "queue_ms": {k: v / 4 for k, v in pct.items()}, "compute_ms": pct, "mean_batch_size": 32.0,
                    "errors": {}, "sent": 100, "cdf": cdf}

        return {"points": [at(100, p90), at(peak, p90 * 3), at(peak * 2, p90 * 50)],
                "moderate": {"0.25": at(peak / 4, p90), "0.5": at(peak / 2, p90)}, "verify": {"ok": True}}

    return {
        "preset": "lstm", "description": "test", "reference_policy": "padded", "max_tasks_to_submit": 5,
        "kernel": {"cells": {"lstm/layer0": {"batch": 64, "seconds_per_call": 0.002}},
                   "ideal": {"requests_per_s": 1000.0}},
        "torch_nn_kernel": {"cells": {"lstm/layer0": {"batch": 64, "seconds_per_call": 0.004}},
                            "ideal": {"requests_per_s": 500.0}},
        "dataset": {"cells_per_request": {"lstm/layer0": 20.0}},
        "policies": {"padded": run(400, 100.0), "cellular": run(600, 30.0)},
    }


def test_summary_and_targets_compare_policies_side_by_side():
    result = synthetic_result()
    summary = report.summarize(result)
    assert summary["cellular"]["peak_throughput"] == 600 and summary["cellular"]["kernel_fraction"] == 0.6
    assert summary["cellular"]["torch_nn_kernel_fraction"] == 1.2
    assert summary["cellular"]["sustained_throughput"] == 600  # the highest load answered with p90 <= 100 ms
    assert summary["padded"]["sustained_throughput"] == 200
    assert summary["padded"]["p90_ms_at_50pct_padded_peak"] == 100
    result["summary"], result["targets"] = summary, report.targets(result, summary)
    met = {t["what"].split(" at ")[0].split(",")[0]: t["met"] for t in result["targets"]}
    assert met["cellular peak / padded peak"] is True  # 1.5 >= 1.25
    assert met["cellular p90 / padded p90"] is True  # 0.3 <= 0.5
    assert met["cellular sustained (p90 <= 100 ms) / torch.nn kernel"] is False  # 600 / 500 < 1.6
    queueing = next(t for t in result["targets"] if t["what"].startswith("cellular queueing"))
    assert queueing["target"] == pytest.approx(5 * 2.0 * 1.5)  # 5 tasks of the raw kernel's 2 ms step at b_max
    assert "| cellular | 600 |" in report.table(result)
    assert "| raw kernel (torch.nn cells) | 500 | | | | 64 | 0.50 | 1.00 |" in report.table(result)
    assert all(line.startswith(("met", "MISSED")) for line in report.target_lines(result))


def test_the_attention_preset_is_judged_against_padding_by_p90_and_a_peak_of_1_3():
    result = {**synthetic_result(), "preset": "attention"}
    result["policies"]["cellular"] = result["policies"]["padded"]  # no better than padding: both goals missed
    goals = {t["what"].split(" at ")[0]: t for t in report.targets(result, report.summarize(result))}
    assert (
        goals["cellular peak / padded peak"]["target"] == 1.3 and goals["cellular peak / padded peak"]["met"] is False
    )
    assert goals["cellular p90 / padded p90"]["met"] is False


def test_all_runs_the_presets_marked_for_it_and_attention_runs_by_name():
    assert "attention" not in presets_named("all") and {"lstm", "seq2seq", "treelstm"} <= set(presets_named("all"))
    assert presets_named("attention") == ["attention"]
    assert 'attention = "luong"' in PRESETS["attention"].model_toml
def test_the_tagger_preset_is_held_to_its_own_peak_goal_beside_padded():
    result = synthetic_result()
    result["preset"] = "tagger"
    result["policies"]["cellular"] = synthetic_result()["policies"]["padded"]
    result["policies"]["cellular"]["points"][1]["achieved_rps"] = 510  # 1.275x padded's peak of 400
    for run in result["policies"]["cellular"]["points"] + list(result["policies"]["cellular"]["moderate"].values()):
        run["latency_ms"]["p90"] /= 4
    summary = report.summarize(result)
    met = {t["what"]: (t["target"], t["met"]) for t in report.targets(result, summary)}
    assert met == {"cellular p90 / padded p90 at 50% of padded peak": (0.5, True),
                   "cellular peak / padded peak": (1.3, False)}
    result["preset"] = "lstm"  # the same run meets the LSTM's goal of 1.25
    assert next(t for t in report.targets(result, summary) if t["what"] == "cellular peak / padded peak")["met"]


def test_the_tagger_preset_serves_every_tokens_tags_from_a_bilstm_and_is_left_out_of_all(tmp_path: Path):
    preset = PRESETS["tagger"]
    config = tmp_path / "bench.toml"
    config.write_text(
        '[server]\naddress = "tcp://127.0.0.1:5999"\n' + preset.model_toml.replace("{weights}", str(tmp_path))
    )
    model = build_model(load_config(config).models[preset.model])
    assert list(model.cell_types) == ["tagger/layer0", "tagger/layer0_reverse"]  # the head rides on both
    assert model.describe()["outputs"]["logits"]["shape"] == [-1, 9]
    assert (preset.dataset, preset.policies, preset.reference) == ("wmt", ("padded", "cellular"), "padded")
    assert presets_named("all") == [name for name in PRESETS if name not in ("tagger", "attention")]
    assert presets_named("tagger") == ["tagger"]


def test_plots_and_json_are_written(tmp_path: Path):
    pytest.importorskip("matplotlib")
    result = synthetic_result()
    paths = plots.draw(result, tmp_path)
    assert [p.name for p in paths] == ["lstm-latency.png", "lstm-cdf.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    assert (
        json.loads(json.dumps(report.finite({"x": float("nan"), "y": [1.0, float("inf")]})))
        == {"x": None, "y": [1.0, None]}
    )


def _fake_server(socket: zmq.Socket, stop: threading.Event) -> None:
    """Answers requests by id: 3 mod 10 never, 5 mod 10 twice, 7 mod 10 with OVERLOADED, the rest ok."""
    while not stop.is_set():
        if not socket.poll(50):
            continue
        client, body = socket.recv_multipart()
        request_id = msgpack.unpackb(body)["id"]
        if request_id % 10 == 3:
            continue
        if request_id % 10 == 7:
            reply = {"id": request_id, "ok": False, "error": {"code": "OVERLOADED", "message": "estimated wait 300 ms"}}
        else:
            reply = {"id": request_id, "ok": True, "outputs": {}, "timing": {"total_us": 1500}}
        for _ in range(2 if request_id % 10 == 5 else 1):
            socket.send_multipart([client, msgpack.packb(reply)])


def test_the_open_loop_counts_lost_doubled_and_refused_requests():
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    server = threading.Thread(target=_fake_server, args=(socket, stop))
    server.start()
    try:
        due = poisson_schedule(2000.0, 0.1, np.random.default_rng(0))
        frames = request_frames("m", [{"tokens": [1, 2]}] * len(due))
        run = open_loop(f"tcp://127.0.0.1:{port}", frames, due, timeout=0.5)
    finally:
        stop.set()
        server.join()
        socket.close(linger=0)
    ids = np.arange(len(due))
    outcome = overload.outcomes(run)
    assert np.array_equal(outcome == overload.UNANSWERED, ids % 10 == 3)
    assert np.array_equal(outcome == "OVERLOADED", ids % 10 == 7)
    assert run.duplicates == np.sum(ids % 10 == 5)
    answered = outcome != overload.UNANSWERED
    assert np.all(run.sent >= due) and np.all(run.received[answered] >= run.sent[answered])
    assert np.isnan(run.received[~answered]).all()


def overload_result(p99_ms: float, goodput: float, lost: int, wrong: bool = False, first_p99_ms: float = 450.0) -> dict:
    def factor(value: float) -> dict:
        pct = {"p50": 200.0, "p90": 300.0, "p99": p99_ms, "max": p99_ms}
        first = {**pct, "p99": first_p99_ms}
        return {"factor": value, "offered_rps": 1000 * value, "latency_ms": pct, "server_ms": pct,
                "first_second_latency_ms": first,
                "generator_behind_ms": pct, "refused_share": 1 - 1 / value, "goodput_over_capacity": goodput,
                "lost": lost, "duplicate_replies": 0, "cpu_s_per_s": {"manager": 0.7, "worker": 0.6, "generator": 0.2},
                "cpu_us_per_request": {"manager": 31.5, "worker": 240.0}, "kernel_busy": 0.82,
                "verify": {"ok": not wrong, "wrong": ["h differs"] if wrong else []}}

    capacity = {"requests_per_s": 1000.0, "cells_per_s": 22500.0, "mean_batch_size": 63.0, "window": 256,
                "failed": 0, "estimated_cells_per_s": 23000.0, "warm_up_cells_per_s": 26000.0,
                "cpu_s_per_s": {"manager": 0.6, "worker": 0.8}}
    result = {"capacity": capacity, "capacity_after": {**capacity, "requests_per_s": 700.0},
              "factors": [factor(f) for f in overload.FACTORS]}
    result["targets"] = overload.goals(result)
    return result


def test_overload_goals_are_met_or_missed_per_factor():
    good = overload_result(p99_ms=400.0, goodput=0.95, lost=0)
    assert all(t["met"] for t in good["targets"]) and len(good["targets"]) == 4 * len(overload.FACTORS)
    assert not overload.problems(good)
    assert "| 10x | 10000 | 200 | 400 | 450 | 400 | 90% | 0.95 | 0 |" in overload.table(good)
    assert "| 0.70, 0.60, 0.20 | 31.5 | 0.82 |" in overload.table(good)
    assert "again after the loads: 700 req/s (0.70x); the machine's other load changed" in overload.table(good)
    assert ("CPU s/s manager 0.60, worker 0.80); the server's estimate: 23,000 cells/s, timed at warm-up: "
            "26,000 cells/s") in overload.table(good)
    slow = overload_result(p99_ms=600.0, goodput=0.8, lost=0, first_p99_ms=900.0)
    missed = {t["what"].split(": ", 1)[1] for t in slow["targets"] if not t["met"]}
    assert missed == {"accepted p99 ms", "goodput / capacity", "accepted p99 ms in the cold server's first second"}
    assert not overload.problems(slow)  # missed goals are measurements, not failures


def test_overload_fails_on_a_lost_request_or_a_wrong_answer():
    lost = overload_result(p99_ms=400.0, goodput=0.95, lost=2)
    assert not next(t for t in lost["targets"] if t["what"].endswith("lost requests"))["met"]
    assert overload.problems(lost)[0] == "1.2x: 2 requests never answered, 0 answered twice"
    wrong = overload.problems(overload_result(p99_ms=400.0, goodput=0.95, lost=0, wrong=True))
    assert wrong == [f"{f:g}x: answers differ from the reference: h differs" for f in overload.FACTORS]
    failed = overload_result(p99_ms=400.0, goodput=0.95, lost=0)
    failed["capacity_after"] = {**failed["capacity"], "failed": 3}
    assert overload.problems(failed) == ["the capacity run got 3 error replies"]


def test_the_capacity_config_is_the_default_config_without_refusal_by_expected_wait(tmp_path: Path, monkeypatch):
    copy = load_config(overload.capacity_config(tmp_path))
    original = load_config(overload.DEFAULT_CONFIG)
    assert original.server.max_queue_delay_ms > 0 and copy.server.max_queue_delay_ms == 0
    assert copy.models == original.models and copy.scheduler == original.scheduler
    odd = tmp_path / "odd" / "default.toml"  # weights written in a form the copy does not rewrite
    odd.parent.mkdir()
    odd.write_text(overload.DEFAULT_CONFIG.read_text().replace('weights = "../weights/', "weights = '../weights/")
                   .replace('.pt"', ".pt'"))
    monkeypatch.setattr(overload, "DEFAULT_CONFIG", odd)
    with pytest.raises(SystemExit, match="could not be copied with max_queue_delay_ms = 0"):
        overload.capacity_config(tmp_path)


def test_only_the_cellular_policys_server_gets_the_running_batch_and_workers_asked_for():
    assert serve_options("cellular", None) == ("--workers", "1")
    assert serve_options("cellular", "worker", 2) == ("--running-batch", "worker", "--workers", "2")
    assert serve_options("padded", "worker", 2) == () and serve_options("graph", None, 2) == ()


def test_the_json_says_who_decided_the_steps_on_the_benchmarks_cpu_workers():
    config = load_config(overload.DEFAULT_CONFIG)
    assert steps_decided_by(config, None, 2) == steps_decided_by(config, "auto", 2) == "worker"  # the default
    assert steps_decided_by(config, None, 1) == steps_decided_by(config, "manager", 2) == "manager"


def test_a_preset_run_needs_a_worker(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        bench_main(["lstm", "--workers", "0"])
    assert "--workers must be at least 1, got 0" in capsys.readouterr().err
