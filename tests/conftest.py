"""Shared fixtures: small configs with generated weights, and a real server (supervisor, manager, workers)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchmaker.clients import Client
from batchmaker.common.config import Config, load_config
from batchmaker.common.models import init_missing_weights
from batchmaker.manager.commands.supervisor import Supervisor

SHARED_DATA = ROOT.parent / "shared" / "data"
# The front door's tests call gRPC and start servers (fork, then exec) from one process: grpc's fork handlers
# would restart its poller in each child before the exec, where closing the inherited descriptors aborts it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(directory: Path, models: str, server: str = "", scheduler: str = "") -> Config:
    """A config in `directory` with the given TOML bodies, a free loopback port, and weights created.

    Refusal by expected wait is off unless `server` sets it: tests send bursts to check other
    behaviour, and tests/test_admission.py checks the estimate on its own."""
    port = free_port()
    if "max_queue_delay_ms" not in server:
        server = "max_queue_delay_ms = 0\n" + textwrap.dedent(server)  # before any [server.*] table it may open
    text = textwrap.dedent(
        f"""
        [server]
        address = "tcp://127.0.0.1:{port}"
        arena_rows = 4096
        io_rows = 4096
        {textwrap.dedent(server)}

        [scheduler]
        {textwrap.dedent(scheduler)}
        """
    ) + textwrap.dedent(models)
    path = directory / "config.toml"
    path.write_text(text)
    config = load_config(path)
    init_missing_weights(config)
    return config


SMALL_LSTM = """
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
vocab_size = 1000
embedding_size = 32
hidden_size = 64
num_layers = 1
max_length = 200
batch_sizes = [1, 2, 4, 8, 16, 32]
"""


def with_faults(directory: Path, models: str) -> str:
    """`models` with its LSTM served by tests/faulty_lstm.py (copied to `directory`, the config's folder),
    which crashes, hangs and stalls on cue."""
    shutil.copy(ROOT / "tests" / "faulty_lstm.py", directory)
    builder = 'builder = "batchmaker.common.models.lstm:build"'
    assert builder in models
    return models.replace(builder, 'builder = "faulty_lstm:build"')


class RunningServer:
    """A server started in-process: the supervisor's watch loop (restarts) runs in a thread."""

    def __init__(self, supervisor: Supervisor, config: Config):
        self.supervisor = supervisor
        self.config = config
        self.address = supervisor.address
        self.watcher = threading.Thread(target=supervisor.watch, daemon=True)
        self.watcher.start()

    def client(self, timeout: float = 30.0) -> Client:
        return Client(self.address, timeout=timeout)

    def pids(self) -> list[int]:
        return [child.pid for child in self.supervisor.children]


def start_server(config: Config, workers: int | None = None) -> RunningServer:
    supervisor = Supervisor(config, workers=workers)
    supervisor.start()
    if not supervisor.wait_ready(timeout=120):
        supervisor.stop()
        raise RuntimeError("test server did not become ready")
    return RunningServer(supervisor, config)


def stop_server(server: RunningServer) -> None:
    pids = server.pids()
    server.supervisor.request_stop()
    server.watcher.join(timeout=5)
    server.supervisor.stop()
    leftovers = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not leftovers, f"processes left after stop: {leftovers}"


def start_worker(config: Config, manager: str, *options: str, **popen: Any) -> subprocess.Popen:
    """`batchmaker worker` started by hand, as on another machine; `options` go to the command."""
    command = [
        sys.executable,
        "-m",
        "batchmaker.manager.commands.cli",
        "worker",
        "--config",
        str(config.path),
        "--manager",
        manager,
    ]
    return subprocess.Popen([*command, *options], cwd=ROOT, **popen)


def wait_idle(client: Client, timeout: float = 60.0) -> dict:
    """Stats once no request is in flight (completion notices may trail the last reply); fails if that never comes."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats["requests_in_flight"] == 0 and all(w["tasks_in_flight"] == 0 for w in stats["workers"].values()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the server was still busy after {timeout} s: {stats}")
        time.sleep(0.05)


class CountingList(list):
    """A list that counts the entries read from it: how much work a check did, without a clock."""

    read = 0

    def __iter__(self):
        for entry in super().__iter__():
            self.read += 1
            yield entry

    def __contains__(self, value: object) -> bool:
        return any(entry == value for entry in self)

    def __getitem__(self, index):
        self.read += 1
        return super().__getitem__(index)


def stop_in_thread(manager: Any, loop: threading.Thread, workers: list[subprocess.Popen]) -> None:
    """Stop a manager whose event loop runs in `loop`, a thread of this process, and its worker processes: the
    second stop ends the drain at once."""
    manager.stop()
    manager.stop()
    loop.join(timeout=30)
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
        worker.wait(timeout=30)
    assert not loop.is_alive()


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 60.0, interval: float = 0.01) -> Any:
    """The first truthy value of `predicate()`; fails naming `what` if none comes within the (generous) timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], Awaitable[Any]], what: str, timeout: float = 60.0) -> Any:
    """wait_until for an event loop: awaits `predicate()` until it gives a truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def lstm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One served SMALL_LSTM (one worker) for a module's tests, started once: they must not change it."""
    server = start_server(write_config(tmp_path_factory.mktemp("lstm"), SMALL_LSTM), workers=1)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Any, dict]]:
    """One served SMALL_LSTM for a module's attacks, with its model and weights to check answers against."""
    from batchmaker.common.models import build_model

    config = write_config(tmp_path_factory.mktemp("fuzz"), SMALL_LSTM)
    server = start_server(config, workers=1)
    model = build_model(config.models["lstm"])
    yield server, model, model.load_weights()
    stop_server(server)


