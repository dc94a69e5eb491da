"""Workers on two hosts: the server's own CPU workers, and a worker started by hand as another
host (its own --host-id, over TCP), which the manager cannot read shared memory of. Real
processes and sockets throughout; answers are checked against each model's unbatched reference."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    SMALL_LSTM,
    RunningServer,
    free_port,
    start_server,
    start_worker,
    stop_server,
    wait_idle,
    wait_until,
    with_faults,
    write_config,
)
from test_integration_trees import CHILDSUM_VOCAB, SST
from test_integration_trees import MODELS as TREE_MODELS

from batchmaker.bench.trees import random_tree
from batchmaker.clients import AsyncClient
from batchmaker.common.config import Config
from batchmaker.common.models import build_model
from batchmaker.common.models.sst import load_vocabulary, ptb_to_tree
from batchmaker.worker.step_watchdog import EXIT_HUNG

TOLERANCE = 1e-5
OTHER_HOST = "second-host"
MODES = ("manager", "worker")  # who decides each step: the manager, or each worker's running batch (`running_batch`)

MODELS = SMALL_LSTM + TREE_MODELS  # lstm, and the binary (sst) and Child-Sum (childsum) TreeLSTMs

Sent = tuple[str, dict[str, Any], Any]  # model, inputs, reply (or the exception raised instead)


def request_mix(seed: int) -> list[tuple[str, dict[str, Any]]]:
    """LSTM sequences, SST trees and random Child-Sum trees, interleaved at random."""
    rng = np.random.default_rng(seed)
    vocabulary = load_vocabulary(SST / "vocab.txt")
    lines = (SST / "dev.txt").read_text(encoding="utf-8").splitlines()
    requests: list[tuple[str, dict[str, Any]]] = []
    for line in rng.choice(lines, size=150, replace=False):
        tokens, parents, _ = ptb_to_tree(line, vocabulary)
        requests.append(("sst", {"tree": {"tokens": tokens, "parents": parents}}))
    for size in rng.integers(1, 60, size=50):
        requests.append(("childsum", {"tree": random_tree(rng, int(size), CHILDSUM_VOCAB)}))
    for length in rng.integers(1, 120, size=200):
        # clear of faulty_lstm's cues
        requests.append(("lstm", {"tokens": rng.integers(0, 600, size=int(length)).tolist()}))
    return [requests[i] for i in rng.permutation(len(requests))]


async def send(
    address: str, requests: list[tuple[str, dict[str, Any]]], seed: int, stop: threading.Event
) -> list[Sent]:
    """One client sending `requests` in turn (cycling) with random gaps, many in flight, until `stop` is set
    after a full round."""
    rng = np.random.default_rng(seed)
    async with AsyncClient(address, timeout=120) as client:
        pending = []
        while not pending or not stop.is_set():
            for model, inputs in requests:
                pending.append((model, inputs, asyncio.create_task(client.infer(model, inputs))))
                await asyncio.sleep(float(rng.exponential(0.02)))
        replies = await asyncio.gather(*(task for _, _, task in pending), return_exceptions=True)
    return [(model, inputs, reply) for (model, inputs, _), reply in zip(pending, replies)]


def run_load(address: str, stop: threading.Event, clients: int = 3) -> tuple[threading.Thread, list[Sent]]:
    """Concurrent clients in a thread until `stop` is set; the list fills with what they sent once they are done."""
    sent: list[Sent] = []

    async def load() -> None:
        mix = request_mix(0)
        parts = await asyncio.gather(*(send(address, mix[k::clients], k, stop) for k in range(clients)))
        sent.extend(item for part in parts for item in part)

    thread = threading.Thread(target=lambda: asyncio.run(load()))
    thread.start()
    return thread, sent


def check_answers(config: Config, sent: list[Sent]) -> None:
    failed = [reply for _, _, reply in sent if isinstance(reply, BaseException)]
    assert not failed, f"{len(failed)} of {len(sent)} requests failed, e.g. {failed[:3]}"
    models = {name: build_model(model) for name, model in config.models.items()}
    states = {name: model.load_weights() for name, model in models.items()}
    for model, inputs, reply in sent:
        expected = models[model].reference(states[model], inputs)
        assert reply.outputs.keys() == expected.keys()
        for key, value in expected.items():
            assert np.abs(reply.outputs[key] - value).max() <= TOLERANCE, (model, key)


def workers_by_host(server: RunningServer) -> dict[bool, list[dict[str, Any]]]:
    with server.client(timeout=10) as client:
        workers = client.health()["workers"]
    return {local: [w for w in workers if w["local"] is local] for local in (True, False)}


class TwoHosts:
    """A server with `local` CPU workers of its own, and one worker started as another host."""

    def __init__(self, tmp_path: Path, local: int, server: str = "", faults: bool = False, running_batch: str = "auto"):
        """`faults`: the LSTM is tests/faulty_lstm.py's, so SIGUSR1 hangs a worker."""
        self.running_batch = running_batch
        self.worker_address = f"tcp://127.0.0.2:{free_port()}"
        models = with_faults(tmp_path, MODELS) if faults else MODELS
        self.config = write_config(
            tmp_path, models, server=f'worker_address = "{self.worker_address}"\n' + server,
            scheduler=f'running_batch = "{running_batch}"',
        )  # fmt: skip
        self.server = start_server(self.config, workers=local)
        self.log = tmp_path / "remote.log"
        with self.log.open("w") as log:
            self.remote = start_worker(
                self.config, self.worker_address, "--host-id", OTHER_HOST, "--index", "9",
                stderr=log,
            )  # fmt: skip
        wait_until(
            lambda: workers_by_host(self.server)[False], "the worker of the other host registering", interval=0.1
        )

    def close(self) -> None:
        try:
            stop_server(self.server)
        finally:
            if self.remote.poll() is None:
                self.remote.kill()
            self.remote.wait(timeout=15)


