"""The treelstm preset's `dynet` section: the same TreeLSTM in DyNet 2.1.2, offline, as a baseline.

DyNet is an optional dependency kept out of the project's environment: `BATCHMAKER_DYNET_PYTHON`
names a Python that can `import dynet` (docs/benchmarks/log.md says how to build one). That interpreter runs
bench/dynet_treelstm.py on the preset's weights and SST trees (agenda-based autobatching, one thread)
in each of `VARIANTS` (a gate layout and a number of trees a graph) and reports each one's trees/s;
every variant's roots are checked against our reference, and DyNet is quoted at its fastest, its
setup recorded beside its number (the others stay in the section's `runs`).
In the same run, the cellular server is driven by a closed loop, and our sustained (from the
preset's sweep) and closed-loop throughput are divided by DyNet's. Without the variable the
section says it was skipped; a variable naming an interpreter that cannot run DyNet is an error.
(This module is not named `dynet`: the script runs with bench/ first on its path, where such a
name would shadow the package.)
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.generator import closed_loop, request_frames
from batchmaker.bench.presets import Preset
from batchmaker.bench.results import threads
from batchmaker.bench.run import ROOT, serve_options, write_config
from batchmaker.bench.sweep import ServedPolicy
from batchmaker.bench.verify import compare_replies, verify
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model
from batchmaker.common.models.base import Model

PYTHON_ENV = "BATCHMAKER_DYNET_PYTHON"
SCRIPT = ROOT / "bench" / "dynet_treelstm.py"
# Gate layouts (a parameter a gate, or one for all of a node's gates) by trees a graph. Which is fastest depends
# on the machine and DyNet's build, so every pair runs and DyNet is quoted at the fastest.
VARIANTS = tuple((gates, batch) for gates in ("split", "fused") for batch in (32, 64, 128, 256))
CHECKED = 64  # trees whose roots are checked: of each variant's first graph, and of the served closed loop
WINDOW = 256  # trees the closed loop keeps outstanding: four full batches
QUICK_TREES = 640
TIMEOUT_S = 1800


class DyNetError(RuntimeError):
    """The DyNet interpreter named by PYTHON_ENV could not run the baseline."""


def interpreter() -> str | None:
    return os.environ.get(PYTHON_ENV) or None


def tree_rows(model: Model, inputs: dict[str, Any]) -> list[list[int]]:
    """One tree as bench/dynet_treelstm.py reads it: [token, left, right] rows, children first, root last."""
    tree = model.parse(inputs)
    order = list(tree.order)
    position = {node: k for k, node in enumerate(order)}
    rows = []
    for node in order:
        kids = [position[child] for child in tree.children[node]] or [-1, -1]
        rows.append([int(tree.tokens[node]), *kids])
    return rows


def offline(
    python: str,
    model: Model,
    state: dict,
    trees: list[dict[str, Any]],
    variants: tuple[tuple[str, int], ...] = VARIANTS,
    processes: int = 1,
) -> dict[str, Any]:
    """DyNet's trees/s on `trees` in each of `variants` (gates, trees a graph), each one's first roots checked
    against the reference: every run under `runs`, the fastest's gates, batch and trees/s at the top, and
    `verify` over every run's roots. With several `processes` (one thread each, as many as the server compared
    has workers), each runs an equal share of the trees at the same time and a run's trees/s is their sum."""
    with tempfile.TemporaryDirectory(prefix="batchmaker-dynet-") as tmp:
        weights = Path(tmp) / "weights.npz"
        np.savez(weights, **{key: value.numpy() for key, value in state.items()})
        asked = [{"gates": gates, "batch": batch} for gates, batch in variants]
        rows = [tree_rows(model, tree) for tree in trees]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        shares = [rows[len(rows) * k // processes : len(rows) * (k + 1) // processes] for k in range(processes)]
        running = []
        for k, share in enumerate(shares):
            spec, out = Path(tmp) / f"trees{k}.json", Path(tmp) / f"out{k}.json"
            spec.write_text(json.dumps({"variants": asked, "check": CHECKED if k == 0 else 0, "trees": share}))
            try:
                command = [python, str(SCRIPT), str(weights), str(spec), str(out)]
                running.append((out, subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)))
            except OSError as exc:
                raise DyNetError(f"{PYTHON_ENV}={python} cannot be run: {exc}") from None
        results = []
        for out, process in running:
            try:
                _, stderr = process.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                raise DyNetError(f"the DyNet TreeLSTM took over {TIMEOUT_S} s") from None
            if process.returncode != 0:
                last = (stderr.strip().splitlines() or ["no output"])[-1]
                raise DyNetError(f"{PYTHON_ENV}={python} failed to run the DyNet TreeLSTM: {last}")
            results.append(json.loads(out.read_text()))
    result = results[0]
    for other in results[1:]:
        result["trees"] += other["trees"]
        for run, share in zip(result["runs"], other["runs"]):
            run["trees_per_s"] += share["trees_per_s"]
            run["seconds"] = max(run["seconds"], share["seconds"])
    expected = [model.reference(state, tree) for tree in trees[:CHECKED]]
    for run in result["runs"]:
        roots = run.pop("roots")
        run["verify"] = compare_replies(expected[: len(roots)], [{"h": np.array(h, dtype=np.float32)} for h in roots])
    fastest = max(result["runs"], key=lambda run: run["trees_per_s"])
    checks = {f"{run['gates']} gates, batch {run['batch']}": run["verify"] for run in result["runs"]}
    verify_all = {
        "checked": sum(check["checked"] for check in checks.values()),
        "max_abs_error": max(check["max_abs_error"] for check in checks.values()),
        "wrong": [f"{variant}: {wrong}" for variant, check in checks.items() for wrong in check["wrong"]],
        "ok": all(check["ok"] for check in checks.values()),
    }
    best = {key: fastest[key] for key in ("gates", "batch", "seconds", "trees_per_s")}
    return {
        "dynet": result["dynet"], "trees": result["trees"], "processes": processes, **best, "verify": verify_all,
        "runs": result["runs"],
    }  # fmt: skip


def section(
    preset: Preset, summary: dict[str, Any], quick: bool, running_batch: str | None = None, workers: int = 1
) -> dict[str, Any]:
    """The `dynet` section of a tree preset's result: DyNet offline (in as many processes as the server has
    `workers`), our closed loop, and the ratios."""
    python = interpreter()
    if python is None:
        return {"skipped": f"DyNet not found (set {PYTHON_ENV} to a Python with dynet 2.1.2)"}
    trees = DATASETS[preset.dataset]()
    trees = trees[:QUICK_TREES] if quick else trees
    with tempfile.TemporaryDirectory(prefix="batchmaker-dynet-") as tmp:
        config_path = write_config(preset.model_toml, Path(tmp))
        config = load_config(config_path)
        model = build_model(config.models[preset.model])
        state = model.load_weights()
        dynet = offline(python, model, state, trees, processes=workers)
        options = serve_options("cellular", running_batch, workers)
        with ServedPolicy(config_path, config.server.address, "cellular", preset.model, *options) as served:
            frames = request_frames(preset.model, trees)
            closed_loop(served.address, frames[:WINDOW], WINDOW)  # warm up
            run = closed_loop(served.address, frames, WINDOW)
            check = verify(served.address, model, state, trees[:CHECKED])
    answered = sum(1 for reply in run.replies if reply and reply["ok"])
    closed = answered / float(np.nanmax(run.received))
    sustained = summary["cellular"]["sustained_throughput"]
    return {
        "dynet": dynet,
        "closed_loop": {
            "window": WINDOW,
            "trees": len(trees),
            "answered": answered,
            "trees_per_s": closed,
            "verify": check,
        },
        "sustained_trees_per_s": sustained,
        "sustained_over_dynet": sustained / dynet["trees_per_s"],
        "closed_loop_over_dynet": closed / dynet["trees_per_s"],
    }


def ok(result: dict[str, Any]) -> bool:
    """False when the section failed: DyNet named but not runnable, or answers that differ from the reference."""
    if "skipped" in result or not result:
        return True
    return "error" not in result and result["dynet"]["verify"]["ok"] and result["closed_loop"]["verify"]["ok"]


def lines(result: dict[str, Any]) -> list[str]:
    """The section for the printed report."""
    if "skipped" in result:
        return [f"dynet: skipped: {result['skipped']}"]
    if "error" in result:
        return [f"dynet: FAILED: {result['error']}"]
    dynet, closed = result["dynet"], result["closed_loop"]
    runs = [
        f"dynet {dynet['dynet']} offline, {run['gates']} gates, {run['batch']} trees a graph: "
        f"{run['trees_per_s']:,.0f} trees/s"
        for run in dynet["runs"]
    ]
    offline_line = (
        f"dynet {dynet['dynet']} offline at its fastest ({dynet['gates']} gates, {dynet['batch']} trees a graph, "
        f"agenda autobatching, {threads(dynet.get('processes', 1))}): {dynet['trees_per_s']:,.0f} trees/s on "
        f"{dynet['trees']} trees; roots "
        f"{dynet['verify']['checked']} checked over every run, max abs error {dynet['verify']['max_abs_error']:.1e}"
    )
    ratio_line = (
        f"cellular closed loop ({closed['window']} outstanding): {closed['trees_per_s']:,.0f} trees/s = "
        f"{result['closed_loop_over_dynet']:.2f}x DyNet; sustained (p90 <= 100 ms) "
        f"{result['sustained_trees_per_s']:,.0f} trees/s = {result['sustained_over_dynet']:.2f}x DyNet"
    )
    return [*runs, offline_line, ratio_line]
