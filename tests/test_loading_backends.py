"""Versions loaded and unloaded at run time, on each backend: the CUDA one on the fake runtime
(tests/cuda_fakes.py), whose recorder sees any read of weights their stream has not finished writing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import SMALL_LSTM, write_config
from cuda_fakes import FakeRuntime
from test_cuda_backend import fake_backend, lstm_task
from test_cuda_fake import all_cells

from batchmaker.common.config import Config, model_to_wire
from batchmaker.worker.cpu import CpuBackend
from batchmaker.worker.loading import load_version


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return write_config(tmp_path, SMALL_LSTM)


def version_two(config: Config, first_cell: int) -> dict:
    """The `load` message the manager sends for version 2 of the config's LSTM."""
    model = dataclasses.replace(config.models["lstm"], name="lstm@2")
    return {"model": model_to_wire(model), "first_cell": first_cell, "cells": ["lstm@2/layer0"]}


def test_a_cuda_worker_loads_a_version_after_its_cells_and_drops_its_weights(config: Config):
    layout = all_cells(config.path)
    runtime = FakeRuntime()
    with fake_backend(layout, runtime) as (backend, runtime, recorder):
        backend.warm_up()
        synchronized = runtime.synchronized
        assert load_version(backend, version_two(config, first_cell=3)) is None  # two versions it never had
        specs, cells = backend.cells
        assert [spec.key if spec else None for spec in specs] == ["lstm/layer0", None, None, "lstm@2/layer0"]
        assert cells[1] is None and cells[2] is None
        assert all(p.device == torch.device("cuda:0") for p in cells[3].parameters())
        assert runtime.synchronized == synchronized + 1  # its weights are complete before its stream reads them
        backend.issue(lstm_task(1, layout, backend, cell_index=3))
        assert backend.finish(1) is None
        assert recorder.hazards == []
        backend.drop_cells([3])
        assert backend.cells[1][3] is None
        backend.issue(lstm_task(2, layout, backend, cell_index=3))
        assert "NoneType" in backend.finish(2)  # a task of a dropped cell fails alone; the worker serves on
        backend.issue(lstm_task(3, layout, backend))
        assert backend.finish(3) is None


def test_a_load_that_cannot_be_served_says_why_and_changes_nothing(config: Config, tmp_path: Path):
    (tmp_path / "small").mkdir()
    small = write_config(tmp_path / "small", SMALL_LSTM.replace("hidden_size = 64", "hidden_size = 32"))
    layout = all_cells(config.path)
    with fake_backend(layout) as (backend, _, _):
        message = version_two(config, first_cell=1)
        message["model"]["weights"] = str(small.models["lstm"].weights)
        error = load_version(backend, message)
        assert error is not None and str(small.models["lstm"].weights) in error
        taken = load_version(backend, version_two(config, first_cell=0))  # indices this worker already has
        assert taken.startswith("ValueError: cell types from index 0")
        assert [spec.key for spec in backend.cells[0]] == ["lstm/layer0"]


def test_a_cpu_worker_loads_and_drops_a_version(config: Config):
    specs, cells, kinds = all_cells(config.path)
    backend = CpuBackend(cells, specs, kinds, 64, 64)
    try:
        assert load_version(backend, version_two(config, first_cell=1)) is None
        assert [spec.key for spec in backend.cells[0]] == ["lstm/layer0", "lstm@2/layer0"]
        backend.drop_cells([1])
        assert backend.cells[1] == [cells[0], None]
    finally:
        backend.close()
