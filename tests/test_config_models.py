"""Unit tests for the [models.x] tables of common/config.py, model building (common/models/base.py)
and weight loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_config import MODEL, ROOT, config_error, write

from batchmaker.common.config import ConfigError, load_config
from batchmaker.common.models import build_model
from batchmaker.common.models.base import Model, save_weights
from batchmaker.common.models.chain_cells import LSTMModel

# -- [models.x] -------------------------------------------------------------------------------------------


def test_model_without_builder(tmp_path: Path) -> None:
    text = MODEL.replace('builder = "batchmaker.common.models.lstm:build"\n', "")
    config_error(tmp_path, text, "models.lstm", "builder")


def test_builder_without_colon(tmp_path: Path) -> None:
    text = MODEL.replace("batchmaker.common.models.lstm:build", "batchmaker.common.models.lstm.build")
    config_error(tmp_path, text, "models.lstm", "builder", "batchmaker.common.models.lstm.build")


def test_model_without_weights(tmp_path: Path) -> None:
    text = MODEL.replace('weights = "lstm.pt"\n', "")
    config_error(tmp_path, text, "models.lstm", "weights")


@pytest.mark.parametrize("sizes", ["[]", "[0]", "[-1]", "[1, -4]", "[1, 2.5]", '["1"]', "4", "[true]"])
def test_bad_batch_sizes(tmp_path: Path, sizes: str) -> None:
    text = MODEL.replace("batch_sizes = [1, 2, 4]", f"batch_sizes = {sizes}")
    config_error(tmp_path, text, "models.lstm", "batch_sizes")


def test_model_without_batch_sizes(tmp_path: Path) -> None:
    text = MODEL.replace("batch_sizes = [1, 2, 4]\n", "")
    config_error(tmp_path, text, "[models.lstm] batch_sizes is required: the batch sizes its cells run at")


def test_a_misspelt_batch_sizes_is_named_as_a_typo(tmp_path: Path) -> None:
    text = MODEL.replace("batch_sizes = [1, 2, 4]", "batch_size = [1, 2, 4]")
    config_error(tmp_path, text, "[models.lstm] batch_sizes is required ('batch_size' is there: a typo?)")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_readme_names_every_weight_of_the_chain_models(tmp_path: Path, kind: str) -> None:
    text = MODEL.replace("batchmaker.common.models.lstm:build", f"batchmaker.common.models.{kind}:build")
    config = load_config(write(tmp_path, text))
    readme = (ROOT / "README.md").read_text()
    for key in build_model(config.models["lstm"]).weight_shapes():
        assert f"`{key}`" in readme, f"README.md does not name {key}"


@pytest.mark.parametrize("priority", ["1.5", '"high"', "true", "[1]"])
def test_non_integer_priority(tmp_path: Path, priority: str) -> None:
    config_error(tmp_path, MODEL + f"priority = {priority}\n", "models.lstm", "priority")


def test_non_integer_priority_in_a_cell_table(tmp_path: Path) -> None:
    text = MODEL + '\n[models.lstm.cells.layer0]\npriority = "high"\n'
    config_error(tmp_path, text, "models.lstm.cells.layer0", "priority")


def test_unknown_key_in_a_cell_table(tmp_path: Path) -> None:
    text = MODEL + "\n[models.lstm.cells.layer0]\npriority = 2\nmax_batch = 8\n"
    config_error(tmp_path, text, "models.lstm.cells.layer0", "max_batch")


def test_bad_batch_sizes_in_a_cell_table(tmp_path: Path) -> None:
    text = MODEL + "\n[models.lstm.cells.layer0]\nbatch_sizes = []\n"
    config_error(tmp_path, text, "models.lstm.cells.layer0", "batch_sizes")


def test_cell_entry_must_be_a_table(tmp_path: Path) -> None:
    config_error(tmp_path, MODEL + "\n[models.lstm.cells]\nlayer0 = 3\n", "models.lstm.cells.layer0")


def test_model_must_be_a_table(tmp_path: Path) -> None:
    config_error(tmp_path, "[models]\nlstm = 3\n", "models.lstm")


# -- paths and inheritance --------------------------------------------------------------------------------


def test_relative_weights_resolve_against_the_config_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    text = MODEL.replace('weights = "lstm.pt"', 'weights = "../weights/lstm.pt"')
    write(configs, text)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # Loaded through a relative path from another working directory, it still resolves beside the config.
    config = load_config(Path("..") / "configs" / "config.toml")
    assert config.models["lstm"].weights == (tmp_path / "weights" / "lstm.pt").resolve()
    assert config.models["lstm"].weights.is_absolute()


def test_absolute_weights_path_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "store" / "w.pt"
    config = load_config(write(tmp_path, MODEL.replace('"lstm.pt"', f'"{target}"')))
    assert config.models["lstm"].weights == target


def test_per_cell_overrides_inherit_the_model_defaults(tmp_path: Path) -> None:
    text = (
        MODEL
        + "priority = 3\n"
        + "\n[models.lstm.cells.layer0]\npriority = 5\n"
        + "\n[models.lstm.cells.layer1]\nbatch_sizes = [8, 1, 8]\n"
    )
    model = load_config(write(tmp_path, text)).models["lstm"]
    assert model.default_cell.batch_sizes == (1, 2, 4) and model.default_cell.priority == 3
    layer0 = model.cell_config("layer0")
    assert layer0.batch_sizes == (1, 2, 4), "batch_sizes not overridden: inherited from the model"
    assert layer0.priority == 5
    layer1 = model.cell_config("layer1")
    assert layer1.batch_sizes == (1, 8), "batch sizes are sorted and deduplicated"
    assert layer1.priority == 3, "priority not overridden: inherited from the model"
    assert model.cell_config("layer7") == model.default_cell
    assert "cells" not in model.params and "priority" not in model.params


def test_cell_overrides_reach_the_model_cell_types(tmp_path: Path) -> None:
    text = MODEL + "num_layers = 2\n\n[models.lstm.cells.layer1]\nbatch_sizes = [2, 16]\npriority = 9\n"
    model = build_model(load_config(write(tmp_path, text)).models["lstm"])
    specs = model.cell_types
    assert specs["lstm/layer0"].batch_sizes == (1, 2, 4) and specs["lstm/layer0"].priority == 0
    assert specs["lstm/layer1"].batch_sizes == (2, 16) and specs["lstm/layer1"].priority == 9


# -- building models --------------------------------------------------------------------------------------


def model_config(tmp_path: Path, text: str = MODEL):
    return load_config(write(tmp_path, text)).models["lstm"]


@pytest.mark.parametrize("builder", ["no_such_package.models:build", "batchmaker.common.models.lstm:no_such_function"])
def test_build_model_with_unimportable_builder(tmp_path: Path, builder: str) -> None:
    config = model_config(tmp_path, MODEL.replace("batchmaker.common.models.lstm:build", builder))
    with pytest.raises(ConfigError) as excinfo:
        build_model(config)
    assert builder in str(excinfo.value)
    assert "lstm" in str(excinfo.value)


def test_build_model_with_builder_that_returns_no_model(tmp_path: Path) -> None:
    config = model_config(tmp_path, MODEL.replace("batchmaker.common.models.lstm:build", "builtins:repr"))
    with pytest.raises(ConfigError) as excinfo:
        build_model(config)
    assert "builtins:repr" in str(excinfo.value)


def test_build_model_returns_the_lstm(tmp_path: Path) -> None:
    model = build_model(model_config(tmp_path))
    assert isinstance(model, Model) and isinstance(model, LSTMModel)
    assert model.name == "lstm" and model.num_layers == 1 and model.embedding_size == 8
    assert list(model.cell_types) == ["lstm/layer0"]


def test_lstm_refuses_unknown_param(tmp_path: Path) -> None:
    config = model_config(tmp_path, MODEL + "hiden_size = 32\n")
    with pytest.raises(ConfigError) as excinfo:
        build_model(config)
    assert "hiden_size" in str(excinfo.value)


@pytest.mark.parametrize(
    "line", ["hidden_size = 0", "hidden_size = -3", 'hidden_size = "64"', "hidden_size = 1.5", "hidden_size = true"]
)
def test_lstm_refuses_bad_hidden_size(tmp_path: Path, line: str) -> None:
    config = model_config(tmp_path, MODEL.replace("hidden_size = 16", line))
    with pytest.raises(ConfigError) as excinfo:
        build_model(config)
    assert "hidden_size" in str(excinfo.value)


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size"])
def test_lstm_requires_sizes(tmp_path: Path, key: str) -> None:
    text = "\n".join(line for line in MODEL.splitlines() if not line.startswith(f"{key} ="))
    with pytest.raises(ConfigError) as excinfo:
        build_model(model_config(tmp_path, text))
    assert key in str(excinfo.value)


def with_param(key: str, value: str, text: str = MODEL) -> str:
    """MODEL with `key = value`, replacing the key's line if it has one."""
    lines = [line for line in text.splitlines() if not line.startswith(f"{key} =")]
    return "\n".join(lines) + f"\n{key} = {value}\n"


