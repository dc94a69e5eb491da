"""The results page and the README's block: made from bench JSON with the ratios and verdict lines its numbers
give, any peer a JSON reports included; the published ones equal what the generator makes of docs/benchmarks/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from batchmaker.bench import results_page, results_readme
from batchmaker.bench.__main__ import main
from batchmaker.bench.presets import PRESETS
from batchmaker.bench.results import idle_line, load

MACHINE = {"cpu": "x86_64", "cores": 2, "memory_gib": 8.0, "platform": "Linux-test", "python": "3.11", "torch": "2.x"}
TRITON = {"name": "Triton 2.50", "setting": "HTTP, 64 requests outstanding", "requests_per_s": 400.0,
          "cellular_requests_per_s": 600.0, "p90_ms": 40.0, "cellular_p90_ms": 20.0}  # fmt: skip


def workload(name: str, policies: dict[str, tuple[float, float]], **extra: Any) -> dict[str, Any]:
    """A preset's JSON as `bench` writes it, with only what the page reads: (peak, p90 at 50%) per policy."""
    summary = {p: {"peak_throughput": peak, "p90_ms_at_50pct_padded_peak": p90} for p, (peak, p90) in policies.items()}
    return {"preset": name, "description": PRESETS[name].description, "quick": False, "commit": "abc1234",
            "machine": MACHINE, "reference_policy": PRESETS[name].reference, "summary": summary, **extra}  # fmt: skip


def dynet(offline: float, closed: float) -> dict[str, Any]:
    return {
        "dynet": {"dynet": "2.1.2", "batch": 64, "trees_per_s": offline},
        "closed_loop": {"window": 256, "trees_per_s": closed},
    }


def idle_row(row: str, served: float, in_process: float) -> dict[str, Any]:
    return {"row": row, "served_ms": {"p50": served, "p99": 2 * served},
            "in_process_ms": {"p50": in_process, "p99": 2 * in_process},
            "ratio": {"p50": served / in_process, "p99": served / in_process}}  # fmt: skip


def overload() -> dict[str, Any]:
    factor = {"factor": 1.2, "offered_rps": 1200.0, "seconds": 30.0, "sent": 36000, "accepted": 33000,
              "refused": 3000, "other_errors": {}, "lost": 0, "duplicate_replies": 0, "verify": {"wrong": []},
              "latency_ms": {"p99": 310.0}}  # fmt: skip
    return {"preset": "overload", "commit": "abc1234", "machine": MACHINE, "config": "configs/default.toml",
            "capacity": {"requests_per_s": 1000.0}, "capacity_after": {"requests_per_s": 1100.0},
            "factors": [factor]}  # fmt: skip


def chaos() -> dict[str, Any]:
    fault = {"fault": "kill -9 worker", "target": "127.0.0.2", "requests": 400, "ok": 398, "errors": {"OVERLOADED": 1},
             "lost": 1, "answered_twice": 0, "wrong": 0}  # fmt: skip
    return {"preset": "chaos", "describe": "abc1234", "machine": MACHINE, "rate_rps": 40.0, "seconds_of_load": 10.0,
            "window_s": 5.0, "faults": [fault]}  # fmt: skip


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    """A small hand-made `bench` directory: a win, a tie, a loss, DyNet, a Triton peer, idle, overload, chaos."""
    out = tmp_path / "bench"
    out.mkdir()
    files = {
        "lstm": workload("lstm", {"cellular": (1000.0, 50.0), "padded": (500.0, 200.0)}),
        "seq2seq": workload("seq2seq", {"cellular": (300.0, 100.0), "padded": (290.0, 105.0)}),
        "tree16": workload("tree16", {"cellular": (800.0, 150.0), "graph": (1000.0, 60.0)}),
        "treelstm": workload("treelstm", {"cellular": (600.0, 80.0), "graph": (400.0, 160.0)}, dynet=dynet(875, 700)),
        "http": {"preset": "http", "commit": "abc1234", "machine": MACHINE, "peers": [TRITON]},
        "idle": {"preset": "idle", "describe": "abc1234", "machine": MACHINE,
                 "rows": [idle_row("LSTM, WMT sentences", 10.0, 2.0), idle_row("Seq2Seq", 26.0, 20.0)]},
        "overload": overload(),
        "chaos": chaos(),
    }  # fmt: skip
    for name, content in files.items():
        (out / f"{name}.json").write_text(json.dumps(content))
    (out / "lstm-latency.png").write_bytes(b"\x89PNG")
    return out


def verdict_line(page: str, start: str) -> str:
    (line,) = [line for line in page.splitlines() if line.startswith(f"- **{start}")]
    return line


