"""A server that stops loses no request: real `batchmaker serve` processes whose supervisor is killed
with SIGKILL (as `kill -9` of its process group does: the manager and workers have groups of their own).

The orphaned manager drains like on SIGTERM, its workers serving it meanwhile; what it cannot finish
(the drain runs out, or its worker is lost meanwhile) is answered UNAVAILABLE, which clients with
several addresses send elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import with_faults, write_config
from test_several_servers import TINY_LSTM, Progress, check_results, owes_answers, run_load, three_servers

from batchmaker.clients import AsyncClient, ServerError
from batchmaker.common.config import Config
from batchmaker.common.protocol import UNAVAILABLE
from batchmaker.manager.commands.launcher import ServerProcess, roles

__all__ = ["three_servers"]  # the fixture, shared with the tests of several servers

LONG_LSTM = TINY_LSTM.replace("max_length = 40", "max_length = 400").replace("hidden_size = 8", "hidden_size = 128")


def kill_supervisor(server: ServerProcess) -> list[psutil.Process]:
    """SIGKILL the supervisor alone; return its children, which outlive it for their drain."""
    children = [process for process in server.processes() if process.pid != server.process.pid]
    server.process.send_signal(signal.SIGKILL)
    assert server.process.wait(10) == -signal.SIGKILL
    return children


def test_killing_a_supervisor_under_load_loses_nothing(three_servers: tuple[Config, list[ServerProcess]]) -> None:
    config, servers = three_servers
    victim = servers[0]
    children: list[psutil.Process] = []

    async def faults(client: AsyncClient, progress: Progress, count: int) -> None:
        await progress.reach(count // 3)
        await owes_answers(client, victim)
        children.extend(kill_supervisor(victim))

    rng = np.random.default_rng(2)
    requests = [rng.integers(0, 100, size=int(rng.integers(1, 40))).tolist() for _ in range(600)]
    results, _ = asyncio.run(run_load(servers, requests, 150.0, faults))
    check_results(config, requests, results)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive  # the orphaned manager drained and stopped its workers


async def burst_then_kill(server: ServerProcess, count: int, stall_worker: bool) -> tuple[list, int]:
    """Send `count` long requests at once; kill the supervisor once the server has received them all (and,
    with `stall_worker`, its worker's stream has stopped). Returns the outcomes and how many were unanswered
    at the kill."""
    rng = np.random.default_rng(3)
    async with AsyncClient(server.address, timeout=120) as client:
        calls = [
            asyncio.create_task(client.infer("lstm", {"tokens": rng.integers(0, 100, size=400).tolist()}))
            for _ in range(count)
        ]
        # Every request received (not all in flight at once: a fast server answers the first before the last arrives).
        while (await client.stats())["requests"].get("received", 0) < count:
            await asyncio.sleep(0.01)
        if stall_worker:
            worker = next(pid for pid, role in roles(server.process).items() if role == "worker")
            os.kill(worker, signal.SIGUSR1)
        unanswered = sum(not call.done() for call in calls)
        kill_supervisor(server)
        return await asyncio.gather(*calls, return_exceptions=True), unanswered


@pytest.fixture
def one_server(tmp_path: Path, request: pytest.FixtureRequest):
    """One server, whose worker SIGUSR1 hangs; `request.param`: its drain_timeout_ms."""
    server = f"drain_timeout_ms = {request.param}\nhang_timeout_ms = 60000"
    config = write_config(tmp_path, with_faults(tmp_path, LONG_LSTM), server=server)
    server = ServerProcess(config.path, "127.0.0.1", log=None)
    try:
        server.wait_ready()
        processes = server.processes()
        yield server
    finally:
        server.stop()
        for process in processes:  # a stalled worker outlives its killed supervisor: no one else stops it
            if process.is_running():
                process.kill()


def outcomes(results: list) -> Counter[str]:
    return Counter(result.code if isinstance(result, ServerError) else type(result).__name__ for result in results)


@pytest.mark.parametrize("one_server", [60_000], indirect=True)
def test_an_orphaned_manager_answers_what_it_holds(one_server: ServerProcess) -> None:
    results, unanswered = asyncio.run(burst_then_kill(one_server, 200, stall_worker=False))
    codes = outcomes(results)
    assert unanswered > 0 and set(codes) <= {"Reply", UNAVAILABLE}, codes  # finished, or sent elsewhere; none lost


@pytest.mark.parametrize("one_server", [1_500], indirect=True)
def test_an_orphaned_manager_that_cannot_finish_answers_unavailable(one_server: ServerProcess) -> None:
    results, _ = asyncio.run(burst_then_kill(one_server, 50, stall_worker=True))
    codes = outcomes(results)
    assert set(codes) <= {"Reply", UNAVAILABLE} and codes[UNAVAILABLE] > 0, codes  # never INTERNAL, none lost
    assert all(UNAVAILABLE in str(result) for result in results if isinstance(result, ServerError))
