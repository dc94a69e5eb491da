"""Several real servers on distinct loopback addresses, standing for several hosts, behind one client.

Under open-loop load one whole server (supervisor, manager, workers) is killed with
SIGKILL and another is sent SIGTERM (it drains); every request must still be
answered once, correctly.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from conftest import write_config

from batchmaker.clients import AsyncClient
from batchmaker.common.config import Config
from batchmaker.common.models import build_model
from batchmaker.manager.commands.launcher import ServerProcess

TINY_LSTM = """
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
vocab_size = 100
embedding_size = 8
hidden_size = 8
num_layers = 1
max_length = 40
batch_sizes = [1, 2, 4, 8, 16, 32]
"""
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
TOLERANCE = 1e-5


@pytest.fixture
def three_servers(tmp_path: Path) -> Iterator[tuple[Config, list[ServerProcess]]]:
    config = write_config(tmp_path, TINY_LSTM)
    servers = [ServerProcess(config.path, host, log=None) for host in HOSTS]  # logs go to pytest's captured output
    try:
        for server in servers:
            server.wait_ready()
        yield config, servers
    finally:
        for server in servers:
            server.stop()


class Progress:
    """Counts answers and wakes whoever waits for a given count."""

    def __init__(self) -> None:
        self.answered = 0
        self._waiters: list[tuple[int, asyncio.Event]] = []

    def add(self) -> None:
        self.answered += 1
        for count, event in self._waiters:
            if self.answered >= count:
                event.set()

    async def reach(self, count: int) -> None:
        event = asyncio.Event()
        self._waiters.append((count, event))
        if self.answered >= count:
            event.set()
        await event.wait()


Faults = Callable[[AsyncClient, Progress, int], Awaitable[None]]  # (client, progress, requests) -> when done


async def kill_one_drain_another(
    servers: list[ServerProcess], client: AsyncClient, progress: Progress, count: int
) -> None:
    killed, drained, _ = servers
    await progress.reach(count // 4)
    await stopped_owing(client, killed)
    killed.kill_all()
    await progress.reach(count // 2)
    drained.process.send_signal(signal.SIGTERM)


async def owes_answers(client: AsyncClient, server: ServerProcess) -> None:
    while client.outstanding()[server.address] == 0:  # fault it while it owes answers
        await asyncio.sleep(0.001)


async def stopped_owing(client: AsyncClient, server: ServerProcess) -> None:
    """Return with the server's processes stopped while the client waits for answers from it: stopped as soon as
    it owes some, and let go again if the replies it had sent by then settle all it owed."""
    while True:
        await owes_answers(client, server)
        processes = server.processes()
        for process in processes:
            process.suspend()
        await asyncio.sleep(0.05)  # replies already on their way arrive
        if client.outstanding()[server.address] > 0:
            return
        for process in processes:
            process.resume()


async def run_load(
    servers: list[ServerProcess], requests: list[list[int]], rate: float, faults: Faults
) -> tuple[list, AsyncClient]:
    progress = Progress()
    rng = np.random.default_rng(1)
    client = AsyncClient([s.address for s in servers], timeout=60, health_interval=0.2, health_timeout=0.5)

    async def one(tokens: list[int]):
        try:
            return await client.infer("lstm", {"tokens": tokens})
        finally:
            progress.add()

    async with client:
        fault_task = asyncio.create_task(faults(client, progress, len(requests)))
        calls = []
        for tokens in requests:
            calls.append(asyncio.create_task(one(tokens)))
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        results = await asyncio.gather(*calls, return_exceptions=True)
        await fault_task
    return results, client


def test_kill_and_drain_under_load_lose_nothing(three_servers: tuple[Config, list[ServerProcess]]) -> None:
    config, servers = three_servers
    rng = np.random.default_rng(0)
    requests = [rng.integers(0, 100, size=int(rng.integers(1, 40))).tolist() for _ in range(600)]
    results, client = asyncio.run(run_load(servers, requests, 150.0, partial(kill_one_drain_another, servers)))
    check_results(config, requests, results)
    assert client.resent > 0  # the killed server owed answers when it died
    assert servers[0].process.returncode == -signal.SIGKILL
    assert servers[1].process.wait(60) == 0  # the drained server finished what it accepted and stopped cleanly
    assert servers[2].process.poll() is None


def check_results(config: Config, requests: list[list[int]], results: list) -> None:
    """Every request answered ok, with the reference's outputs."""
    model = build_model(config.models["lstm"])
    state = model.load_weights()
    for tokens, result in zip(requests, results, strict=True):
        assert not isinstance(result, BaseException), repr(result)
        expected = model.reference(state, {"tokens": tokens})
        for name in ("h", "c"):
            assert np.abs(result.outputs[name] - expected[name]).max() <= TOLERANCE
