"""The checks only a real GPU can run (see README, "What is tested where").

1. the `cuda`-marked tests (stream-ordered counter, per-task errors, CUDA IPC between processes,
   a device-side assert ending the backend with DeviceFault, captured graphs against eager runs);
2. configs/all.toml served with one worker per GPU (two on a single GPU), every model's answers
   compared with its reference, with one task per submission, so that subgraphs move between
   workers and their inputs are read from peers' arenas through CUDA IPC: the check fails unless
   rows were read from peers (`rows_read_from_peers`). Served once with CUDA graphs off, once on.

With --cuda-graphs the server runs only with `[server] cuda_graphs = true`.

Exits 2 when no GPU is visible, 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

from conftest import free_port
from test_tree_models import random_tree

from batchmaker.bench.verify import TOLERANCE, mismatch
from batchmaker.clients import AsyncClient, Client
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model, init_missing_weights
from batchmaker.manager.commands.supervisor import Supervisor

REQUESTS_PER_MODEL = 120


def fail(message: str, status: int = 1) -> None:
    print(f"gpu-check: {message}", file=sys.stderr)
    sys.exit(status)


def binary_tree(rng: np.random.Generator, leaves: int, vocab_size: int) -> dict:
    """A random binary tree: words on the leaves, none on internal nodes; the left child has the smaller index."""
    tokens = [int(t) for t in rng.integers(vocab_size, size=leaves)]
    parents = [-1] * leaves
    roots = list(range(leaves))
    while len(roots) > 1:
        at = int(rng.integers(len(roots) - 1))
        parent = len(tokens)
        tokens.append(-1)
        parents.append(-1)
        for child in roots[at : at + 2]:
            parents[child] = parent
        roots[at : at + 2] = [parent]
    return {"tokens": tokens, "parents": parents}


def requests_for(name: str, model, rng: np.random.Generator) -> list[dict]:
    params = model.config.params

    def length(top: int) -> int:
        return int(rng.integers(1, top))

    if name in ("lstm", "gru", "seq2seq"):
        vocab, top = params.get("vocab_size", params.get("src_vocab_size")), 60 if name != "seq2seq" else 30
        return [{"tokens": rng.integers(0, vocab, length(top)).tolist()} for _ in range(REQUESTS_PER_MODEL)]
    if name == "treelstm":
        return [{"tree": binary_tree(rng, length(40), params["vocab_size"])} for _ in range(REQUESTS_PER_MODEL)]
    return [{"tree": random_tree(rng, length(60), params["vocab_size"])} for _ in range(REQUESTS_PER_MODEL)]


def serving_devices(gpus: int) -> list[str]:
    """A worker per GPU; two workers where there is one GPU, so that one still reads the other's arenas."""
    return [f"cuda:{i}" for i in range(gpus)] if gpus > 1 else ["cuda:0", "cuda:0"]


def serving_config(directory: Path, devices: list[str], cuda_graphs: bool = False):
    """configs/all.toml on `devices`, on a free port; weights it lacks are created in `directory`."""
    source = load_config(ROOT / "configs" / "all.toml")
    text = (ROOT / "configs" / "all.toml").read_text()
    listed = ", ".join(f'"{device}"' for device in devices)
    text = re.sub(r"(?m)^devices = .*$", f"devices = [{listed}]\ncuda_graphs = {str(cuda_graphs).lower()}", text)
    text = re.sub(r"(?m)^address = .*$", f'address = "tcp://127.0.0.1:{free_port()}"', text)
    # One task per submission: subgraphs change workers often, so peers' arenas are read.
    text = re.sub(r"(?m)^max_tasks_to_submit = .*$", "max_tasks_to_submit = 1", text)
    for model in source.models.values():
        weights = model.weights if model.weights.exists() else directory / model.weights.name
        text = text.replace(f'"../weights/{model.weights.name}"', f'"{weights}"')
    path = directory / "all.toml"
    path.write_text(text)
    config = load_config(path)
    init_missing_weights(config)
    return config


async def ask(address: str, model: str, requests: list[dict]) -> list:
    async with AsyncClient(address, timeout=300) as client:
        return await asyncio.gather(*(client.infer(model, inputs) for inputs in requests))


def check_served(config, workers: int) -> list[str]:
    supervisor = Supervisor(config)
    supervisor.start()
    watcher = threading.Thread(target=supervisor.watch, daemon=True)
    watcher.start()
    problems = []
    try:
        if not supervisor.wait_ready(timeout=600):
            return ["the server did not become ready (see the worker logs above)"]
        rng = np.random.default_rng(0)
        models = {name: build_model(model_config) for name, model_config in config.models.items()}
        batches = {name: requests_for(name, model, rng) for name, model in models.items()}

        async def everything():  # all models at once, so that every GPU is busy with all of them
            return await asyncio.gather(*(ask(supervisor.address, name, batch) for name, batch in batches.items()))

        for (name, batch), replies in zip(batches.items(), asyncio.run(everything())):
            state = models[name].load_weights()
            worst, wrong = 0.0, []
            for inputs, reply in zip(batch, replies):
                error, problem = mismatch(models[name], state, inputs, reply.outputs)
                worst = max(worst, error)
                if problem:
                    wrong.append(problem)
            verdict = "ok" if worst <= TOLERANCE and not wrong else "WRONG"
            print(f"gpu-check: {name}: {len(batch)} answers, max abs error {worst:.2e}: {verdict}")
            if verdict != "ok":
                problems.append(f"{name}: max abs error {worst:.2e}, {wrong[:2]}")
        with Client(supervisor.address, timeout=30) as client:
            stats = client.stats()
        tasks = {worker: w["tasks_completed"] for worker, w in stats["workers"].items()}
        from_peers = sum(sum(w["rows_read_from_peers"].values()) for w in stats["workers"].values())
        print(f"gpu-check: tasks completed per worker: {tasks}; rows read from peers: {from_peers}; "
              f"worker losses: {stats['worker_losses']}")  # fmt: skip
        if not from_peers:
            problems.append("no rows were read from a peer's arena: CUDA IPC was not exercised")
        if len(tasks) != workers:
            problems.append(f"{len(tasks)} workers registered, expected {workers}")
        if stats["worker_losses"]:
            problems.append(f"{stats['worker_losses']} worker(s) lost while serving")
    finally:
        supervisor.request_stop()
        watcher.join(timeout=5)
        supervisor.stop()
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(prog="gpu-check", description="The checks only a real GPU can run.")
    parser.add_argument("--cuda-graphs", action="store_true", help="serve with [server] cuda_graphs = true")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if not gpus:
        fail(f"no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}); "
             "run this on a machine with an NVIDIA GPU and a CUDA build of torch", status=2)
    print(f"gpu-check: {gpus} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], cwd=ROOT, check=False)
    if tests.returncode != 0:
        fail("the cuda tests failed")
    devices = serving_devices(gpus)
    for graphs in (True,) if args.cuda_graphs else (False, True):
        print(f"gpu-check: serving configs/all.toml on {devices}, CUDA graphs {'on' if graphs else 'off'}")
        with tempfile.TemporaryDirectory() as directory:
            problems = check_served(serving_config(Path(directory), devices, graphs), len(devices))
        if problems:
            fail("serving went wrong: " + "; ".join(problems))
    print("gpu-check: all checks passed")


if __name__ == "__main__":
    main()