@pytest.fixture
def shared_data() -> Path:
    """The project's shared data folder, or a clean skip where this checkout has none beside it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


SMALL_GRU = """
[models.gru]
builder = "batchmaker.common.models.gru:build"
weights = "gru.pt"
vocab_size = 1000
embedding_size = 32
hidden_size = 64
num_layers = 2
max_length = 200
batch_sizes = [1, 2, 4, 8, 16, 32]

[models.gru.cells.layer1]
priority = 1
"""

SMALL_SEQ2SEQ = """
[models.seq2seq]
builder = "batchmaker.common.models.seq2seq:build"
weights = "seq2seq.pt"
src_vocab_size = 1000
tgt_vocab_size = 40
embedding_size = 32
hidden_size = 64
max_length = 100
max_decode_length = 60
batch_sizes = [1, 2, 4, 8, 16, 32]

[models.seq2seq.cells.decoder]
priority = 1
batch_sizes = [1, 2, 4, 8, 16]
"""


@pytest.fixture
def make_harness(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Harnesses (tests/harness.py) on configs of these models in `tmp_path`, closed after the test."""
    from harness import Harness

    made: list[Harness] = []

    def make(models: str, server: str = "", **kwargs: Any) -> Harness:
        made.append(Harness(write_config(tmp_path, models, server=server), **kwargs))
        return made[-1]

    yield make
    for harness in made:
        harness.close()


# A small binary TreeLSTM over the bundled SST vocabulary (data/sst): bench/datasets.py's trees fit it.
SST_TREELSTM = """
[models.tree]
builder = "batchmaker.common.models.treelstm:build"
weights = "tree.pt"
vocab_size = 8737
embedding_size = 32
hidden_size = 64
num_classes = 5
batch_sizes = [1, 2, 4, 8]
"""


@pytest.fixture(scope="session", params=["manager", "worker"])
def door(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A server of every model kind behind the OIP front door (tests/oip_server.py), shared by the front
    door's test modules: they must not change it. Served twice: with the manager deciding each step, and with
    the workers running their own batches (`running_batch`)."""
    from oip_server import start_door

    running = start_door(tmp_path_factory.mktemp("oip"), scheduler=f'running_batch = "{request.param}"')
    yield running
    stop_server(running.server)
