"""`./scripts/bench stages`: one request's and one task's path through the server, stage by stage, in process.

The manager's batching core, a worker's task body and the messages between them run in one process
on one thread, with no sockets: requests are decoded from their frames, admitted, scheduled into tasks
for one CPU worker (a real arena in shared memory), each task is decoded, resolved and run as the CPU
backend runs it, its completion notice encoded and decoded, the core completes it, and each answer is
encoded as its reply frame. Every stage is timed on its own, so a budget per stage is visible and a
regression in one shows without a full server run:

decode (the request's frame), plan (the model's plan, within admission), admit (the rest of admission,
requests taken `BURST` at a time as the manager takes those waiting on its socket),
schedule (forming and dispatching tasks, within the core's schedule), encode (the task's message, timed by
encoding it again), worker decode, resolve, cell (the cells' forward calls), run beyond the cell (the
task body around them: gathers, carries, scatters, downloads), notice (encoded and decoded), complete
(the core's completion: host copies, answers) and reply (each answer's frame).

The process collects garbage as the manager does (rarely, start-up state frozen). Workloads: an LSTM on the bundled WMT
sentences at hidden 256 and at hidden 8 (where the cells cost
almost nothing and the control plane is all that is left), a TreeLSTM on SST trees at hidden 256, and
the 22-token sentence of `bench idle` at hidden 256, one request at a time (each admitted once the one
before has its answer): a lone request's path on an idle server, without the sockets.
"""

from __future__ import annotations

import gc
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchmaker.bench import stages_running
from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.idle import lone_sentence
from batchmaker.bench.run import git, machine
from batchmaker.bench.stage_parts import ROWS, TimedCell, served_model, stage_timer
from batchmaker.common.notice import CompletionNotice, decode_notice, encode_notice
from batchmaker.common.protocol import RequestError, decode, encode
from batchmaker.common.shm import SharedArray
from batchmaker.common.task import LaneTaskMessage, decode_task, encode_task
from batchmaker.manager.batching.core import BatchingCore
from batchmaker.manager.batching.outcomes import Answered
from batchmaker.manager.batching.worker_handle import WorkerHandle
from batchmaker.worker.batched_task import resolve, run_steps
from batchmaker.worker.lanes import resolve_lanes, run_lanes

STAGES = (
    "decode", "plan", "admit", "schedule", "encode", "worker decode", "resolve", "cell", "run beyond the cell",
    "notice", "complete", "reply",
)  # fmt: skip
BURST = 32  # requests the manager reads and admits at once (it admits whatever waits on its socket)
WORKLOADS = {  # name: (model, hidden size, largest batch, dataset, requests, whether each runs alone)
    "LSTM H=256, WMT": ("lstm", 256, 64, "wmt", 256, False),
    "LSTM H=8, WMT": ("lstm", 8, 512, "wmt", 2048, False),
    "TreeLSTM H=256, SST": ("treelstm", 256, 64, "sst", 256, False),
    "LSTM H=256, one 22-token request at a time": ("lstm", 256, 64, "lone", 64, True),
}


class _Worker:
    """One CPU worker's arenas in shared memory, registered with the core as a worker registers."""

    def __init__(self, kinds: list, full_task_s: dict[str, float]):
        self.shared: list[SharedArray] = []
        arenas = []
        for i, kind in enumerate(kinds):
            for space, arena_id in (("device", 2 * i), ("io", 2 * i + 1)):
                shared = SharedArray(kind.dtype, (ROWS, *kind.shape))
                self.shared.append(shared)
                arenas.append({"id": arena_id, "kind": kind.key, "space": space, "rows": ROWS, "shm": shared.name})
        self.tensors = [torch.from_numpy(shared.array) for shared in self.shared]
        registration = {"index": 0, "arenas": arenas, "full_task_s": full_task_s}
        self.handle = WorkerHandle(0, b"w0", registration, kinds, 0)

    def close(self) -> None:
        self.handle.close()
        for shared in self.shared:
            shared.close()


def measure(name: str, model: str, hidden: int, batch: int, dataset: str, count: int, alone: bool) -> dict[str, Any]:
    """Stage seconds summed over `count` requests admitted at once and run to their answers, or (`alone`)
    each admitted once the one before has its answer, as on an idle server."""
    clock: dict[str, float] = defaultdict(float)
    stage = stage_timer(clock)
    with served_model(model, hidden, batch) as (config, models, specs, kinds, cells):
        seconds = _warm_up_seconds(cells, specs)
        timed = [TimedCell(cell, clock) for cell in cells]
        planner = models[model]
        inputs = lone_sentence() if dataset == "lone" else DATASETS[dataset]()
        frames = [encode({"id": i, "model": model, "inputs": inputs[i % len(inputs)]}) for i in range(count)]
        for frame in frames:  # a serving manager has the plans of common shapes cached: so here
            planner.plan(decode(frame, 1 << 24)["inputs"])
        worker = _Worker(kinds, seconds)
        core = BatchingCore(config, models, specs, kinds, {0: worker.handle})
        core.workers_changed()
        tasks = steps = answered = 0
        try:
            with torch.inference_mode():
                for group in [[frame] for frame in frames] if alone else [frames]:
                    for start in range(0, len(group), BURST):
                        burst = []
                        for frame in group[start : start + BURST]:
                            with stage("decode"):
                                message = decode(frame, 1 << 24)
                            with stage("plan"):
                                planner.plan(message["inputs"])  # timed apart: the core plans again within `admit`
                            burst.append((b"client", message["id"], message, time.perf_counter()))
                        with stage("admit"):
                            refused = [r for r in core.admit_burst(burst) if isinstance(r, RequestError)]
                        if refused:
                            raise RuntimeError(f"{name}: {len(refused)} requests refused, the first: {refused[0]}")
                    admitted = answered + len(group)
                    while answered < admitted:
                        with stage("schedule"):
                            formed = core.schedule(worker.handle)
                        if not formed:
                            raise RuntimeError(
                                f"{name}: nothing scheduled with {admitted - answered} requests unanswered"
                            )
                        for task in formed:
                            with stage("encode"):
                                frame = encode_task(task.message)
                            with stage("worker decode"):
                                sent = decode_task(frame)
                            answered += _run(core, worker, task.task_id, sent, timed, specs, stage, clock)
                            tasks += 1
                            steps += len(task.step_sizes)
        finally:
            worker.close()
    clock["admit"] -= clock["plan"]
    clock["run beyond the cell"] -= clock["cell"]
    return {"workload": name, "requests": count, "tasks": tasks, "steps": steps, "seconds": dict(clock)}


