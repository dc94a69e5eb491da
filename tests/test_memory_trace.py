"""The manager's memory trace: growth between snapshots names the call stacks that allocated it, a
served manager asked for one reports while it serves and when it stops, and a bad interval is refused."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
from conftest import SMALL_LSTM, start_server, stop_server, wait_until, write_config

from batchmaker.clients import Client
from batchmaker.manager.loop.main import main
from batchmaker.manager.observability.memory_trace import EVERY_ENV, PATH_ENV, MemoryTrace, growth


def hoard(kept: list[bytes], count: int) -> None:
    kept.extend(bytes(1000) + bytes([i % 256]) for i in range(count))


def test_growth_names_the_call_stack_that_kept_the_memory():
    kept: list[bytes] = []
    tracemalloc.start(4)
    try:
        first = tracemalloc.take_snapshot()
        hoard(kept, 2_000)
        report = growth(first, tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    head, top = report.split("\n\n")[:2]
    assert head.startswith("traced: ") and "MiB" in head
    grown_kib = float(top.split(" KiB")[0])
    assert grown_kib >= 2_000, top  # 2,000 blocks of 1 KB, reported first
    assert "+2000 blocks" in top
    assert f"{Path(__file__).name}\", line" in top and "kept.extend" in top


@pytest.mark.parametrize("every", ["0", "-1", "soon", "nan"])
def test_an_interval_that_is_not_a_positive_number_is_refused(monkeypatch, tmp_path: Path, every: str, caplog):
    monkeypatch.setenv(PATH_ENV, str(tmp_path / "memory.txt"))
    monkeypatch.setenv(EVERY_ENV, every)
    with pytest.raises(ValueError, match=f"{EVERY_ENV} must be a number of seconds above 0"):
        MemoryTrace.from_environment()
    assert main(["--config", str(tmp_path / "none.toml"), "--worker-address", "ipc://unused"]) == 2
    assert not (tmp_path / "memory.txt").exists()


def test_without_the_variable_nothing_is_traced(monkeypatch):
    monkeypatch.delenv(PATH_ENV, raising=False)
    assert MemoryTrace.from_environment() is None


def test_a_served_manager_reports_its_growth_while_serving_and_when_it_stops(monkeypatch, tmp_path: Path):
    report = tmp_path / "memory.txt"
    monkeypatch.setenv(PATH_ENV, str(report))
    monkeypatch.setenv(EVERY_ENV, "0.2")
    config = write_config(tmp_path, SMALL_LSTM)
    server = start_server(config, workers=1)
    try:
        with Client(server.address, timeout=60) as client:

            def reported() -> bool:
                client.infer("lstm", {"tokens": list(range(1, 20))})
                return report.exists() and report.read_text().startswith("traced: ")

            wait_until(reported, "a growth report from the manager")
        report.unlink()
    finally:
        stop_server(server)
    assert report.read_text().startswith("traced: ")  # written again on the way out