def test_the_page_has_each_workloads_table_with_its_ratios_and_peers(bench_dir: Path):
    assert main(["results", "--from", str(bench_dir)]) == 0
    page = (bench_dir / "results.md").read_text()
    assert "**Machine:** 2 x86_64 cores, 8.0 GiB, Linux-test; Python 3.11, torch 2.x." in page
    assert "**Commit:** `abc1234`." in page
    assert "| **cellular** | 1,000 | 50.0 |  |  |\n| padded | 500 | 200.0 | 2.00x | 0.25x |" in page
    assert "| padded | 290 | 105.0 | 1.03x | 0.95x |" in page
    assert "| graph | 1,000 | 60.0 | 0.80x | 2.50x |" in page
    assert "| DyNet 2.1.2 | 875 | - | 0.80x |  |" in page  # in the treelstm table: 700 closed loop over 875
    # Any JSON's peers reach the table of other systems, with no code naming them.
    assert (
        "| [http.json](http.json) | Triton 2.50 | not recorded | HTTP, 64 requests outstanding | 400 | 600 | 1.50x "
        "| 40.0 / 20.0 |" in page
    )
    assert "![lstm-latency](lstm-latency.png)" in page and "lstm-cdf" not in page
    assert "| overload 1.2x capacity (1,200 req/s, 30 s) | 36,000 | 33,000 | 3,000 | 0 | 0 | 310.0 |" in page
    assert "| chaos: kill -9 worker (127.0.0.2) | 400 | 398 | 1 | 1 | 0 | - |" in page
    assert "| LSTM, WMT sentences | 10.00 / 20.00 | 2.00 / 4.00 | 5.0x | 5.0x |" in page
    assert f"./scripts/bench results --from {bench_dir} --page {bench_dir / 'results.md'}" in page
    assert "git checkout abc1234 && ./scripts/bench lstm" in page  # not every preset of `all`: one by one


def test_the_five_lines_follow_from_the_ratios(bench_dir: Path):
    results_page.write(bench_dir, bench_dir / "results.md")
    page = (bench_dir / "results.md").read_text()
    section = page.split("## Where cellular batching wins, loses and does not matter\n\n")[1].split("\n\n")[0]
    assert len(section.splitlines()) == 5
    wins = verdict_line(page, "Wins on peak throughput")
    assert "lstm 2.00x padded (1,000 against 500 req/s)" in wins and "treelstm 1.50x graph" in wins
    assert "tree16" not in wins and "seq2seq" not in wins
    assert "http 1.50x Triton 2.50 (600 against 400 req/s)" in wins  # a run of other systems counts too
    assert "lstm 0.25x padded (50 against 200 ms); treelstm 0.50x graph" in verdict_line(page, "Wins on p90")
    assert "http" not in verdict_line(page, "Wins on p90")  # its p90s are at each way's own peak, not at one load
    loses = verdict_line(page, "Loses")
    assert "tree16 0.80x graph (800 against 1,000 req/s)" in loses and "tree16 2.50x graph (150 against 60 ms)" in loses
    assert "treelstm 0.80x DyNet 2.1.2 (700 against 875 req/s)" in loses
    ties = verdict_line(page, "Does not matter")
    assert "seq2seq 1.03x padded" in ties and "seq2seq 0.95x padded" in ties and "lstm" not in ties
    idle = verdict_line(page, "Idle")
    assert "1.3x-5.0x" in idle and "the server's own path adding 6.0-8.0 ms" in idle


def test_a_system_that_beats_cellular_batching_in_a_run_of_other_systems_is_a_loss(bench_dir: Path):
    peer = {**TRITON, "requests_per_s": 1_084.0, "cellular_requests_per_s": 694.0}
    (bench_dir / "http.json").write_text(json.dumps({"preset": "http", "commit": "abc1234", "peers": [peer]}))
    results_page.write(bench_dir, bench_dir / "results.md")
    assert "http 0.64x Triton 2.50 (694 against 1,084 req/s)" in verdict_line(
        (bench_dir / "results.md").read_text(), "Loses"
    )


@pytest.mark.parametrize(
    ("served", "expected"),
    [
        ((10.0, 26.0), "the server's own path adding 6.0-8.0 ms"),
        ((10.0, 17.0), "the server's own path from taking 3.0 ms off to adding 8.0 ms"),
        ((1.0, 17.0), "the server's own path taking 1.0-3.0 ms off"),
    ],
)
def test_the_idle_line_says_when_serving_beat_the_run_in_process(served: tuple[float, float], expected: str):
    rows = [idle_row("LSTM, WMT sentences", served[0], 2.0), idle_row("Seq2Seq", served[1], 20.0)]
    assert expected in idle_line(rows)


def test_a_peer_in_a_workloads_json_joins_its_table(tmp_path: Path):
    lstm = workload("lstm", {"cellular": (1000.0, 50.0), "padded": (500.0, 200.0)}, peers=[TRITON])
    (tmp_path / "lstm.json").write_text(json.dumps(lstm))
    results_page.write(tmp_path, tmp_path / "results.md")
    page = (tmp_path / "results.md").read_text()
    assert "| padded | 500 | 200.0 | 2.00x | 0.25x |\n| Triton 2.50 | 400 | 40.0 | 1.50x | 0.50x |" in page
    note = "- Triton 2.50 (setup not recorded): HTTP, 64 requests outstanding: 400 against cellular batching's 600"
    assert note in page
    assert "lstm 1.50x Triton 2.50 (600 against 400 req/s)" in verdict_line(page, "Wins on peak throughput")