@pytest.fixture
def two_hosts(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TwoHosts]:
    hosts = TwoHosts(tmp_path, **getattr(request, "param", {"local": 2}))
    yield hosts
    hosts.close()


def serve_under_load(two_hosts: TwoHosts, meanwhile: Callable[[], None]) -> dict[str, Any]:
    """Concurrent clients load the server while `meanwhile` runs, then finish their round; every request
    is answered correctly and, once the server is idle, no arena row is held. Returns the stats then."""
    stop = threading.Event()
    thread, sent = run_load(two_hosts.server.address, stop)
    try:
        meanwhile()
    finally:
        stop.set()
        thread.join()
    check_answers(two_hosts.config, sent)
    with two_hosts.server.client() as client:
        stats = wait_idle(client)
    assert stats["requests"]["ok"] == len(sent)
    assert all(w["slots_in_use"] == 0 for w in stats["workers"].values()), stats["workers"]
    return stats


def remote_stat(two_hosts: TwoHosts, key: str) -> Callable[[], Any]:
    """A predicate for wait_until: the other host's worker's `key` in the stats."""

    def stat() -> Any:
        with two_hosts.server.client(timeout=10) as client:
            workers = client.stats()["workers"].values()
        return next((w[key] for w in workers if w["pid"] == two_hosts.remote.pid), None)

    return stat


def remote_work(two_hosts: TwoHosts) -> int:
    """What the other host's worker holds: tasks in flight (the manager's steps) and requests routed to it whole
    (its running batch)."""
    with two_hosts.server.client(timeout=10) as client:
        stats = client.stats()
    worker_id, worker = next((i, w) for i, w in stats["workers"].items() if w["pid"] == two_hosts.remote.pid)
    return worker["tasks_in_flight"] + stats["routed"]["by_worker"].get(worker_id, 0)


