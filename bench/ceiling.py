"""`./scripts/bench ceiling`: the control plane's ceiling, with cells that cost almost nothing.

Every model at hidden size 8 on one CPU worker, with GPU-sized batches (up to 512), is saturated
by a closed-loop load generator in its own process: a raw DEALER socket that keeps `WINDOW`
requests outstanding. What remains is scheduling and messaging, so the cells/s and requests/s
here are what the manager and the worker's task handling can sustain. The generator is measured
alone first, against an echo server that answers every request at once with a reply shaped like
the server's, so the table shows it is not the bottleneck. A sample of every row's replies is
checked against the model's reference. Each row also reports the manager's CPU time (user and
system, read from the operating system around the measured run) per request and per task it formed:
the control plane's own cost, whatever else shares the machine; and the worker's CPU time per request
(and per task), whole and beyond its cells: less the time the run's steps spent in the cells' forward calls (each
(cell type, batch size) the server's stats counted, times that forward timed in this process on one
thread, as the worker runs it), an estimate of the task's cost to the worker beyond the model.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.generator import Replies, closed_loop, request_frames
from batchmaker.bench.report import fraction
from batchmaker.bench.run import ROOT, git, machine, serve_options
from batchmaker.bench.sweep import ServedPolicy, kernel_busy
from batchmaker.bench.verify import verify
from batchmaker.common.config import load_config
from batchmaker.common.graph import CellTypeSpec
from batchmaker.common.models import Model, build_model, init_missing_weights
from batchmaker.common.protocol import encode, tensor_to_map
from batchmaker.manager.commands.launcher import free_port_on

WINDOW = 2000  # requests the generator keeps outstanding
CHECKED = 40  # replies per row compared with the reference
FORWARD_RUNS = 5  # timings of a cell's forward at a batch size: the median is kept
BATCH_SIZES = "[1, 2, 4, 8, 16, 32, 64, 128, 256, 512]"

MODELS = f"""
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "{{weights}}/ceiling-lstm-h8.pt"
vocab_size = 8192
hidden_size = 8
max_length = 400
batch_sizes = {BATCH_SIZES}

[models.gru]
builder = "batchmaker.common.models.gru:build"
weights = "{{weights}}/ceiling-gru2-h8.pt"
vocab_size = 8192
hidden_size = 8
num_layers = 2
max_length = 400
batch_sizes = {BATCH_SIZES}

[models.seq2seq]
builder = "batchmaker.common.models.seq2seq:build"
weights = "{{weights}}/ceiling-seq2seq-h8.pt"
src_vocab_size = 8192
tgt_vocab_size = 4096
hidden_size = 8
max_length = 400
max_decode_length = 200
batch_sizes = {BATCH_SIZES}

[models.seq2seq.cells.decoder]
priority = 1

[models.treelstm]
builder = "batchmaker.common.models.treelstm:build"
weights = "{{weights}}/ceiling-treelstm-h8.pt"
vocab_size = 8737
hidden_size = 8
num_classes = 5
batch_sizes = {BATCH_SIZES}
"""


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    requests: int
    inputs: Any  # () -> list of request inputs


def _lstm(length: int):
    def make() -> list[dict[str, Any]]:
        rng = np.random.default_rng(length)
        return [{"tokens": rng.integers(0, 8192, length).tolist()} for _ in range(64)]

    return make


ROWS = (  # five to ten windows a row: the rate of the steady state, not of the first window's ramp and the last's tail
    Row("LSTM, length 100", "lstm", 10_000, _lstm(100)),
    Row("LSTM, WMT lengths", "lstm", 20_000, DATASETS["wmt"]),
    Row("LSTM, length 1", "lstm", 20_000, _lstm(1)),
    Row("GRU 2 layers, WMT lengths", "gru", 20_000, DATASETS["wmt"]),
    Row("Seq2Seq to EOS, WMT lengths", "seq2seq", 10_000, DATASETS["wmt"]),
    Row("TreeLSTM, SST trees", "treelstm", 10_000, DATASETS["sst"]),
)
QUICK_SCALE = 25  # --quick runs a 25th of each row: a smoke test, mostly ramp and tail


def _echo(address: str, reply: dict[str, Any], ready: Any) -> None:
    """Answers every request at once with `reply` under its id (a server-shaped answer): the generator's ceiling."""
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.bind(address)
    ready.set()
    while True:
        client, body = socket.recv_multipart()
        if body == b"stop":
            break
        reply["id"] = msgpack.unpackb(body, raw=False)["id"]
        socket.send_multipart([client, encode(reply)])
    socket.close(linger=0)
    context.term()


