"""`./scripts/bench ceiling`'s measurement on a real server: the manager's CPU per request and per task
is read from its process around a closed-loop run, and shown in the table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import SMALL_LSTM, wait_until, write_config

from batchmaker.bench import ceiling
from batchmaker.bench.generator import request_frames
from batchmaker.bench.sweep import ServedPolicy
from batchmaker.common.models import build_model

# Processes' CPU time is read in clock ticks (10 ms): the run is long enough that the worker's time beyond its cells
# (~50 µs a request here) is well above two ticks' error
REQUESTS = 2000


def kernels_reported(served: ServedPolicy) -> bool:
    return all(worker["kernel_busy_s"] is not None for worker in served.stats()["workers"].values())


def test_a_run_reports_the_managers_cpu_per_request_and_per_task_and_the_workers_beyond_its_cells(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    frames = request_frames("lstm", [{"tokens": list(range(1, 23))}] * REQUESTS)
    options = ("--running-batch", "manager")
    with ServedPolicy(config.path, config.server.address, "cellular", "lstm", *options) as served:
        replies, manager = ceiling.measure(served, frames, build_model(config.models["lstm"]))
    assert replies.lost == 0 and all(reply["ok"] for reply in replies.replies)
    assert 0 < manager["worker_cpu_us_per_task_beyond_cells"] < manager["worker_cpu_us_per_task"]
    assert manager["tasks"] >= 2  # every request has 22 steps: a lane task takes 16 at most (the default)
    assert manager["manager_cpu_us_per_request"] > 0
    assert manager["manager_cpu_us_per_task"] > 0
    assert manager["manager_cpu_us_per_task"] * manager["tasks"] == pytest.approx(
        manager["manager_cpu_us_per_request"] * REQUESTS
    )


def test_with_the_workers_deciding_the_steps_there_is_no_task_and_the_worker_is_measured_per_request(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    frames = request_frames("lstm", [{"tokens": list(range(1, 23))}] * REQUESTS)
    options = ("--running-batch", "worker")
    with ServedPolicy(config.path, config.server.address, "cellular", "lstm", *options) as served:
        wait_until(lambda: kernels_reported(served), "the worker's first report of its kernels' time")
        replies, measured = ceiling.measure(served, frames, build_model(config.models["lstm"]))
    assert replies.lost == 0 and all(reply["ok"] for reply in replies.replies)
    assert measured["tasks"] == 0 and measured["steps"] > 0 and 0 < measured["kernel_busy"] <= 1
    assert math.isnan(measured["manager_cpu_us_per_task"]) and math.isnan(measured["worker_cpu_us_per_task"])
    assert 0 < measured["worker_cpu_us_per_request_beyond_cells"] < measured["worker_cpu_us_per_request"]


def test_the_table_shows_the_managers_cpu_per_request_and_per_task():
    row = {
        "row": "LSTM, WMT lengths",
        "requests_per_s": 12000.0,
        "cells_per_s": 260000.0,
        "cells_per_request": 21.7,
        "manager_cpu_us_per_request": 41.0,
        "manager_cpu_us_per_task": 120.5,
        "worker_cpu_us_per_request": 30.0,
        "worker_cpu_us_per_request_beyond_cells": 6.25,
        "kernel_busy": 0.74,
        "failed": 0,
        "verify": {"ok": True, "checked": 40, "wrong": []},
    }
    result = {
        "describe": "abc",
        "window": 2000,
        "running_batch": "worker",
        "generator_alone_requests_per_s": 50000.0,
        "rows": [row],
    }
    table = ceiling.table(result)
    assert "each step decided by the worker" in table
    header = "| manager CPU µs per request | per task | worker CPU µs per request | beyond its cells | kernels busy |"
    assert header in table
    assert "| LSTM, WMT lengths | 12,000 | 260,000 | 21.7 | 41.0 | 120.5 | 30.0 | 6.2 | 0.74 | 40 ok |" in table
