"""The treelstm preset's DyNet baseline: skipped cleanly without DyNet, a clear error when the named
interpreter cannot run it, quoted at its fastest variant with that setup beside its number, and (where DyNet is
installed) the same model's answers in every gate variant and graph size, at DyNet's speed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import SST_TREELSTM, write_config

from batchmaker.bench import dynet_baseline, results
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
    assert not dynet_baseline.ok(failed) and dynet_baseline.lines(failed) == [
        "dynet: FAILED: BATCHMAKER_DYNET_PYTHON=x failed"
    ]


def test_trees_go_to_dynet_children_first_with_the_left_child_first(tree_model):
    model, _ = tree_model
    tree = DATASETS["sst"]()[0]
    rows = dynet_baseline.tree_rows(model, tree)
    parsed = model.parse(tree)
    assert len(rows) == len(parsed.tokens) and rows[-1][0] == parsed.tokens[parsed.root]
    for k, (token, left, right) in enumerate(rows):
        assert (
            (left, right) == (-1, -1)
            if token >= 0
            else (0 <= min(left, right) and left != right and max(left, right) < k)
        )


def test_dynet_is_quoted_at_its_fastest_variant_with_its_setup_and_every_run_listed():
    run = {"seconds": 1.0, "verify": {"checked": 64, "max_abs_error": 1e-7, "wrong": [], "ok": True}}
    measured = (("split", 64, 900.0), ("fused", 128, 2900.0))
    runs = [run | {"gates": gates, "batch": batch, "trees_per_s": rate} for gates, batch, rate in measured]
    offline = {"dynet": "2.1.2", "trees": 640, "gates": "fused", "batch": 128, "seconds": 0.2, "trees_per_s": 2900.0,
               "verify": {"checked": 128, "max_abs_error": 1e-7, "wrong": [], "ok": True}, "runs": runs}  # fmt: skip
    closed = {"window": 256, "trees": 640, "answered": 640, "trees_per_s": 1450.0, "verify": {"ok": True}}
    section = {"dynet": offline, "closed_loop": closed, "sustained_trees_per_s": 290.0, "sustained_over_dynet": 0.1,
               "closed_loop_over_dynet": 0.5}  # fmt: skip
    (row,) = results.peers({"dynet": section})
    assert (row.system, row.setup, row.throughput) == ("DyNet 2.1.2", "fused gates, 128 trees a graph", 2900.0)
    assert row.described == "DyNet 2.1.2 (fused gates, 128 trees a graph)" and row.cellular_throughput == 1450.0
    printed = dynet_baseline.lines(section)
    assert printed[:2] == [
        "dynet 2.1.2 offline, split gates, 64 trees a graph: 900 trees/s",
        "dynet 2.1.2 offline, fused gates, 128 trees a graph: 2,900 trees/s",
    ]
    assert printed[2].startswith("dynet 2.1.2 offline at its fastest (fused gates, 128 trees a graph, agenda ")
    assert dynet_baseline.ok(section)
    wrong = section | {"dynet": offline | {"verify": offline["verify"] | {"ok": False}}}
    assert not dynet_baseline.ok(wrong)


@pytest.mark.skipif(not DYNET, reason=f"DyNet not installed ({dynet_baseline.PYTHON_ENV} not set)")
def test_dynet_computes_the_same_trees_in_every_variant_and_reports_the_fastest(tree_model):
    model, state = tree_model
    variants = (("split", 16), ("fused", 16), ("fused", 32))
    result = dynet_baseline.offline(DYNET, model, state, DATASETS["sst"]()[:40], variants)
    assert [(run["gates"], run["batch"]) for run in result["runs"]] == list(variants)
    for run in result["runs"]:  # each variant's first graph's roots are the reference's
        assert run["verify"]["ok"] and run["verify"]["checked"] == run["batch"] and run["trees_per_s"] > 0
    fastest = max(result["runs"], key=lambda run: run["trees_per_s"])
    assert (result["gates"], result["batch"], result["trees_per_s"]) == (
        fastest["gates"], fastest["batch"], fastest["trees_per_s"]
    )
    assert result["verify"]["ok"] and result["verify"]["checked"] == 16 + 16 + 32 and result["trees"] == 40


@pytest.mark.skipif(not DYNET, reason=f"DyNet not installed ({dynet_baseline.PYTHON_ENV} not set)")
def test_dynet_in_two_processes_shares_the_trees_and_sums_their_rates(tree_model):
    model, state = tree_model
    alone = dynet_baseline.offline(DYNET, model, state, DATASETS["sst"]()[:41], (("fused", 16),))
    shared = dynet_baseline.offline(DYNET, model, state, DATASETS["sst"]()[:41], (("fused", 16),), processes=2)
    assert (alone["processes"], shared["processes"], shared["trees"]) == (1, 2, 41)
    assert shared["verify"]["ok"] and shared["verify"]["checked"] == 16  # the first share's roots
    assert "2 processes of one thread" in dynet_baseline.lines(
        {"dynet": shared, "closed_loop": {"window": 1, "trees_per_s": 1.0}, "closed_loop_over_dynet": 1.0,
         "sustained_trees_per_s": 1.0, "sustained_over_dynet": 1.0}
    )[-2]  # fmt: skip


@pytest.mark.skipif(not DYNET, reason=f"DyNet not installed ({dynet_baseline.PYTHON_ENV} not set)")
def test_an_unknown_gate_variant_is_a_clear_error(tree_model):
    model, state = tree_model
    with pytest.raises(dynet_baseline.DyNetError, match="no gate variant 'packed' \\(only split, fused\\)"):
        dynet_baseline.offline(DYNET, model, state, DATASETS["sst"]()[:4], (("packed", 4),))