def generator_alone(frames: list[bytes]) -> float:
    """Requests/s the generator reaches against an echo server (a reply like an LSTM's h and c)."""
    address = f"tcp://127.0.0.1:{free_port_on('127.0.0.1')}"
    state = tensor_to_map(np.zeros(8, np.float32))
    timing = {"queue_us": 1, "compute_us": 1, "total_us": 1}
    reply = {"id": 0, "ok": True, "outputs": {"h": state, "c": state}, "timing": timing}
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    echo = spawn.Process(target=_echo, args=(address, reply, ready))
    echo.start()
    ready.wait(30)
    replies = closed_loop(address, frames, WINDOW)
    with zmq.Context() as context, context.socket(zmq.DEALER) as stop:
        stop.connect(address)
        stop.send(b"stop")
        echo.join(10)
        stop.close(linger=0)
    return len(frames) / float(np.nanmax(replies.received))


def _cells(model, inputs: dict[str, Any], reply: dict[str, Any]) -> int:
    """Cells one request needed: its graph's nodes, or for a decoder the steps it ran to its EOS."""
    graph = model.unfold(inputs)
    if not graph.watch:
        return len(graph.nodes)
    decoded = len(reply["outputs"]["tokens"]["data"]) // 8
    return len(graph.nodes) - len(graph.watch) + min(decoded + 1, len(graph.watch))


def measure(served: ServedPolicy, frames: list[bytes], model: Model | None = None) -> tuple[Replies, dict[str, float]]:
    """One closed-loop run of `frames`, how busy the workers' kernels were, and the manager's CPU µs per request and
    per task during it (the task count from the server's stats, read before the CPU time and after it, so the stats
    op is not counted; NaN per task when the workers' running batches ran every step: no tasks); with the served
    `model`, also the worker's CPU µs per request and per task, whole and beyond its cells."""
    before = served.stats()
    cpu = served.cpu_seconds()
    replies = closed_loop(served.address, frames, WINDOW)
    used = served.cpu_seconds()
    after = served.stats()
    tasks = after["tasks"] - before["tasks"]
    manager = used["manager"] - cpu["manager"]
    measured = {
        "tasks": tasks,
        "steps": after["steps"] - before["steps"],
        "kernel_busy": kernel_busy(before, after, float(np.nanmax(replies.received))),
        "manager_cpu_us_per_request": manager * 1e6 / len(frames),
        "manager_cpu_us_per_task": manager * 1e6 / tasks if tasks else math.nan,
    }
    if model is not None:
        worker = used.get("worker", 0.0) - cpu.get("worker", 0.0)
        beyond = worker - beyond_cells(model, before["batch_sizes"], after["batch_sizes"])
        measured["worker_cpu_us_per_request"] = worker * 1e6 / len(frames)
        measured["worker_cpu_us_per_request_beyond_cells"] = beyond * 1e6 / len(frames)
        measured["worker_cpu_us_per_task"] = worker * 1e6 / tasks if tasks else math.nan
        measured["worker_cpu_us_per_task_beyond_cells"] = beyond * 1e6 / tasks if tasks else math.nan
    return replies, measured