def _warm_up_seconds(cells: list[torch.nn.Module], specs: list) -> dict[str, float]:
    """A step's seconds per cell type at its largest batch, as a worker times it at warm-up: the cost
    the scheduler bounds its multi-step tasks with."""
    timings = {}
    with torch.inference_mode():
        for cell, spec in zip(cells, specs):
            args = [
                torch.zeros((spec.max_batch, *kind.shape), dtype=getattr(torch, kind.dtype)) for kind in spec.inputs
            ]
            for port in sorted(spec.ragged_inputs, reverse=True):
                args.insert(port + 1, torch.arange(spec.max_batch))
            cell(*args)
            began = time.perf_counter()
            cell(*args)
            timings[spec.key] = time.perf_counter() - began
    return timings


def _run(core: BatchingCore, worker: _Worker, task_id: int, sent: Any, cells, specs, stage: Callable, clock) -> int:
    """Run one task as the CPU worker does and complete it, its notice saying how long it kept the worker
    busy (as a worker's does: the scheduler sizes lane tasks by it); returns the answers it made."""
    began = time.perf_counter()
    with stage("resolve"):
        if isinstance(sent, LaneTaskMessage):
            issued: Any = resolve_lanes(sent, worker.tensors, cells, {}, specs[sent.cell_index].stop)
        else:
            issued = resolve(sent, worker.tensors, cells, {})
    with stage("run beyond the cell"):
        if isinstance(sent, LaneTaskMessage):
            for (_, _, io, io_slots), rows in zip(issued.downloads, run_lanes(issued)):
                io.index_copy_(0, io_slots, rows)
        else:
            run_steps(issued)
    busy_us = [int((time.perf_counter() - began) * 1e6)]
    with stage("notice"):
        notice = decode_notice(encode_notice(CompletionNotice(0, [task_id], {}, 1, busy_us=busy_us)))
    with stage("complete"):
        outcomes = core.tasks_finished(worker.handle, notice)
    answered = 0
    with stage("reply"):
        for outcome in outcomes:
            if isinstance(outcome, Answered):
                request = outcome.request
                encode({"id": request.request_id, "ok": True, "outputs": outcome.outputs, "timing": outcome.timing})
                answered += 1
    return answered


def run(quick: bool, out: Path) -> dict[str, Any]:
    gc.collect()  # as the manager collects garbage (manager.loop.main): rarely, never rescanning start-up state
    gc.freeze()
    gc.set_threshold(100_000, 20, 100)
    scale = 4 if quick else 1
    rows = [measure(name, *spec[:4], spec[4] // scale, spec[5]) for name, spec in WORKLOADS.items()]
    result = {
        "preset": "stages",
        "quick": quick,
        "commit": git("rev-parse", "HEAD"),
        "describe": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "rows": rows,
        "running_batch": stages_running.run(quick),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "stages.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict[str, Any]) -> str:
    lines = [f"stages at {result['describe']} (in process, one CPU worker, one thread; µs per request / per task)"]
    for row in result["rows"]:
        requests, tasks = row["requests"], row["tasks"]
        lines += [
            "",
            f"{row['workload']}: {requests} requests, {tasks} tasks, {row['steps']} steps",
            "| stage | µs per request | µs per task |",
            "|---|---:|---:|",
        ]
        seconds = row["seconds"]
        for what in STAGES:
            lines.append(
                f"| {what} | {seconds.get(what, 0.0) * 1e6 / requests:,.1f} "
                f"| {seconds.get(what, 0.0) * 1e6 / tasks:,.1f} |"
            )
        manager = sum(
            seconds.get(s, 0.0) for s in ("decode", "plan", "admit", "schedule", "encode", "complete", "reply")
        )
        beyond = sum(seconds.get(s, 0.0) for s in ("worker decode", "resolve", "run beyond the cell"))
        lines.append(f"| manager in all | {manager * 1e6 / requests:,.1f} | {manager * 1e6 / tasks:,.1f} |")
        lines.append(f"| worker beyond the cell | {beyond * 1e6 / requests:,.1f} | {beyond * 1e6 / tasks:,.1f} |")
    if result.get("running_batch"):
        lines += ["", "a worker's part of the requests routed to its running batch (µs per request / per step):"]
        lines += stages_running.table(result["running_batch"])
    return "\n".join(lines)
