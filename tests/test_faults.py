"""Worker failures under load: killed, hung, added by hand; and a draining stop. Real processes throughout."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import faulty_lstm
import numpy as np
import psutil
import pytest
from conftest import (
    SMALL_LSTM,
    start_server,
    start_worker,
    stop_server,
    wait_idle,
    wait_until,
    wait_until_async,
    with_faults,
    write_config,
)

from batchmaker.clients import AsyncClient, Client, ServerError
from batchmaker.common.models import build_model

TOLERANCE = 1e-5


async def open_loop(
    address: str, rate: float, duration: float, seed: int, stop: threading.Event | None = None
) -> list[tuple[list[int], object]]:
    """Poisson arrivals of random sequences for `duration` s (or until `stop` is set);
    returns (tokens, reply or exception) per request."""
    rng = np.random.default_rng(seed)
    async with AsyncClient(address, timeout=120) as client:
        sent = []
        start = time.monotonic()
        while time.monotonic() - start < duration and not (stop and stop.is_set()):
            tokens = rng.integers(0, 600, size=int(rng.integers(1, 60))).tolist()  # clear of faulty_lstm's cues
            sent.append((tokens, asyncio.create_task(client.infer("lstm", {"tokens": tokens}))))
            await asyncio.sleep(float(rng.exponential(1 / rate)))
        replies = await asyncio.gather(*(task for _, task in sent), return_exceptions=True)
    return [(tokens, reply) for (tokens, _), reply in zip(sent, replies)]


def check_replies(config, results) -> None:
    errors = [reply for _, reply in results if isinstance(reply, BaseException)]
    assert not errors, f"{len(errors)} requests failed, e.g. {errors[:3]}"
    model = build_model(config.models["lstm"])
    state = model.load_weights()
    for tokens, reply in results:
        expected = model.reference(state, {"tokens": tokens})
        assert np.abs(reply.outputs["h"] - expected["h"]).max() <= TOLERANCE


def kernel_time(server) -> dict[int, float]:
    """The time each worker (by pid) has spent in its cells, as it reports it: with its tasks' notices (the
    manager's steps) or its answers (the worker's running batch), and its heartbeats. It grows only as a worker
    serves."""
    with server.client(timeout=5) as client:
        return {w["pid"]: w["kernel_busy_s"] for w in client.stats()["workers"].values()}


def answered(server) -> int:
    with server.client(timeout=5) as client:
        return client.stats()["requests"].get("ok", 0)


def healthy_workers(server) -> int:
    with server.client(timeout=5) as client:
        return len(client.health()["workers"])


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_killing_workers_under_load_loses_nothing(tmp_path: Path, running_batch: str):
    config = write_config(tmp_path, SMALL_LSTM, scheduler=f'running_batch = "{running_batch}"')
    server = start_server(config, workers=3)
    try:
        killed: list[int] = []
        stop = threading.Event()

        def killer() -> None:
            """Twice, at a random moment, SIGKILL a worker the manager has registered; then the load ends."""
            rng = np.random.default_rng(1)
            try:
                for _ in range(2):
                    time.sleep(float(rng.uniform(1.0, 2.5)))
                    with server.client(timeout=10) as client:
                        pids = [w["pid"] for w in client.health()["workers"] if w["pid"] not in killed]
                    victim = pids[int(rng.integers(0, len(pids)))]
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)
            finally:
                stop.set()

        thread = threading.Thread(target=killer)
        thread.start()
        results = asyncio.run(open_loop(server.address, rate=120, duration=60.0, seed=2, stop=stop))
        thread.join()
        assert len(killed) == 2

        check_replies(config, results)  # every request answered, correctly, none WORKER_LOST
        wait_until(lambda: healthy_workers(server) == 3, "the killed workers coming back")
        with server.client() as client:
            stats = wait_idle(client)
        assert stats["worker_losses"] == 2
        assert stats["requests"]["ok"] == len(results)
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values()), stats["workers"]
    finally:
        stop_server(server)


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_hung_worker_is_killed_replaced_and_its_requests_replayed(tmp_path: Path, running_batch: str):
    config = write_config(
        tmp_path, with_faults(tmp_path, SMALL_LSTM), server="hang_timeout_ms = 1500",
        scheduler=f'running_batch = "{running_batch}"',
    )  # fmt: skip
    server = start_server(config, workers=2)
    try:
        hung = server.supervisor.slots[0].process
        stop = threading.Event()

        def stall_soon() -> None:
            """Stall the worker under load; the load ends once the manager has killed it."""
            try:
                time.sleep(1.0)
                os.kill(hung.pid, signal.SIGUSR1)  # its cells stop returning; its heartbeats go on
                wait_until(lambda: not psutil.pid_exists(hung.pid) or psutil.Process(hung.pid).status() == "zombie",
                           "the hung worker being killed")
            finally:
                stop.set()

        thread = threading.Thread(target=stall_soon)
        thread.start()
        results = asyncio.run(open_loop(server.address, rate=100, duration=60.0, seed=3, stop=stop))
        thread.join()

        check_replies(config, results)
        wait_until(lambda: not psutil.pid_exists(hung.pid) or psutil.Process(hung.pid).status() == "zombie",
                   "the hung worker being killed")
        wait_until(lambda: healthy_workers(server) == 2, "the hung worker's replacement registering")
        with server.client() as client:
            stats = wait_idle(client)
        assert stats["worker_losses"] >= 1 and stats["replayed_requests"] >= 1
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values())
    finally:
        stop_server(server)


def test_a_request_that_keeps_killing_workers_fails_after_max_replays(tmp_path: Path):
    """A request replayed `max_replays` times that loses its worker again fails with INTERNAL, and
    the server goes on serving once its workers are back."""
    config = write_config(tmp_path, with_faults(tmp_path, SMALL_LSTM), server="max_replays = 1")
    server = start_server(config, workers=2)
    try:
        with server.client(timeout=60) as client, pytest.raises(ServerError) as failed:
            client.infer("lstm", {"tokens": [1, faulty_lstm.CRASH_TOKEN, 2]})
        assert failed.value.code == "INTERNAL" and "lost its worker 2 times" in failed.value.message
        wait_until(lambda: healthy_workers(server) == 2, "both workers back")
        sequences = [list(range(i, i + 9)) for i in range(0, 600, 30)]

        async def send() -> list:
            async with AsyncClient(server.address, timeout=60) as client:
                replies = [client.infer("lstm", {"tokens": tokens}) for tokens in sequences]
                return await asyncio.gather(*replies, return_exceptions=True)

        check_replies(config, list(zip(sequences, asyncio.run(send()))))
        with server.client() as client:
            stats = wait_idle(client)
        assert stats["worker_losses"] == 2 and stats["replayed_requests"] >= 1
    finally:
        stop_server(server)


def test_a_long_loop_turn_does_not_write_off_a_worker_whose_heartbeats_wait_unread(tmp_path: Path):
    """A loop turn far longer than the heartbeat timeout (planning a very long request makes one; here
    faulty_lstm's planner makes one of 2 s, whatever the machine's load) leaves the worker's heartbeats
    waiting in the socket. Silence is judged only after reading them."""
    config = write_config(tmp_path, with_faults(tmp_path, SMALL_LSTM), server="heartbeat_timeout_ms = 500")
    server = start_server(config, workers=1)
    try:
        with server.client(timeout=120) as client:
            # The turn that plans it goes on to watch the workers: by its answer, the watch has judged them.
            assert client.infer("lstm", {"tokens": [1, faulty_lstm.SLOW_PLAN_TOKEN, 2]}).outputs["h"].shape == (64,)
            stats = client.stats()
            assert stats["worker_losses"] == 0 and list(stats["workers"]) == ["0"]
            assert client.infer("lstm", {"tokens": [1, 2, 3]}).outputs["h"].shape == (64,)
    finally:
        stop_server(server)


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_worker_started_by_hand_joins_and_gets_work(tmp_path: Path, running_batch: str):
    address = f"ipc://{tmp_path}/workers"
    config = write_config(
        tmp_path, SMALL_LSTM, server=f'worker_address = "{address}"', scheduler=f'running_batch = "{running_batch}"'
    )
    server = start_server(config, workers=1)
    joined = None
    try:
        outcome: dict = {}
        stop = threading.Event()

        def load() -> None:
            outcome["results"] = asyncio.run(open_loop(server.address, rate=150, duration=120.0, seed=4, stop=stop))

        thread = threading.Thread(target=load)
        thread.start()
        wait_until(lambda: answered(server), "the load starting")
        joined = start_worker(config, address, "--index", "1")
        wait_until(lambda: healthy_workers(server) == 2, "the new worker registering")
        registered = kernel_time(server)[joined.pid]  # its warm-up's
        # The load goes on until the new worker has run cells of its own.
        wait_until(lambda: kernel_time(server)[joined.pid] > registered, "the new worker getting work under load")
        stop.set()
        thread.join()
        assert outcome["results"]
        check_replies(config, outcome["results"])
    finally:
        stop_server(server)
        if joined is not None:
            assert joined.wait(timeout=15) == 0  # told to stop by the manager as it shut down


def test_sigterm_under_load_answers_everything_then_exits(tmp_path: Path):
    # Heartbeats and progress may stop for a minute: the workers are paused while the drain is watched.
    config = write_config(tmp_path, SMALL_LSTM, server="heartbeat_timeout_ms = 60000\nhang_timeout_ms = 60000")
    command = [sys.executable, "-m", "batchmaker.manager.commands.cli", "serve", str(config.path), "--workers", "2"]
    process = subprocess.Popen(command)
    try:
        with Client(config.server.address, timeout=1) as client:
            wait_until(lambda: _ready(client), "the server becoming ready")
            workers = [psutil.Process(w["pid"]) for w in client.health()["workers"]]
        tree = psutil.Process(process.pid).children(recursive=True)

        async def load_then_terminate():
            async with AsyncClient(config.server.address, timeout=60) as client:
                rng = np.random.default_rng(5)
                for worker in workers:  # the load stays in flight until the late request has had its answer
                    worker.suspend()
                accepted = [
                    asyncio.create_task(client.infer("lstm", {"tokens": rng.integers(0, 1000, size=200).tolist()}))
                    for _ in range(300)
                ]
                await wait_until_async(lambda: _all_read(client, len(accepted)), "the manager reading the whole load")
                process.send_signal(signal.SIGTERM)
                await wait_until_async(lambda: _draining(client), "the manager draining")
                late = await asyncio.gather(client.infer("lstm", {"tokens": [1, 2]}), return_exceptions=True)
                for worker in workers:
                    worker.resume()
                return await asyncio.gather(*accepted, return_exceptions=True), late[0]

        replies, late = asyncio.run(load_then_terminate())
        # Requests the manager had accepted are answered; any it had not yet read are refused, never dropped.
        answered = [r for r in replies if not isinstance(r, BaseException)]
        refused = [r for r in replies if isinstance(r, ServerError) and r.code == "OVERLOADED"]
        assert answered and len(answered) + len(refused) == len(replies), [r for r in replies if r not in answered][:3]
        assert isinstance(late, ServerError) and late.code == "OVERLOADED" and "draining" in late.message
        assert process.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive
    finally:
        if process.poll() is None:
            process.kill()


async def _all_read(client: AsyncClient, count: int) -> bool:
    """Whether the manager has read `count` requests (answered or in flight): none left for the client to send."""
    stats = await client.stats()
    return stats["requests_in_flight"] + sum(stats["requests"].values()) >= count


async def _draining(client: AsyncClient) -> bool:
    return (await client.health())["status"] == "draining"


def _ready(client: Client) -> bool:
    try:
        return client.health()["status"] == "ready"
    except TimeoutError:
        return False


@pytest.mark.cuda
def test_cuda_arenas_open_in_a_peer_process():
    import torch

    if torch.cuda.device_count() < 1:
        pytest.skip("no CUDA device")
    from batchmaker.worker.cuda_runtime import CudaRuntime

    arena = torch.arange(12, dtype=torch.float32, device="cuda:0").reshape(4, 3)
    handle = CudaRuntime().export(arena)
    script = (
        "import sys, torch, msgpack; from worker.cuda_runtime import CudaRuntime;"
        "h = msgpack.unpackb(sys.stdin.buffer.read());"
        "t = CudaRuntime().open(h, 0, torch.float32, (4, 3)); print(float(t[2].sum()))"
    )
    import msgpack

    out = subprocess.run(
        [sys.executable, "-c", script],
        input=msgpack.packb(handle),
        capture_output=True,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    assert float(out.stdout) == float(arena[2].sum())