def beyond_cells(model: Model, before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> float:
    """Seconds the run's steps spent in their cells: each (cell type, batch size) the server ran, counted
    from its stats, times the cell's own forward at that batch size, run here on one thread as the
    worker runs it: the median of a few runs' CPU time, as the worker's is, so that another process
    taking the core meanwhile does not count."""
    cells = model.make_cells(model.load_weights())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seconds = 0.0
    try:
        with torch.inference_mode():
            for key, sizes in after.items():
                spec = model.cell_types.get(key)
                if spec is None:
                    continue
                for size, count in sizes.items():
                    ran = count - before.get(key, {}).get(size, 0)
                    if ran > 0:
                        seconds += ran * _forward_seconds(cells[key], spec, int(size))
    finally:
        torch.set_num_threads(threads)
    return seconds


def _forward_seconds(cell: torch.nn.Module, spec: CellTypeSpec, batch: int) -> float:
    args = []
    for port, kind in enumerate(spec.inputs):
        args.append(torch.zeros((batch, *kind.shape), dtype=getattr(torch, kind.dtype)))
        if port in spec.ragged_inputs:
            args.append(torch.arange(batch))
    cell(*args)
    runs = []
    for _ in range(FORWARD_RUNS):
        began = time.thread_time()
        cell(*args)
        runs.append(time.thread_time() - began)
    return statistics.median(runs)


def run(quick: bool, out: Path, trace_to: str | None = None, running_batch: str | None = None) -> dict[str, Any]:
    """`trace_to`: an OTLP/HTTP endpoint; every request is traced and its spans exported there (the manager's
    cost of tracing shows in its CPU µs per request). `running_batch`: who decides each step (None: the default)."""
    scale = QUICK_SCALE if quick else 1
    tracing = f'[tracing]\nendpoint = "{trace_to}"\nsample_rate = 1.0\n' if trace_to else ""
    with tempfile.TemporaryDirectory(prefix="batchmaker-ceiling-") as tmp:
        address = f"tcp://127.0.0.1:{free_port_on('127.0.0.1')}"
        config_path = Path(tmp) / "ceiling.toml"
        config_path.write_text(
            f"""
[server]
address = "{address}"
cpu_workers = 1
threads_per_worker = 1
arena_rows = 65536
io_rows = 65536
max_queued_requests = 20000
max_queued_nodes = 10000000
max_queue_delay_ms = 0
"""
            + tracing
            + MODELS.replace("{weights}", str(ROOT / "weights"))
        )
        config = load_config(config_path)
        init_missing_weights(config)
        models = {name: build_model(model_config) for name, model_config in config.models.items()}
        states = {name: model.load_weights() for name, model in models.items()}
        rows = []
        options = serve_options("cellular", running_batch)
        with ServedPolicy(config_path, address, "cellular", "lstm", *options) as served:
            running_batch = served.stats()["running_batch"]
            for row in ROWS:
                inputs = row.inputs()
                count = row.requests // scale
                requests = [inputs[i % len(inputs)] for i in range(count)]
                frames = request_frames(row.model, requests)
                closed_loop(address, frames[: min(200, count)], WINDOW)  # warm up: plans of the common shapes
                run, manager = measure(served, frames, models[row.model])
                seconds = float(np.nanmax(run.received))
                replies = run.replies
                failed = sum(1 for reply in replies if reply is None or not reply["ok"])
                cells = sum(_cells(models[row.model], requests[i], r) for i, r in enumerate(replies) if r and r["ok"])
                check = verify(address, models[row.model], states[row.model], inputs[:CHECKED])
                rows.append(
                    {
                        "row": row.name,
                        "requests": count,
                        "failed": failed,
                        "seconds": seconds,
                        "requests_per_s": count / seconds,
                        "cells_per_s": cells / seconds,
                        "cells_per_request": cells / max(1, count - failed),
                        "verify": check,
                    }
                    | manager
                )
            lengths = [{"tokens": list(range(22))}] * (10_000 // scale)
            generator = generator_alone(request_frames("lstm", lengths))
    result = {
        "preset": "ceiling",
        "quick": quick,
        "commit": git("rev-parse", "HEAD"),
        "describe": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "window": WINDOW,
        "running_batch": running_batch,
        "traced_to": trace_to,
        "generator_alone_requests_per_s": generator,
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "ceiling.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        f"ceiling at {result['describe']} (hidden 8, one CPU worker, each step decided by the "
        f"{result.get('running_batch', 'manager')}, {result['window']} requests outstanding"
        + (f"; every request traced to {result['traced_to']})" if result.get("traced_to") else ")"),
        f"load generator alone (echo server): {result['generator_alone_requests_per_s']:,.0f} requests/s",
        (
            "| workload | requests/s | cells/s | cells per request | manager CPU µs per request | per task "
            "| worker CPU µs per request | beyond its cells | kernels busy | answers checked |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        check = row["verify"]
        ok = f"{check['checked']} ok" if check["ok"] else f"WRONG: {'; '.join(check['wrong'])}"
        failed = f", {row['failed']} requests failed" if row["failed"] else ""
        lines.append(
            f"| {row['row']} | {row['requests_per_s']:,.0f} | {row['cells_per_s']:,.0f} | "
            f"{row['cells_per_request']:.1f} | {row['manager_cpu_us_per_request']:.1f} | "
            f"{row['manager_cpu_us_per_task']:.1f} | {row.get('worker_cpu_us_per_request', math.nan):.1f} | "
            f"{row.get('worker_cpu_us_per_request_beyond_cells', math.nan):.1f} | {fraction(row.get('kernel_busy'))} | "
            f"{ok}{failed} |"
        )
    return "\n".join(lines)
