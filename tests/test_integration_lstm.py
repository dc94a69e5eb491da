"""End to end with real processes: supervisor, manager, two CPU workers, several concurrent clients."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import SMALL_LSTM, start_server, stop_server, wait_idle, write_config

from batchmaker.clients import AsyncClient, Client
from batchmaker.common.models import build_model

TOLERANCE = 1e-5


async def send_staggered(address: str, requests: list[list[int]], seed: int) -> list[tuple[int, object]]:
    """One client sending its requests with random gaps, many in flight at once."""
    rng = np.random.default_rng(seed)
    async with AsyncClient(address, timeout=120) as client:

        async def one(index: int, tokens: list[int]):
            return index, await client.infer("lstm", {"tokens": tokens})

        pending = []
        for index, tokens in enumerate(requests):
            pending.append(asyncio.create_task(one(index, tokens)))
            await asyncio.sleep(float(rng.exponential(0.004)))
        return await asyncio.gather(*pending)


async def run_clients(address: str, per_client: list[list[list[int]]]) -> list[list[tuple[int, object]]]:
    return await asyncio.gather(*(send_staggered(address, reqs, seed) for seed, reqs in enumerate(per_client)))


def check_against_reference(config, per_client, results) -> float:
    model = build_model(config.models["lstm"])
    state = model.load_weights()
    worst = 0.0
    for requests, replies in zip(per_client, results):
        assert len(replies) == len(requests)
        for index, reply in replies:
            expected = model.reference(state, {"tokens": requests[index]})
            for name in ("h", "c"):
                assert reply.outputs[name].dtype == np.float32
                assert reply.outputs[name].shape == expected[name].shape
                worst = max(worst, float(np.abs(reply.outputs[name] - expected[name]).max()))
            timing = reply.timing
            assert set(timing) == {"queue_us", "compute_us", "total_us"}
            assert all(isinstance(v, int) and v >= 0 for v in timing.values())
            assert timing["total_us"] >= timing["compute_us"]
    return worst


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_500_concurrent_requests_two_workers(tmp_path: Path, running_batch: str):
    config = write_config(tmp_path, SMALL_LSTM, scheduler=f'running_batch = "{running_batch}"')
    server = start_server(config, workers=2)
    try:
        rng = np.random.default_rng(7)
        lengths = rng.integers(1, 101, size=500)
        requests = [rng.integers(0, 1000, size=n).tolist() for n in lengths]
        per_client = [requests[i::5] for i in range(5)]
        results = asyncio.run(run_clients(server.address, per_client))

        worst = check_against_reference(config, per_client, results)
        assert worst <= TOLERANCE

        with server.client() as client:
            stats = wait_idle(client)
        assert stats["requests"]["ok"] == 500
        # Cellular behaviour: short requests left before long ones; with the manager's tasks, new requests joined
        # running ones in a task (a running batch takes them in between any two steps).
        assert stats["leaving_requests"] > 0
        assert stats["mean_batch_size"] > 1.5
        assert len(stats["workers"]) == 2
        if running_batch == "manager":
            assert stats["joining_tasks"] > 0
            assert all(w["tasks_completed"] > 0 for w in stats["workers"].values())
        else:
            assert stats["tasks"] == 0 and sum(w["requests_answered"] for w in stats["workers"].values()) == 500
            assert all(w["requests_answered"] > 0 and w["steps_run"] > 0 for w in stats["workers"].values())
        # Every arena slot is free again.
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values()), stats["workers"]
    finally:
        stop_server(server)


STACKED_LSTM = SMALL_LSTM.replace("num_layers = 1", "num_layers = 3") + """
[models.lstm.cells.layer2]
priority = 2
"""


def test_stacked_layers_are_served_correctly(tmp_path: Path):
    config = write_config(tmp_path, STACKED_LSTM)
    server = start_server(config, workers=1)
    try:
        rng = np.random.default_rng(3)
        requests = [rng.integers(0, 1000, size=n).tolist() for n in rng.integers(1, 40, size=60)]
        per_client = [requests[:30], requests[30:]]
        results = asyncio.run(run_clients(server.address, per_client))
        assert check_against_reference(config, per_client, results) <= TOLERANCE
        with server.client() as client:
            stats = wait_idle(client)
        assert set(stats["batch_sizes"]) == {"lstm/layer0", "lstm/layer1", "lstm/layer2"}
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values())
    finally:
        stop_server(server)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_server_stops_cleanly_on_signal(tmp_path: Path, signum: int):
    config = write_config(tmp_path, SMALL_LSTM)
    command = [sys.executable, "-m", "batchmaker.manager.commands.cli", "serve", str(config.path), "--workers", "2"]
    process = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 60
        with Client(config.server.address, timeout=1) as client:
            while True:
                try:
                    if client.health()["status"] == "ready":
                        break
                except TimeoutError:
                    pass
                assert time.monotonic() < deadline, "server did not become ready"
            reply = client.infer("lstm", {"tokens": [1, 2, 3]})
            assert reply.outputs["h"].shape == (64,)
        tree = psutil.Process(process.pid).children(recursive=True)
        assert len(tree) >= 3  # manager + 2 workers
        process.send_signal(signum)
        assert process.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive
    finally:
        if process.poll() is None:
            process.kill()


def test_children_exit_when_the_supervisor_is_killed(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    process = subprocess.Popen([sys.executable, "-m", "batchmaker.manager.commands.cli", "serve", str(config.path)])
    try:
        deadline = time.monotonic() + 60
        while len(psutil.Process(process.pid).children()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tree = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        _, alive = psutil.wait_procs(tree, timeout=15)
        assert not alive
    finally:
        if process.poll() is None:
            process.kill()
