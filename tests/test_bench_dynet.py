"""The treelstm preset's DyNet baseline: skipped cleanly without DyNet, a clear error when the named
interpreter cannot run it, and (where DyNet is installed) the same model's answers at DyNet's speed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import SST_TREELSTM, write_config

from batchmaker.bench import dynet_baseline
from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.presets import PRESETS
from batchmaker.common.models import build_model

DYNET = os.environ.get(dynet_baseline.PYTHON_ENV)


@pytest.fixture
def tree_model(tmp_path: Path):
    model = build_model(write_config(tmp_path, SST_TREELSTM).models["tree"])
    return model, model.load_weights()


def test_without_dynet_the_section_is_skipped(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(dynet_baseline.PYTHON_ENV, raising=False)
    section = dynet_baseline.section(PRESETS["treelstm"], {}, quick=True)
    assert section["skipped"].startswith("DyNet not found") and dynet_baseline.PYTHON_ENV in section["skipped"]
    assert dynet_baseline.ok(section) and dynet_baseline.lines(section) == [f"dynet: skipped: {section['skipped']}"]


def test_an_interpreter_without_dynet_is_a_clear_error(tree_model):
    model, state = tree_model
    trees = DATASETS["sst"]()[:3]
    with pytest.raises(dynet_baseline.DyNetError, match="failed to run the DyNet TreeLSTM: .*No module named 'dynet"):
        dynet_baseline.offline(sys.executable, model, state, trees)  # this project's Python: no DyNet in it
    with pytest.raises(dynet_baseline.DyNetError, match="cannot be run"):
        dynet_baseline.offline("/nonexistent/python", model, state, trees)
    failed = {"error": "BATCHMAKER_DYNET_PYTHON=x failed"}
    assert not dynet_baseline.ok(failed) and dynet_baseline.lines(failed) == ["dynet: FAILED: BATCHMAKER_DYNET_PYTHON=x failed"]


def test_trees_go_to_dynet_children_first_with_the_left_child_first(tree_model):
    model, _ = tree_model
    tree = DATASETS["sst"]()[0]
    rows = dynet_baseline.tree_rows(model, tree)
    parsed = model.parse(tree)
    assert len(rows) == len(parsed.tokens) and rows[-1][0] == parsed.tokens[parsed.root]
    for k, (token, left, right) in enumerate(rows):
        assert (left, right) == (-1, -1) if token >= 0 else (0 <= min(left, right) and left != right and max(left, right) < k)


@pytest.mark.skipif(not DYNET, reason=f"DyNet not installed ({dynet_baseline.PYTHON_ENV} not set)")
def test_dynet_computes_the_same_trees(tree_model):
    model, state = tree_model
    result = dynet_baseline.offline(DYNET, model, state, DATASETS["sst"]()[: dynet_baseline.BATCH + 6])
    assert result["verify"]["ok"] and result["verify"]["checked"] == dynet_baseline.BATCH
    assert result["trees"] == dynet_baseline.BATCH + 6 and result["trees_per_s"] > 0
