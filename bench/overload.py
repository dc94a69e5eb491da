"""`./scripts/bench overload`: the default server offered up to ten times what it can serve.

Serves configs/default.toml as it is (an LSTM of hidden size 256 with an 8192-word vocabulary,
batches up to 64, one CPU worker where there is no GPU, refusing requests whose expected wait
exceeds `max_queue_delay_ms` = 250) on WMT sentence lengths, and:

1. measures its capacity: the requests it answers per second while a closed loop keeps
   CAPACITY_WINDOW requests in flight (four full batches, so the worker always has full tasks to
   run), on a server of the same config with refusal by expected wait turned off, so that what is
   measured is what the server does, not what its estimate of it lets in;
2. offers FACTORS times that rate as open-loop Poisson arrivals (bench/generator.py), each factor on
   a freshly started server of the config as it is, whose capacity is not yet measured when the
   load begins; then measures the capacity again, on the first server, which has been idle
   meanwhile: capacities further apart than DRIFT say the machine's other load changed;
3. reports per factor the latency of accepted requests from when they were due (overall, and of those
   due in the first second, when the server is still cold), the share refused,
   the goodput (accepted requests answered per second) over the capacity and the requests lost
   (sent and never answered), against the goals below, with the CPU time each process used; and
   checks a sample of answers on each server against the reference model afterwards.

`--running-batch worker` and `--workers N` serve the same config with its workers deciding their own steps and N
CPU workers (`batchmaker serve --running-batch`, `--workers`), the capacity measured on that server too.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.generator import Replies, closed_loop, open_loop, poisson_schedule, request_frames
from batchmaker.bench.progress import Progress
from batchmaker.bench.report import finite, fraction, target, target_lines
from batchmaker.bench.run import ROOT, git, machine, serve_options, steps_decided_by
from batchmaker.bench.sweep import ServedPolicy, kernel_busy
from batchmaker.bench.verify import verify
from batchmaker.clients.loadgen import percentiles
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model, init_missing_weights
from batchmaker.common.protocol import OVERLOADED
from batchmaker.manager.commands.launcher import free_port_on

DEFAULT_CONFIG = ROOT / "configs" / "default.toml"
MODEL = "lstm"
DATASET = "wmt"
FACTORS = (1.2, 3.0, 10.0)
CAPACITY_WINDOW = 256  # requests kept in flight while measuring capacity: four batches of 64
P99_GOAL_MS = 500.0  # accepted requests' p99 latency
GOODPUT_GOAL = 0.9  # accepted requests answered per second, over the capacity
CHECKED = 12  # answers compared with the reference on each server
DRIFT = 0.15  # capacities measured before and after the loads further apart than this are flagged
UNANSWERED = "LOST"  # the outcome of a request never answered


@dataclass(frozen=True)
class Length:
    capacity_requests: int  # requests sent by the closed loop that measures capacity
    seconds: float  # of open-loop load per factor


FULL = Length(capacity_requests=20000, seconds=30.0)
QUICK = Length(capacity_requests=2000, seconds=3.0)


def _serve(config: Path, policy: str, options: tuple[str, ...]) -> ServedPolicy:
    address = f"tcp://127.0.0.1:{free_port_on('127.0.0.1')}"
    return ServedPolicy(config, address, policy, MODEL, "--address", address, *options)


def capacity_config(directory: Path) -> Path:
    """configs/default.toml with refusal by expected wait turned off, written to `directory` (its
    weights path made absolute); checked to differ from the original in that alone."""
    text = DEFAULT_CONFIG.read_text()
    text, found = re.subn(r"(?m)^max_queue_delay_ms\s*=.*$", "max_queue_delay_ms = 0", text)
    if not found:
        text = text.replace("[server]\n", "[server]\nmax_queue_delay_ms = 0\n", 1)
    text = re.sub(
        r'(?m)^weights\s*=\s*"([^"]+)"', lambda m: f'weights = "{(DEFAULT_CONFIG.parent / m.group(1)).resolve()}"', text
    )
    path = directory / "capacity.toml"
    path.write_text(text)
    original, copy = load_config(DEFAULT_CONFIG), load_config(path)
    expected = dataclasses.replace(original.server, max_queue_delay_ms=0)
    if (copy.server, copy.scheduler, copy.models) != (expected, original.scheduler, original.models):
        raise SystemExit(
            f"{DEFAULT_CONFIG} could not be copied with max_queue_delay_ms = 0: the copy differs otherwise"
        )
    return path


def percentiles_ms(values: np.ndarray) -> dict[str, float]:
    return {**percentiles(values), "max": float(np.max(values)) if len(values) else math.nan}


def measure_capacity(served: ServedPolicy, inputs: list[dict[str, Any]], count: int) -> dict[str, Any]:
    """Requests and cells answered per second with CAPACITY_WINDOW requests always in flight, the CPU
    its processes used, and the server's own estimate of its capacity (cells per second) at the end."""
    frames = request_frames(MODEL, [inputs[i % len(inputs)] for i in range(count)])
    closed_loop(served.address, frames[: 2 * CAPACITY_WINDOW], CAPACITY_WINDOW)  # warm-up: plans of common lengths
    before, cpu_before = served.stats(), served.cpu_seconds()
    run = closed_loop(served.address, frames, CAPACITY_WINDOW)
    cpu_after, after = served.cpu_seconds(), served.stats()
    seconds = float(np.nanmax(run.received))
    ok = sum(1 for reply in run.replies if reply is not None and reply["ok"])
    cells = after["nodes"] - before["nodes"]
    steps = after["steps"] - before["steps"]  # a multi-step task runs several batches
    return {
        "window": CAPACITY_WINDOW,
        "requests": count,
        "failed": count - ok,  # none should: nothing is refused for the expected wait here
        "seconds": seconds,
        "requests_per_s": ok / seconds,
        "cells_per_s": cells / seconds,
        "mean_batch_size": cells / steps if steps else 0.0,
        "estimated_cells_per_s": after["admission"]["cells_per_s"],
        "warm_up_cells_per_s": after["admission"].get("warm_up_cells_per_s"),
        "cpu_s_per_s": {role: (cpu_after[role] - cpu_before[role]) / seconds for role in cpu_before},
        "cpu_us_per_request": {role: (cpu_after[role] - cpu_before[role]) * 1e6 / count for role in cpu_before},
        "kernel_busy": kernel_busy(before, after, seconds),
    }


