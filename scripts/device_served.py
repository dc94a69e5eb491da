"""Served checks of `scripts/device-check`: a real server (supervisor, manager, workers) on the device under
test, every answer checked against the model's CPU reference."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from batchmaker.bench.run import free_port_on
from batchmaker.bench.trees import binary_tree, random_tree
from batchmaker.bench.verify import TOLERANCE, mismatch
from batchmaker.clients import AsyncClient, Client
from batchmaker.common.config import Config, load_config
from batchmaker.common.models import build_model, init_missing_weights
from batchmaker.manager.commands.supervisor import Supervisor

LONG = 100  # tokens of a throughput request


def serving_config(
    directory: Path, devices: list[str], cuda_graphs: bool = False, lstm_hidden: int | None = None
) -> Config:
    """configs/all.toml on `devices` (or, with `lstm_hidden`, the LSTM alone at that size, batches up to 512),
    on a free port, the manager's tasks one per submission so that subgraphs change workers and peers' arenas are read;
    weights it lacks are made in `directory`."""
    text = (ROOT / "configs" / "all.toml").read_text()
    if lstm_hidden is not None:
        text = text[: text.index("[models.gru]")].replace("hidden_size = 256", f"hidden_size = {lstm_hidden}")
        text = re.sub(r"(?m)^batch_sizes = .*$", "batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]", text)
        text = text.replace('"../weights/lstm-h256-random.pt"', f'"{directory}/lstm-h{lstm_hidden}.pt"')
    workers = (
        f"devices = {_toml_list(devices)}"
        if devices[0] != "cpu"
        else f'devices = "cpu"\ncpu_workers = {len(devices)}'
    )
    text = re.sub(
        r"(?m)^devices = .*$\n^cpu_workers = .*$", f"{workers}\ncuda_graphs = {str(cuda_graphs).lower()}", text
    )
    text = re.sub(r"(?m)^address = .*$", f'address = "tcp://127.0.0.1:{free_port_on("127.0.0.1")}"', text)
    # The manager's steps (a GPU's default), so that CPU workers check the same path.
    text = re.sub(r"(?m)^max_tasks_to_submit = .*$", 'max_tasks_to_submit = 1\nrunning_batch = "manager"', text)
    for weights in re.findall(r'"\.\./weights/([^"]+)"', text):
        if not (ROOT / "weights" / weights).exists():
            text = text.replace(f'"../weights/{weights}"', f'"{directory}/{weights}"')
    text = text.replace('"../weights/', f'"{ROOT}/weights/')
    path = directory / "device-check.toml"
    path.write_text(text)
    config = load_config(path)
    init_missing_weights(config)
    return config


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


@contextmanager
def running(config: Config) -> Iterator[Supervisor]:
    supervisor = Supervisor(config)
    supervisor.start()
    watcher = threading.Thread(target=supervisor.watch, daemon=True)
    watcher.start()
    try:
        if not supervisor.wait_ready(timeout=600):
            raise RuntimeError("the server did not become ready (see the worker logs above)")
        yield supervisor
    finally:
        supervisor.request_stop()
        watcher.join(timeout=5)
        supervisor.stop()


def check_served(config: Config, workers: int, per_model: int) -> tuple[list[str], dict[str, Any]]:
    """Every model's requests at once; each answer against the reference; peers read, no worker lost."""
    problems: list[str] = []
    with running(config) as supervisor:
        rng = np.random.default_rng(0)
        models = {name: build_model(model_config) for name, model_config in config.models.items()}
        batches = {name: requests_for(name, model, rng, per_model) for name, model in models.items()}

        async def everything() -> list[list]:
            return await asyncio.gather(*(_ask(supervisor.address, name, batch) for name, batch in batches.items()))

        for (name, batch), replies in zip(batches.items(), asyncio.run(everything())):
            state = models[name].load_weights()
            worst, wrong = 0.0, []
            for inputs, reply in zip(batch, replies):
                error, problem = mismatch(models[name], state, inputs, reply.outputs)
                worst = max(worst, error)
                if problem:
                    wrong.append(problem)
            print(f"served: {name}: {len(batch)} answers, max abs error {worst:.2e}")
            if worst > TOLERANCE or wrong:
                problems.append(f"{name}: max abs error {worst:.2e}, {wrong[:2]}")
        with Client(supervisor.address, timeout=30) as client:
            stats = client.stats()
    tasks = {worker: w["tasks_completed"] for worker, w in stats["workers"].items()}
    from_peers = sum(sum(w["rows_read_from_peers"].values()) for w in stats["workers"].values())
    print(
        f"served: tasks per worker {tasks}, rows read from peers {from_peers}, worker losses {stats['worker_losses']}"
    )
    if not from_peers:
        problems.append("no rows were read from a peer's arena")
    if len(tasks) != workers:
        problems.append(f"{len(tasks)} workers registered, expected {workers}")
    if stats["worker_losses"]:
        problems.append(f"{stats['worker_losses']} worker(s) lost while serving")
    return problems, {"tasks per worker": tasks, "rows read from peers": from_peers}


def serve_lstm(directory: Path, device: str, hidden: int, requests: int) -> float:
    """Cells per second served to `requests` LSTM requests of LONG tokens sent at once (answers checked)."""
    config = serving_config(directory, [device], lstm_hidden=hidden)
    model = build_model(config.models["lstm"])
    rng = np.random.default_rng(1)
    batch = [{"tokens": rng.integers(0, 8192, LONG).tolist()} for _ in range(requests)]
    with running(config) as supervisor:
        asyncio.run(_ask(supervisor.address, "lstm", batch[:8]))  # warm
        began = time.perf_counter()
        replies = asyncio.run(_ask(supervisor.address, "lstm", batch))
        seconds = time.perf_counter() - began
    state = model.load_weights()
    for inputs, reply in zip(batch[:8], replies):
        error, problem = mismatch(model, state, inputs, reply.outputs)
        if error > TOLERANCE or problem:
            raise RuntimeError(f"a served LSTM answer is wrong: max abs error {error:.2e} {problem or ''}")
    return requests * LONG / seconds


async def _ask(address: str, model: str, requests: list[dict]) -> list:
    async with AsyncClient(address, timeout=300) as client:
        return await asyncio.gather(*(client.infer(model, inputs) for inputs in requests))


def requests_for(name: str, model, rng: np.random.Generator, count: int) -> list[dict]:
    """Random requests for a model of configs/all.toml."""
    params = model.config.params

    def length(top: int) -> int:
        return int(rng.integers(1, top))

    if name in ("lstm", "gru", "seq2seq"):
        vocab, top = params.get("vocab_size", params.get("src_vocab_size")), 60 if name != "seq2seq" else 30
        return [{"tokens": rng.integers(0, vocab, length(top)).tolist()} for _ in range(count)]
    if name == "treelstm":
        return [{"tree": binary_tree(rng, length(40), params["vocab_size"])} for _ in range(count)]
    return [{"tree": random_tree(rng, length(60), params["vocab_size"])} for _ in range(count)]
