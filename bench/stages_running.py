"""`./scripts/bench stages`: a worker's part of each request routed whole to its running batch
(`[scheduler] running_batch = "worker"`), stage by stage, in process.

The requests' frames, as the manager sends them to a worker, are decoded, planned and joined to a running batch of
one CPU worker (a real `RunningBatch` on the model's served cells), `HELD` requests held at a time as under load,
a request joining as soon as one leaves; the batch runs step by step until every request has its answer, encoded
as the worker sends it. Every stage is timed on its own:

decode (the request's frame), plan (the model's plan), join (rows taken, the requests' nodes appended: those that
join between two steps together, as a worker joins the requests of a message or those a step made room for), cell
(the cells' forward calls), step beyond the cell (Algorithm 1's choice, the gathers and scatters, results read,
rows given back) and answer (the model's outputs and the answer's encoding). The kernels' busy fraction is the cells'
share of all of them: what the worker would reach with nothing else to do.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.stage_parts import ROWS, Stage, TimedCell, served_model, stage_timer
from batchmaker.common.models.base import Planner
from batchmaker.common.protocol import decode, encode
from batchmaker.worker.joining import Joining
from batchmaker.worker.running_batch import RunningBatch

STAGES = ("decode", "plan", "join", "cell", "step beyond the cell", "answer")
HELD = 128  # requests in the running batch at once: two full batches of nodes and more, as under load
WORKLOADS = {  # name: (model, hidden size, largest batch, dataset, requests)
    "LSTM H=256, WMT, running batch": ("lstm", 256, 64, "wmt", 512),
    "TreeLSTM H=256, SST, running batch": ("treelstm", 256, 64, "sst", 512),
}


def measure(name: str, model: str, hidden: int, batch: int, dataset: str, count: int) -> dict[str, Any]:
    """Stage seconds summed over `count` requests run through a running batch that holds `HELD` at a time."""
    clock: dict[str, float] = defaultdict(float)
    stage = stage_timer(clock)
    with served_model(model, hidden, batch) as (config, planners, specs, kinds, cells):
        planner = planners[model]
        running = RunningBatch(specs, [TimedCell(cell, clock) for cell in cells], kinds, ROWS)
        inputs = DATASETS[dataset]()
        frames = [encode([handle, model, inputs[handle % len(inputs)]]) for handle in range(count)]
        for frame in frames:  # a serving worker has the plans of common shapes cached: so here
            planner.plan(decode(frame, 1 << 24)[2])
        threads = torch.get_num_threads()
        torch.set_num_threads(config.server.threads_per_worker)  # as the worker runs its cells
        try:
            with torch.inference_mode():
                run_through(running, planner, frames[: 2 * HELD], stage, name)  # warm-up: the cells' first calls
                clock.clear()
                steps = run_through(running, planner, frames, stage, name)
        finally:
            torch.set_num_threads(threads)
    clock["step beyond the cell"] -= clock["cell"]
    total = sum(clock.values())
    return {
        "workload": name, "requests": count, "steps": steps, "seconds": dict(clock),
        "kernel_busy": clock["cell"] / total if total else None,
    }  # fmt: skip


def run_through(batch: RunningBatch, planner: Planner, frames: list[bytes], stage: Stage, name: str) -> int:
    """Every request of `frames` through `batch`, `HELD` at a time, to its answer; returns the steps run."""
    waiting, answered, steps = iter(frames), 0, 0
    while answered < len(frames):
        joining = []
        while batch.requests + len(joining) < HELD and (frame := next(waiting, None)) is not None:
            with stage("decode"):
                handle, _, request = decode(frame, 1 << 24)
            with stage("plan"):
                unfolded = planner.plan(request)
            joining.append(Joining(handle, unfolded, planner.observe if unfolded.plan.watched else None))
        with stage("join"):
            batch.admit_many(joining)
        with stage("step beyond the cell"):
            finished = batch.step()
        steps += 1
        for handle, unfolded, results, error in finished:
            if error is not None:
                raise RuntimeError(f"{name}: request {handle} failed: {error}")
            with stage("answer"):
                encode([handle, planner.outputs(unfolded, results), None])
        answered += len(finished)
    return steps


def run(quick: bool) -> list[dict[str, Any]]:
    scale = 4 if quick else 1
    return [measure(name, *spec[:4], spec[4] // scale) for name, spec in WORKLOADS.items()]


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows' tables: µs per request and per step, and the kernels' busy fraction."""
    lines = []
    for row in rows:
        requests, steps, seconds = row["requests"], row["steps"], row["seconds"]
        lines += [
            "",
            f"{row['workload']}: {requests} requests, {steps} steps, the kernels busy {row['kernel_busy']:.2f}",
            "| stage | µs per request | µs per step |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {what} | {seconds.get(what, 0.0) * 1e6 / requests:,.1f} | {seconds.get(what, 0.0) * 1e6 / steps:,.1f} |"
            for what in STAGES
        ]
    return lines
