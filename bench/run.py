"""Run one preset: the raw kernel, then every policy swept from light load to beyond saturation,
the moderate loads (25% and 50% of the reference policy's peak), and a check of the answers."""

from __future__ import annotations

import collections
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from batchmaker.bench import kernel
from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.presets import Preset, Sweep
from batchmaker.bench.progress import Progress
from batchmaker.bench.sweep import ServedPolicy, saturated
from batchmaker.bench.verify import verify
from batchmaker.common.config import Config, load_config, resolve_running_batch, with_running_batch
from batchmaker.common.models import build_model, init_missing_weights
from batchmaker.common.models.base import Model
from batchmaker.manager.commands.launcher import free_port_on

ROOT = Path(__file__).resolve().parents[1]
MODERATE = (0.25, 0.5)  # fractions of the reference policy's peak
COUNTED_REQUESTS = 500  # requests unfolded to count cells per request
DECODED_REQUESTS = 60  # requests decoded by the reference to count the steps of models that observe outputs


def write_config(models_toml: str, directory: Path) -> Path:
    """A one-worker CPU config serving the given [models.NAME] tables, with weights made once in weights/."""
    path = directory / "bench.toml"
    path.write_text(
        f"""
[server]
address = "tcp://127.0.0.1:{free_port_on("127.0.0.1")}"
cpu_workers = 1
threads_per_worker = 1
max_queued_requests = 4000
max_queue_delay_ms = 0

[scheduler]
max_tasks_to_submit = 5
"""
        + models_toml.replace("{weights}", str(ROOT / "weights"))
    )
    init_missing_weights(load_config(path))
    return path


def cells_per_request(model: Model, state: dict, inputs: list[dict[str, Any]]) -> dict[str, float]:
    """Mean cells of each type one request needs (no padding, no speculative steps). For a model that
    observes outputs (a decoder stopping at EOS), its watched steps are counted by running the reference."""
    counts: collections.Counter[str] = collections.Counter()
    sample = inputs[:COUNTED_REQUESTS]
    for request in sample:
        graph = model.unfold(request)
        watched = {ref.node for ref in graph.watch}
        counts.update(node.cell_type for i, node in enumerate(graph.nodes) if i not in watched)
    mean = {key: n / len(sample) for key, n in counts.items()}
    first = model.unfold(sample[0])
    if first.watch:
        steps = 0
        for request in sample[:DECODED_REQUESTS]:
            graph = model.unfold(request)
            decoded = len(model.reference(state, request)["tokens"])
            steps += min(decoded + 1, len(graph.watch))  # the step that emitted EOS ran too
        mean[first.nodes[first.watch[0].node].cell_type] = steps / min(len(sample), DECODED_REQUESTS)
    return mean