def test_the_reproduce_section_names_the_runs_of_other_systems_and_where_they_come_from(bench_dir: Path):
    results_page.write(bench_dir, bench_dir / "results.md")
    reproduce = (bench_dir / "results.md").read_text().split("## Reproduce")[1]
    assert "git checkout abc1234 && ./scripts/bench http --out " in reproduce
    assert "records it as skipped: `http` (Triton 2.50); `treelstm` (DyNet 2.1.2)." in reproduce
    for name in ("http", "treelstm"):
        (bench_dir / f"{name}.json").unlink()
    results_page.write(bench_dir, bench_dir / "results.md")
    reproduce = (bench_dir / "results.md").read_text().split("## Reproduce")[1]
    assert "bench http" not in reproduce and "Other systems" not in reproduce


def test_a_directory_without_idle_overload_or_chaos_says_they_were_not_measured(bench_dir: Path):
    for name in ("idle", "overload", "chaos", "http"):
        (bench_dir / f"{name}.json").unlink()
    lstm = json.loads((bench_dir / "lstm.json").read_text())
    (bench_dir / "lstm.json").write_text(json.dumps(dict(lstm, quick=True)))
    results_page.write(bench_dir, bench_dir / "results.md")
    page = (bench_dir / "results.md").read_text()
    assert "**Smoke run:** lstm ran with `--quick`" in page
    assert "**Idle:** not measured here" in page
    assert "Not measured here: `./scripts/bench overload` and `./scripts/bench chaos` write them." in page


def test_the_readme_block_is_rewritten_and_nothing_else(bench_dir: Path, tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# a\n\nbefore\n\n{results_readme.BEGIN}\nold numbers\n{results_readme.END}\n\nafter\n")
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    assert main(["results", "--from", str(bench_dir), "--page", str(page), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"# a\n\nbefore\n\n{results_readme.BEGIN}\n") and text.endswith(
        f"{results_readme.END}\n\nafter\n"
    )
    assert "old numbers" not in text and "[docs/results.md](docs/results.md)" in text
    assert "peak throughput is 2.00x padded's (1,000 against 500 req/s)" in text
    assert "Where it loses: TreeLSTM on identical complete binary trees of 16 leaves" in text
    assert "0.80x DyNet 2.1.2 (64 trees a graph) on treelstm" in text
    assert "1.50x Triton 2.50 (setup not recorded) on http" in text
    assert "![lstm-latency](../bench/lstm-latency.png)" in page.read_text()  # links relative to the page


def test_bad_input_is_refused_with_a_clear_error_and_writes_nothing(tmp_path: Path, bench_dir: Path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["results", "--from", str(empty)]) == 2
    assert "holds no benchmark JSON" in capsys.readouterr().err and not (empty / "results.md").exists()

    readme = tmp_path / "README.md"
    readme.write_text("# no block here\n")
    assert main(["results", "--from", str(bench_dir), "--readme", str(readme)]) == 2
    assert "has no results block" in capsys.readouterr().err
    assert readme.read_text() == "# no block here\n" and not (bench_dir / "results.md").exists()

    only_servers = tmp_path / "servers"
    only_servers.mkdir()
    (only_servers / "servers.json").write_text(json.dumps({"preset": "servers", "machine": MACHINE}))
    assert main(["results", "--from", str(only_servers)]) == 2
    assert "holds no JSON of the presets the page shows" in capsys.readouterr().err

    (bench_dir / "http.json").write_text(json.dumps({"preset": "http", "peers": [{"name": "Triton 2.50"}]}))
    assert main(["results", "--from", str(bench_dir)]) == 2
    assert "http: a peers entry lacks setting, requests_per_s, cellular_requests_per_s" in capsys.readouterr().err

    (bench_dir / "broken.json").write_text("{not json")
    assert main(["results", "--from", str(bench_dir)]) == 2
    assert "broken.json is not JSON" in capsys.readouterr().err


def test_the_published_page_is_what_the_generator_makes_of_docs_benchmarks():
    directory, page, readme = ROOT / "docs" / "benchmarks", ROOT / "docs" / "results.md", ROOT / "README.md"
    assert page.read_text() == results_page.render(load(directory), directory, page, readme), (
        "docs/results.md is stale: ./scripts/bench results --from docs/benchmarks --page docs/results.md "
        "--readme README.md"
    )


def test_the_readme_block_is_what_the_generator_makes_of_docs_benchmarks():
    directory, page, readme = ROOT / "docs" / "benchmarks", ROOT / "docs" / "results.md", ROOT / "README.md"
    assert results_page.readme_block(load(directory), page, readme) in readme.read_text()