# Reading values across hosts is the manager's own: its tasks move requests between workers, peers read each
# other's arenas, and the other host's results travel in task notices (a worker's running batch does none of it).
@pytest.mark.parametrize("two_hosts", [{"local": 2, "running_batch": "manager"}], indirect=True, ids=["manager"])
def test_workers_on_two_hosts_answer_correctly_without_reading_across_hosts(two_hosts: TwoHosts):
    """Two workers on the server's host and one on another, under concurrent LSTM and TreeLSTM load:
    every answer equals the reference; results of the other host's worker reach the manager in its
    notices (the local workers' in shared memory); values are read between the local workers'
    arenas when requests move, and never between hosts."""
    stats = serve_under_load(
        two_hosts, lambda: wait_until(remote_stat(two_hosts, "rows_in_notices"), "results from the other host", 60, 0.1)
    )
    workers = stats["workers"]
    hosts = {worker_id: w["host"] for worker_id, w in workers.items()}
    assert hosts[next(i for i, w in workers.items() if w["pid"] == two_hosts.remote.pid)] == OTHER_HOST
    assert {w["host"] for w in workers.values() if w["local"]} == {stats["host"]}
    for worker_id, worker in workers.items():
        assert worker["tasks_completed"] > 0
        assert (worker["rows_in_notices"] > 0) is (not worker["local"]), worker
        assert worker["unreadable_peers"] == {}, worker  # each reported having opened its neighbours' arenas
        for peer in worker["rows_read_from_peers"]:
            assert hosts[peer] == hosts[worker_id], f"worker {worker_id} read the arena of {peer}, on another host"
    assert sum(sum(w["rows_read_from_peers"].values()) for w in workers.values() if w["local"]) > 0


def lose_the_other_host_under_load(two_hosts: TwoHosts, lose: Callable[[], None]) -> None:
    """Under load, once the other host's worker holds work, `lose` it; the manager writes it off,
    replays its requests on the server's own worker, and every request is answered correctly."""

    def meanwhile() -> None:
        wait_until(lambda: remote_work(two_hosts), "work in flight on the other host", interval=0.1)
        lose()
        wait_until(lambda: not workers_by_host(two_hosts.server)[False], "the worker written off", interval=0.1)

    stats = serve_under_load(two_hosts, meanwhile)
    assert stats["worker_losses"] == 1 and stats["replayed_requests"] >= 1


@pytest.mark.parametrize(
    "two_hosts",
    [{"local": 1, "server": "heartbeat_timeout_ms = 1000", "running_batch": mode} for mode in MODES],
    indirect=True,
    ids=MODES,
)
def test_killing_the_other_hosts_worker_under_load_loses_nothing(two_hosts: TwoHosts):
    """SIGKILL: the manager notices the silence."""
    lose_the_other_host_under_load(two_hosts, lambda: two_hosts.remote.send_signal(signal.SIGKILL))


# With the running batch in the worker, its cells run on the thread that reads the manager's messages: hung, it
# never reads the stop (nor sees the manager fall silent), and lives on once written off.
@pytest.mark.parametrize(
    "two_hosts",
    [
        pytest.param({"local": 1, "server": "hang_timeout_ms = 1500", "faults": True, "running_batch": mode}, id=mode)
        for mode in MODES
    ],
    indirect=True,
)
def test_a_hung_worker_of_the_other_host_is_told_to_stop(two_hosts: TwoHosts):
    """Its stream (or its running batch) stops advancing while its heartbeats go on. Its pid means nothing on the
    manager's host, so the manager does not kill it: it tells it to stop, and the worker exits on its own; a worker
    whose running batch is stuck in a step cannot read that, and ends itself once the step outlasts the timeout."""
    lose_the_other_host_under_load(two_hosts, lambda: two_hosts.remote.send_signal(signal.SIGUSR1))
    if two_hosts.running_batch == "manager":
        assert two_hosts.remote.wait(timeout=60) == 0
        assert "the manager told this worker to stop" in two_hosts.log.read_text()
    else:
        assert two_hosts.remote.wait(timeout=60) == EXIT_HUNG
        assert "a step of the running batch has not returned for" in two_hosts.log.read_text()