def git(*args: str) -> str:
    """What git says of the checkout measured (the commit a result belongs to)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def moderate_loads(
    served: ServedPolicy,
    preset: Preset,
    inputs: list[dict[str, Any]],
    rates: list[float],
    seconds: float,
    progress: Progress,
) -> dict[str, Any]:
    """The moderate loads (fractions of the reference policy's peak) on a served policy, with their CDFs."""
    moderate = {}
    for fraction, rate in zip(MODERATE, rates):
        progress.note(f"{preset.name}: {served.policy} at {rate:.0f} req/s ({fraction:.0%} of {preset.reference})")
        moderate[str(fraction)] = served.measure(inputs, rate, seconds, seed=100, keep_cdf=True)
        progress.advance()
    return moderate


def serve_options(policy: str, running_batch: str | None, workers: int = 1) -> tuple[str, ...]:
    """`batchmaker serve` options of a policy's server: the cellular policy's with `running_batch` if given and
    `workers` CPU workers (the baselines keep one: a second only competes with their manager for the cores)."""
    if policy != "cellular":
        return ()
    return (*(("--running-batch", running_batch) if running_batch is not None else ()), "--workers", str(workers))


def steps_decided_by(config: Config, running_batch: str | None, workers: int) -> str:
    """Who decides the steps of the cellular policy's server (its JSON's `running_batch`): `running_batch` (None:
    the config's) as it resolves on the benchmarks' CPU workers."""
    chosen = config if running_batch is None else with_running_batch(config, running_batch)
    return resolve_running_batch(chosen, ["cpu"] * workers).scheduler.running_batch


def run_preset(
    preset: Preset, sweep: Sweep, progress: Progress, running_batch: str | None = None, workers: int = 1
) -> dict[str, Any]:
    """`running_batch`: who decides the cellular policy's steps (`[scheduler] running_batch`; None: the default);
    `workers`: the cellular policy's CPU workers."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="batchmaker-bench-") as tmp:
        config_path = write_config(preset.model_toml, Path(tmp))
        config = load_config(config_path)
        model = build_model(config.models[preset.model])
        state = model.load_weights()
        inputs = DATASETS[preset.dataset]()
        progress.note(f"{preset.name}: raw kernel")
        per_request = cells_per_request(model, state, inputs)
        kernel_seconds = 0.3 if sweep.seconds < 5 else 1.0
        measured = kernel.measure(model, config.server.threads_per_worker, kernel_seconds)
        ideal = kernel.ideal(measured["served"], per_request)
        rates = [fraction * ideal["requests_per_s"] for fraction in sweep.fractions]
        policies: dict[str, Any] = {}
        moderate_rates: list[float] = []
        for policy in preset.policies:  # the reference policy comes first: it sets the moderate loads
            options = serve_options(policy, running_batch, workers)
            with ServedPolicy(config_path, config.server.address, policy, preset.model, *options) as served:
                points = []
                beyond = 0
                for index, rate in enumerate(rates):
                    progress.note(f"{preset.name}: {policy} at {rate:.0f} req/s")
                    result = served.measure(inputs, rate, sweep.seconds, seed=index)
                    points.append(result)
                    progress.advance()
                    beyond += saturated(result)
                    if beyond >= sweep.saturated_points:
                        progress.advance(len(rates) - index - 1)
                        break
                if policy == preset.reference:
                    peak = max(p["achieved_rps"] for p in points)
                    moderate_rates = [fraction * peak for fraction in MODERATE]
                progress.note(f"{preset.name}: {policy}: checking answers")
                check = verify(served.address, model, state, inputs[: sweep.verify_requests])
                progress.advance()
                if not sweep.fresh_server_for_moderate:
                    moderate = moderate_loads(served, preset, inputs, moderate_rates, sweep.seconds, progress)
            if sweep.fresh_server_for_moderate:  # the sweep has just driven that server past saturation
                with ServedPolicy(config_path, config.server.address, policy, preset.model, *options) as served:
                    moderate = moderate_loads(served, preset, inputs, moderate_rates, sweep.seconds, progress)
            policies[policy] = {"points": points, "moderate": moderate, "verify": check}
        # Measured again after the sweeps, on a machine that has warmed up; the faster run is the ideal.
        again = measured
        if sweep.kernel_twice:
            progress.note(f"{preset.name}: raw kernel again")
            again = kernel.measure(model, config.server.threads_per_worker, kernel_seconds)
        kernels = {}
        for variant, cells in measured.items():
            fastest = {
                key: max(cell, again[variant][key], key=lambda c: c["cells_per_s"]) for key, cell in cells.items()
            }
            kernels[variant] = {"cells": fastest, "ideal": kernel.ideal(fastest, per_request)}
    return {
        "preset": preset.name,
        "description": preset.description,
        "quick": sweep.seconds < 5,
        "commit": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "model": {"name": preset.model, "toml": preset.model_toml.strip()},
        "dataset": {"name": preset.dataset, "requests": len(inputs), "cells_per_request": per_request},
        "sweep": {"fractions_of_ideal": list(sweep.fractions), "seconds_per_load": sweep.seconds},
        "reference_policy": preset.reference,
        "max_tasks_to_submit": config.scheduler.max_tasks_to_submit,
        "running_batch": steps_decided_by(config, running_batch, workers),
        "cpu_workers": workers,
        "kernel": kernels["served"],
        "torch_nn_kernel": kernels["torch_nn"],
        "policies": policies,
        "seconds": time.time() - started,
    }