@pytest.mark.parametrize(
    ("key", "value"), [("num_layers", "0"), ("vocab_size", "0"), ("max_length", "0"), ("embedding_size", "-1")]
)
def test_lstm_refuses_other_non_positive_sizes(tmp_path: Path, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        build_model(model_config(tmp_path, with_param(key, value)))
    assert key in str(excinfo.value)


# -- weights ----------------------------------------------------------------------------------------------


def test_load_weights_missing_file(tmp_path: Path) -> None:
    model = build_model(model_config(tmp_path))
    assert not model.config.weights.exists()
    with pytest.raises(ConfigError) as excinfo:
        model.load_weights()
    message = str(excinfo.value)
    assert "batchmaker init-weights" in message
    assert str(model.config.weights) in message


def test_load_weights_with_shapes_that_disagree_with_the_config(tmp_path: Path) -> None:
    small = build_model(model_config(tmp_path))
    save_weights(small.init_weights(seed=1), small.config.weights)
    # Same file, but the config now asks for a wider hidden state.
    wider = build_model(model_config(tmp_path, MODEL.replace("hidden_size = 16", "hidden_size = 32")))
    assert wider.config.weights == small.config.weights
    with pytest.raises(ConfigError) as excinfo:
        wider.load_weights()
    message = str(excinfo.value)
    assert str(wider.config.weights) in message
    assert "Set the sizes in [models.lstm] to those the weights were trained with" in message, message
    assert "delete" not in message and "init-weights" not in message, f"the advice must keep the user's file: {message}"


def test_load_weights_lacking_a_layer(tmp_path: Path) -> None:
    one_layer = build_model(model_config(tmp_path))
    save_weights(one_layer.init_weights(seed=1), one_layer.config.weights)
    two_layers = build_model(model_config(tmp_path, MODEL + "num_layers = 2\n"))
    with pytest.raises(ConfigError) as excinfo:
        two_layers.load_weights()
    assert "lstm.weight_ih_l1" in str(excinfo.value)


def test_load_weights_that_are_not_a_weights_file(tmp_path: Path) -> None:
    model = build_model(model_config(tmp_path))
    model.config.weights.write_bytes(b"this is not a torch file")
    with pytest.raises(ConfigError) as excinfo:
        model.load_weights()
    assert str(model.config.weights) in str(excinfo.value)


def test_load_weights_round_trip(tmp_path: Path) -> None:
    model = build_model(model_config(tmp_path))
    state = model.init_weights(seed=7)
    save_weights(state, model.config.weights)
    loaded = model.load_weights()
    assert set(loaded) == set(state)
    for key, tensor in state.items():
        assert loaded[key].dtype == torch.float32
        assert torch.equal(loaded[key], tensor)
    assert set(model.make_cells(loaded)) == {"lstm/layer0"}
