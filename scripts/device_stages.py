"""The stages of `scripts/device-check`, one per process: `python scripts/device_stages.py STAGE --out DIR`.

Each stage prints what it finds and writes DIR/STAGE.json: {"ok", "problems", "results"}. With `--cpu`
a stage runs what it can without a GPU (on CPU workers), so that the script runs everywhere and cannot
rot; `--quick` shrinks every count.

environment  torch and CUDA versions, each GPU's name, UUID and compute mode, the allocator settings
             (expandable segments: workers turn them off for their arenas, which CUDA IPC shares), /dev/shm
cuda-tests   the `cuda`-marked tests
counter      10,000 tasks on one backend, each downloading a value of its own into an io row, every row
             checked the moment the counter passes its task (a signal ahead of its copies shows here)
served       configs/all.toml served by two workers on one device (or one per GPU), graphs off and on,
             every answer checked against the CPU reference, rows read from peers, no worker lost
throughput   the LSTM cell at hidden 256 (and 1024) at batch 64 and 512: a bare eager step loop, a captured
             graph loop, the backend issuing chained tasks (host µs a task), and a served run of 100-token
             requests (served cells/s over the bare loop's)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from device_served import check_served, serve_lstm, serving_config

from batchmaker.common.slots import FIRST_FREE_SLOT, ZERO_SLOT
from batchmaker.common.task import TaskMessage
from batchmaker.worker.backend import Backend, arena_ids
from batchmaker.worker.cuda_runtime import expandable_segments
from batchmaker.worker.main import load_cells

Result = tuple[list[str], dict[str, Any]]  # problems, results


def environment(args: argparse.Namespace) -> Result:
    problems: list[str] = []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "uuid": str(props.uuid), "memory_bytes": props.total_memory})
    modes = _nvidia_smi("compute_mode")
    for gpu, mode in zip(gpus, modes):
        gpu["compute_mode"] = mode
        if mode.lower().startswith("exclusive"):
            problems.append(f"GPU {gpu['index']} is in compute mode {mode}: two workers cannot share it")
    shm = os.statvfs("/dev/shm")
    results = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "gpus": gpus,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "expandable_segments": expandable_segments(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")),
        "dev_shm_bytes": shm.f_frsize * shm.f_blocks,
        "dev_shm_free_bytes": shm.f_frsize * shm.f_bavail,
    }
    if not gpus and not args.cpu:
        problems.append(
            f"no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"
        )
    if results["dev_shm_free_bytes"] < 256 << 20:
        problems.append(f"/dev/shm has {results['dev_shm_free_bytes'] >> 20} MiB free: the arenas live there")
    return problems, results


def _nvidia_smi(field: str) -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    found = subprocess.run(
        ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    return [line.strip() for line in found.stdout.splitlines() if line.strip()]


def cuda_tests(args: argparse.Namespace) -> Result:
    if args.cpu:
        return [], {"skipped": "no GPU (--cpu)"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], cwd=ROOT, check=False)
    return ([] if run.returncode == 0 else [f"the cuda-marked tests failed (pytest exit {run.returncode})"]), {}


def _backend(device: str, hidden: int, rows: int, directory: Path) -> tuple[Backend, list, list]:
    """A warmed-up backend of the LSTM at `hidden` on `device`: (backend, its cells, value kinds)."""
    config = serving_config(directory, [device], lstm_hidden=hidden)
    specs, cells, kinds = load_cells(config, device)
    if device == "cpu":
        from batchmaker.worker.cpu import CpuBackend

        backend: Backend = CpuBackend(cells, specs, kinds, rows, rows)
    else:
        from batchmaker.worker.cuda import CudaBackend

        backend = CudaBackend(device, cells, specs, kinds, rows, rows)
    backend.warm_up()
    return backend, cells, kinds


def _step_task(task_id: int, kinds, tokens: np.ndarray, out: int, io_rows: np.ndarray) -> TaskMessage:
    """One LSTM step from zero state for `tokens`, its h written at rows `out`.. and downloaded to `io_rows`."""
    ids = arena_ids(kinds)
    token_arena = ids[next(k for k in kinds if k.dtype == "int64")][0]
    state_arena, state_io = ids[next(k for k in kinds if k.dtype == "float32")]
    n = len(tokens)
    zeros = np.full(n, ZERO_SLOT)
    h = np.arange(out, out + 2 * n, 2)
    return TaskMessage(
        task_id, 0, n,
        [(token_arena, zeros, None, None, (np.arange(n), tokens.astype(np.int64).tobytes())),
         (state_arena, zeros, None, None, None), (state_arena, zeros, None, None, None)],
        [(state_arena, h), (state_arena, h + 1)],
        [(state_arena, h, state_io, io_rows)],
    )  # fmt: skip


def counter(args: argparse.Namespace) -> Result:
    """Tasks issued `window` ahead of the check, a token each: io row i % window must hold h(token) once the
    counter has passed task i, before a later task may reuse it."""
    from batchmaker.common.shm import SharedArray

    device = "cpu" if args.cpu else "cuda:0"
    tasks, window = (1_000 if args.quick else 10_000), 64
    with tempfile.TemporaryDirectory() as directory:
        backend, _, kinds = _backend(device, 64, 4096, Path(directory))
        info = next(a for a in backend.arenas if a.space == "io" and a.kind.dtype == "float32")
        io = SharedArray(info.kind.dtype, (info.rows, *info.kind.shape), name=info.shm_name)
        try:
            vocab = 997
            expected = _zero_state_h(backend, kinds, vocab, io.array)
            base, problems = backend.signal(), []
            began = time.perf_counter()
            for task_id in range(tasks + window):
                if task_id >= window:  # check the task `window` back once the counter passes it
                    checked = task_id - window
                    backend.wait_for_signal(base + checked, 60.0)
                    if backend.signal() <= base + checked:
                        return [f"the counter stopped at task {backend.signal() - base} of {tasks}"], {}
                    row = FIRST_FREE_SLOT + checked % window
                    if backend.finish(checked) is not None or not np.allclose(
                        io.array[row], expected[checked % vocab], atol=1e-5
                    ):
                        problems.append(
                            f"task {checked}: io row {row} does not hold its value when the counter passed it"
                        )
                        break
                if task_id < tasks:
                    row = FIRST_FREE_SLOT + task_id % window
                    backend.issue(
                        _step_task(task_id, kinds, np.array([task_id % vocab]), 2 * window + 16, np.array([row]))
                    )
            seconds = time.perf_counter() - began
        finally:
            io.close()
            backend.close()
    print(f"counter: {tasks} tasks on {device}, every io row checked as the counter passed it, {seconds:.1f} s")
    return problems, {"device": device, "tasks": tasks, "seconds": seconds}


def _zero_state_h(backend: Backend, kinds, vocab: int, io: np.ndarray) -> np.ndarray:
    """h after one step from zero state for every token below `vocab`, computed by the backend itself."""
    rows = np.empty((vocab, io.shape[1]), np.float32)
    for start in range(0, vocab, 64):
        tokens = np.arange(start, min(start + 64, vocab))
        seen = backend.signal()
        backend.issue(_step_task(-1, kinds, tokens, 256, FIRST_FREE_SLOT + np.arange(len(tokens))))
        backend.wait_for_signal(seen, 60.0)
        backend.finish(-1)
        rows[tokens] = io[FIRST_FREE_SLOT : FIRST_FREE_SLOT + len(tokens)]
    return rows


def served(args: argparse.Namespace) -> Result:
    gpus = torch.cuda.device_count()
    if args.cpu:
        devices, graphs = ["cpu", "cpu"], (False,)
    else:
        devices, graphs = ([f"cuda:{i}" for i in range(gpus)] if gpus > 1 else ["cuda:0", "cuda:0"]), (False, True)
    problems, results = [], {}
    for cuda_graphs in graphs:
        with tempfile.TemporaryDirectory() as directory:
            config = serving_config(Path(directory), devices, cuda_graphs=cuda_graphs)
            found, stats = check_served(config, len(devices), 24 if args.quick else 120)
        problems += [f"graphs {'on' if cuda_graphs else 'off'}: {problem}" for problem in found]
        results[f"graphs {'on' if cuda_graphs else 'off'}"] = stats
    return problems, results


def throughput(args: argparse.Namespace) -> Result:
    device = "cpu" if args.cpu else "cuda:0"
    hiddens = (256,) if args.quick or args.cpu else (256, 1024)
    batches = (64,) if args.cpu else (64, 512)
    results: dict[str, Any] = {}
    for hidden in hiddens:
        with tempfile.TemporaryDirectory() as directory:
            backend, cells, kinds = _backend(device, hidden, 4096, Path(directory))
            try:
                for batch in batches:
                    row = {"eager cells/s": _bare_loop(cells[0], hidden, device, batch, graph=False)}
                    if device != "cpu":
                        row["graph cells/s"] = _bare_loop(cells[0], hidden, device, batch, graph=True)
                    row["host µs a task"] = _chained_tasks(backend, kinds, batch, 50 if args.quick else 500)
                    results[f"H={hidden} batch {batch}"] = row
            finally:
                backend.close()
            served_rate = serve_lstm(Path(directory), device, hidden, 64 if args.quick else 512)
        bare = results[f"H={hidden} batch {batches[-1]}"]["eager cells/s"]
        results[f"H={hidden} served"] = {"cells/s": served_rate, "over the bare loop": served_rate / bare}
    for name, row in results.items():
        print(f"throughput: {name}: " + ", ".join(f"{k} {v:,.1f}" for k, v in row.items()))
    return [], results


def _bare_loop(cell: torch.nn.Module, hidden: int, where: str, batch: int, graph: bool, steps: int = 200) -> float:
    """Cells per second of the LSTM cell called step after step on its own outputs (state fed back)."""
    device = torch.device(where)
    tokens = torch.zeros(batch, dtype=torch.int64, device=device)
    h = torch.zeros(batch, hidden, device=device)
    c = torch.zeros(batch, hidden, device=device)

    def run(count: int) -> None:
        nonlocal h, c
        for _ in range(count):
            h, c = cell(tokens, h, c)

    with torch.inference_mode():
        step: Callable[[int], None] = run
        if graph:
            run(3)
            torch.cuda.synchronize(device)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                h, c = cell(tokens, h, c)
            step = lambda count: [captured.replay() for _ in range(count)]
        step(10)
        _sync(device)
        began = time.perf_counter()
        step(steps)
        _sync(device)
        return batch * steps / (time.perf_counter() - began)


def _chained_tasks(backend: Backend, kinds, batch: int, tasks: int) -> float:
    """Host µs to issue one LSTM step of `batch` rows, tasks issued back to back as a worker issues them."""
    tokens = np.arange(batch) % 97
    seen = backend.signal()
    began = time.perf_counter()
    for task_id in range(tasks):
        backend.issue(
            _step_task(
                task_id, kinds, tokens, FIRST_FREE_SLOT + (task_id % 2) * 2 * batch, np.arange(batch) + FIRST_FREE_SLOT
            )
        )
    issued = time.perf_counter() - began
    backend.wait_for_signal(seen + tasks - 1, 120.0)
    for task_id in range(tasks):
        backend.finish(task_id)
    return issued / tasks * 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


STAGES: dict[str, Callable[[argparse.Namespace], Result]] = {
    "environment": environment,
    "cuda-tests": cuda_tests,
    "counter": counter,
    "served": served,
    "throughput": throughput,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="device_stages.py", description="One stage of scripts/device-check.")
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="what runs without a GPU, on CPU workers")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    problems, results = STAGES[args.stage](args)
    for problem in problems:
        print(f"{args.stage}: PROBLEM: {problem}")
    report = {"ok": not problems, "problems": problems, "results": results}
    (args.out / f"{args.stage}.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