def outcomes(run: Replies) -> np.ndarray:
    """Per request: "ok", the error code of its reply, or UNANSWERED."""
    return np.array(
        [UNANSWERED if reply is None else "ok" if reply["ok"] else reply["error"]["code"] for reply in run.replies]
    )


def offer(
    served: ServedPolicy, inputs: list[dict[str, Any]], rate: float, seconds: float, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at `rate` for `seconds` on `served`; what became of every request, the CPU its processes
    used (a second, and a request sent, refusals included) and how busy the workers' kernels were."""
    before = served.stats()
    cpu_before = served.cpu_seconds()
    load_before = os.getloadavg()[0]
    rng = np.random.default_rng(seed)
    due = poisson_schedule(rate, seconds, rng)
    order = rng.permutation(len(inputs))
    frames = request_frames(MODEL, [inputs[order[i % len(order)]] for i in range(len(due))])
    run = open_loop(served.address, frames, due)
    cpu_after = served.cpu_seconds()
    served.wait_idle()
    stats = served.stats()
    outcome = outcomes(run)
    ok = outcome == "ok"
    refused = outcome == OVERLOADED
    lost = outcome == UNANSWERED
    server_us = np.array([reply["timing"]["total_us"] if reply is not None and reply["ok"] else np.nan
                          for reply in run.replies])
    refusal = next((reply["error"]["message"] for reply in run.replies
                    if reply is not None and not reply["ok"] and reply["error"]["code"] == OVERLOADED), None)
    span = max(seconds, float(np.nanmax(run.received, initial=0.0)))
    last_answer = float(np.nanmax(run.received[ok], initial=0.0))
    goodput = ok.sum() / last_answer if last_answer else 0.0
    used = {role: cpu_after[role] - cpu_before[role] for role in cpu_before}
    cpu = {role: seconds / span for role, seconds in used.items()}
    cpu["generator"] = run.cpu_seconds / span
    return {
        "offered_rps": rate,
        "seconds": seconds,
        "sent": len(outcome),
        "accepted": int(ok.sum()),
        "refused": int(refused.sum()),
        "other_errors": dict(collections.Counter(str(code) for code in outcome[~ok & ~refused & ~lost])),
        "lost": int(lost.sum()),
        "duplicate_replies": run.duplicates,
        "refused_share": float(refused.mean()),
        "goodput_rps": goodput,
        "latency_ms": percentiles_ms((run.received - due)[ok] * 1e3),
        "first_second_latency_ms": percentiles_ms((run.received - due)[ok & (due < 1.0)] * 1e3),
        "server_ms": percentiles_ms(server_us[ok] / 1e3),
        "refusal_ms": percentiles_ms((run.received - run.sent)[refused] * 1e3),
        "generator_behind_ms": percentiles_ms((run.sent - due) * 1e3),
        "cpu_s_per_s": cpu,
        "cpu_us_per_request": {role: seconds * 1e6 / len(outcome) for role, seconds in used.items()},
        "kernel_busy": kernel_busy(before, stats, span),
        "load_average": [load_before, os.getloadavg()[0]],
        "refusal_message": refusal,
        "admission": stats["admission"],
        "mean_batch_size": stats["mean_batch_size"],
    }


def run(quick: bool, progress: Progress, running_batch: str | None = None, workers: int = 1) -> dict[str, Any]:
    """Capacity, then every factor on a fresh server; the result as written to overload.json. `running_batch`:
    who decides each step (None: the config's); `workers`: CPU workers."""
    length = QUICK if quick else FULL
    started = time.time()
    config = load_config(DEFAULT_CONFIG)
    init_missing_weights(config)
    model = build_model(config.models[MODEL])
    state = model.load_weights()
    inputs = DATASETS[DATASET]()
    policy = config.scheduler.policy
    options = serve_options(policy, running_batch, workers)
    progress.note("overload: measuring capacity")
    with (
        tempfile.TemporaryDirectory(prefix="batchmaker-overload-") as tmp,
        _serve(capacity_config(Path(tmp)), policy, options) as baseline,
    ):
        capacity = measure_capacity(baseline, inputs, length.capacity_requests)
        progress.advance()
        factors = []
        for seed, factor in enumerate(FACTORS):
            rate = factor * capacity["requests_per_s"]
            progress.note(f"overload: {factor:g}x capacity, {rate:.0f} req/s for {length.seconds:g} s")
            with _serve(DEFAULT_CONFIG, policy, options) as served:
                measured = offer(served, inputs, rate, length.seconds, seed)
                measured["verify"] = verify(served.address, model, state, inputs[:CHECKED])
            measured["factor"] = factor
            measured["goodput_over_capacity"] = measured["goodput_rps"] / capacity["requests_per_s"]
            factors.append(measured)
            progress.advance()
        capacity_after = measure_capacity(baseline, inputs, length.capacity_requests)
    result = {
        "preset": "overload",
        "description": "the default server offered 1.2x, 3x and 10x its capacity (WMT lengths)",
        "quick": quick,
        "commit": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "config": str(DEFAULT_CONFIG.relative_to(ROOT)),
        "max_queue_delay_ms": config.server.max_queue_delay_ms,
        "running_batch": steps_decided_by(config, running_batch, workers),
        "cpu_workers": workers,
        "dataset": {"name": DATASET, "requests": len(inputs)},
        "capacity": capacity,
        "capacity_after": capacity_after,
        "factors": factors,
        "seconds": time.time() - started,
    }
    result["targets"] = goals(result)
    return result


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for measured in result["factors"]:
        name = f"{measured['factor']:g}x capacity"
        found.append(target(f"{name}: accepted p99 ms", measured["latency_ms"]["p99"], P99_GOAL_MS, at_most=True))
        first = measured["first_second_latency_ms"]["p99"]
        found.append(
            target(f"{name}: accepted p99 ms in the cold server's first second", first, P99_GOAL_MS, at_most=True)
        )
        found.append(target(f"{name}: goodput / capacity", measured["goodput_over_capacity"], GOODPUT_GOAL))
        found.append(target(f"{name}: lost requests", measured["lost"], 0, at_most=True))
    return found


def table(result: dict[str, Any]) -> str:
    capacity, after = result["capacity"], result["capacity_after"]
    estimate = capacity["estimated_cells_per_s"]
    drift = after["requests_per_s"] / capacity["requests_per_s"]
    lines = [
        f"capacity {capacity['requests_per_s']:.0f} req/s, {capacity['cells_per_s']:,.0f} cells/s "
        f"(mean batch {capacity['mean_batch_size']:.1f}, {capacity['window']} requests in flight, "
        f"CPU s/s manager {capacity['cpu_s_per_s'].get('manager', math.nan):.2f}, "
        f"worker {capacity['cpu_s_per_s'].get('worker', math.nan):.2f}); the server's estimate: "
        + (f"{estimate:,.0f} cells/s" if estimate else "none")
        + f", timed at warm-up: {_cells(capacity.get('warm_up_cells_per_s'))}",
        f"capacity measured again after the loads: {after['requests_per_s']:.0f} req/s ({drift:.2f}x)"
        + ("; the machine's other load changed during the run, compare with care" if abs(drift - 1) > DRIFT else ""),
        (
            "| offered | req/s | accepted p50 ms | accepted p99 ms | p99 ms, first second | server p99 ms | refused "
            "| goodput / capacity "
            "| lost | generator late p99 ms | CPU s/s manager, worker, generator | manager CPU µs a request "
            "| kernels busy |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for m in result["factors"]:
        cpu = m["cpu_s_per_s"]
        lines.append(
            f"| {m['factor']:g}x | {m['offered_rps']:.0f} | {m['latency_ms']['p50']:.0f} "
            f"| {m['latency_ms']['p99']:.0f} "
            f"| {m['first_second_latency_ms']['p99']:.0f} | {m['server_ms']['p99']:.0f} | {m['refused_share']:.0%} "
            f"| {m['goodput_over_capacity']:.2f} | {m['lost']} "
            f"| {m['generator_behind_ms']['p99']:.1f} "
            f"| {cpu.get('manager', math.nan):.2f}, {cpu.get('worker', math.nan):.2f}, {cpu['generator']:.2f} "
            f"| {m.get('cpu_us_per_request', {}).get('manager', math.nan):.1f} | {fraction(m.get('kernel_busy'))} |"
        )
    return "\n".join(lines)


def _cells(rate: float | None) -> str:
    return f"{rate:,.0f} cells/s" if rate else "none"


def problems(result: dict[str, Any]) -> list[str]:
    """What makes the run a failure rather than a measurement: errors while measuring capacity, lost or
    doubled replies, wrong answers."""
    found = [
        f"the capacity run got {run['failed']} error replies"
        for run in (result["capacity"], result["capacity_after"])
        if run["failed"]
    ]
    for m in result["factors"]:
        name = f"{m['factor']:g}x"
        if m["lost"] or m["duplicate_replies"]:
            found.append(f"{name}: {m['lost']} requests never answered, {m['duplicate_replies']} answered twice")
        if not m["verify"]["ok"]:
            found.append(f"{name}: answers differ from the reference: {'; '.join(m['verify']['wrong'])}")
    return found


def main(quick: bool, out: Path, running_batch: str | None = None, workers: int = 1) -> bool:
    """Run, write out/overload.json, print the table and the goals; False if a request was lost or wrong."""
    progress = Progress(1 + len(FACTORS))
    result = run(quick, progress, running_batch, workers)
    progress.close()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "overload.json"
    path.write_text(json.dumps(finite(result), indent=1))
    print(f"\n## overload: {result['description']}  ({result['seconds']:.0f} s)\n")
    print(f"steps decided by the {result['running_batch']}, {result['cpu_workers']} CPU worker(s)\n")
    print(table(result))
    for line in target_lines(result):
        print(line)
    print(f"wrote {path}")
    found = problems(result)
    for problem in found:
        print(f"overload: {problem}", file=sys.stderr)
    return not found

