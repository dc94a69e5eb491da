"""The manager and the supervisor plan with numpy alone: serving the built-in models, neither
process loads torch (only workers do), while a model written against the whole `Model`
interface is still planned by that model itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import write_config

from batchmaker.clients import Client
from batchmaker.common.config import ConfigError
from batchmaker.common.models.base import Model, Planner, build_model, build_planner
from batchmaker.manager.commands.launcher import ServerProcess, roles

ALL_MODELS = """
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
batch_sizes = [1, 2, 4, 8]
weights = "lstm.pt"
vocab_size = 50
hidden_size = 8
max_length = 40

[models.gru]
builder = "batchmaker.common.models.gru:build"
batch_sizes = [1, 2, 4, 8]
weights = "gru.pt"
vocab_size = 50
hidden_size = 8
num_layers = 2
max_length = 40

[models.seq2seq]
builder = "batchmaker.common.models.seq2seq:build"
batch_sizes = [1, 2, 4, 8]
weights = "seq2seq.pt"
src_vocab_size = 50
tgt_vocab_size = 50
hidden_size = 8
max_length = 40

[models.treelstm]
builder = "batchmaker.common.models.treelstm:build"
batch_sizes = [1, 2, 4, 8]
weights = "treelstm.pt"
vocab_size = 50
hidden_size = 8
num_classes = 3

[models.childsum]
builder = "batchmaker.common.models.childsum:build"
batch_sizes = [1, 2, 4, 8]
weights = "childsum.pt"
vocab_size = 50
hidden_size = 8
"""

ELMAN = """
[models.elman]
builder = "examples.elman:build"
batch_sizes = [1, 2, 4, 8]
weights = "elman.pt"
vocab_size = 50
hidden_size = 8
"""

TREE = {"tree": {"tokens": [4, 7, -1], "parents": [2, 2, -1]}}
INPUTS = {
    "lstm": {"tokens": [1, 2, 3]},
    "gru": {"tokens": [4, 5]},
    "seq2seq": {"tokens": [6, 7, 8], "max_len": 4},
    "treelstm": TREE,
    "childsum": TREE,
}


def _loads_torch(process: psutil.Process) -> bool:
    """Whether torch's native library is mapped into the process (it is once `import torch` ran)."""
    return any("libtorch" in Path(region.path).name for region in process.memory_maps())


def test_the_built_in_models_are_planned_without_their_cells(tmp_path: Path):
    config = write_config(tmp_path, ALL_MODELS)
    for name, model_config in config.models.items():
        planner, model = build_planner(model_config), build_model(model_config)
        assert isinstance(planner, Planner) and not isinstance(planner, Model)
        assert type(model).__mro__[1] is type(planner)  # the model is its planner plus cells
        assert planner.cell_types == model.cell_types and planner.describe() == model.describe()
        plan, same = planner.plan(INPUTS[name]), model.plan(INPUTS[name])
        assert plan.plan.nodes == same.plan.nodes and plan.plan.lane_cells == same.plan.lane_cells


def test_a_model_without_a_planner_of_its_own_is_planned_by_the_whole_model(tmp_path: Path):
    config = write_config(tmp_path, ELMAN)
    assert isinstance(build_planner(config.models["elman"]), Model)


def test_a_planner_function_that_returns_no_planner_is_refused(tmp_path: Path, monkeypatch):
    (tmp_path / "odd_model.py").write_text(
        "def planner(config):\n    return object()\n\n\ndef build(config):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, ELMAN)
    odd = dataclasses.replace(config.models["elman"], builder="odd_model:build")
    with pytest.raises(ConfigError, match="did not return a Model"):
        build_planner(odd)


def test_neither_the_supervisor_nor_the_manager_loads_torch(tmp_path: Path):
    config = write_config(tmp_path, ALL_MODELS)
    server = ServerProcess(config.path, "127.0.0.1", None)
    try:
        server.wait_ready()
        with Client(server.address, timeout=60) as client:
            for name, inputs in INPUTS.items():
                outputs = client.infer(name, inputs).outputs
                assert all(np.isfinite(np.asarray(value, np.float64)).all() for value in outputs.values())
        by_role = {role: psutil.Process(pid) for pid, role in roles(server.process).items()}
        assert set(by_role) == {"supervisor", "manager", "worker"}
        assert _loads_torch(by_role["worker"])  # the probe sees torch where it is
        assert not _loads_torch(by_role["supervisor"])
        assert not _loads_torch(by_role["manager"])
    finally:
        assert server.stop() == []
