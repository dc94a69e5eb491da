"""`./scripts/bench startup` on a real manager process: it is timed to its first answer, its memory is
read while it runs, and it is stopped afterwards."""

from __future__ import annotations

from pathlib import Path

import psutil
from conftest import SMALL_LSTM, write_config

from batchmaker.bench import startup


def test_the_manager_alone_is_timed_to_its_first_answer_and_stopped(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    seconds, rss = startup.manager_alone(config.path, config.server.address)
    assert 0 < seconds < 120 and rss > 10 * startup.MB  # a Python process with numpy and zmq loaded
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # nothing left running


def test_the_table_gives_medians_and_ranges():
    spread = {"runs": [1.0, 3.0, 2.0], "median": 2.0, "min": 1.0, "max": 3.0}
    result = {
        "describe": "abc",
        "manager_start_s": spread,
        "manager_alone_rss_mb": spread,
        "served_rss_mb": {"supervisor": spread, "manager": spread, "worker": spread},
    }
    table = startup.table(result)
    assert "medians of 3 manager starts and 3 whole servers" in table
    assert "| manager alone: launch to first answer, s | 2.00 (1.00 to 3.00) |" in table
    assert "| served, worker: resident memory, MB | 2 (1 to 3) |" in table
