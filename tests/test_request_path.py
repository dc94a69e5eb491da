"""How many of the project's files a request's path crosses in the manager process, read from the manager's own
thread: the manager runs in this process (its event loop in a thread whose calls are recorded), its workers are
real processes, and a real client sends the requests.

With the workers' running batch the manager works per request: it reads, checks, admits and routes a request,
and answers it when its worker says it finished. That path, and the event loop's turns around it, stay within
20 files (docs/architecture.md, "The path of one request")."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, SMALL_LSTM, start_worker, stop_in_thread, wait_until, write_config

from batchmaker.clients import Client
from batchmaker.common.config import resolve_running_batch
from batchmaker.common.models import build_model
from batchmaker.manager.loop.server import Manager

MOST_FILES = 20
OWN = str(ROOT) + "/"


class RecordedManager:
    """A manager in a thread of this process that records which of the project's files its thread runs, while
    `recording` is set."""

    def __init__(self, directory: Path, workers: int):
        config = write_config(directory, SMALL_LSTM)
        config = resolve_running_batch(config, ["cpu"] * workers)  # as `batchmaker serve` would
        self.config, self.address = config, config.server.address
        worker_address = f"ipc://{directory / 'workers.ipc'}"
        self.manager = Manager(config, self.address, worker_address, workers)
        self.files: set[str] = set()
        self.recording = False
        self._thread_id = -1
        threading.setprofile(self._profile)  # the threads started from here on: the event loop's
        try:
            self.loop = threading.Thread(target=self.manager.run, daemon=True)
            self.loop.start()
        finally:
            threading.setprofile(None)
        self._thread_id = self.loop.ident
        self.workers = [start_worker(config, worker_address) for _ in range(workers)]
        with Client(self.address, timeout=60) as client:
            wait_until(lambda: len(client.health()["workers"]) == workers, "the workers registering", timeout=120)

    def _profile(self, frame: FrameType, event: str, _: Any) -> None:
        if self.recording and event == "call" and threading.get_ident() == self._thread_id:
            name = frame.f_code.co_filename
            if name.startswith(OWN) and "/.venv/" not in name:
                self.files.add(name[len(OWN) :])

    def close(self) -> None:
        stop_in_thread(self.manager, self.loop, self.workers)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordedManager]:
    server = RecordedManager(tmp_path_factory.mktemp("path"), workers=2)
    yield server
    server.close()


def files_of_one_request(server: RecordedManager, client: Client, inputs: dict[str, Any]) -> set[str]:
    """The files the manager's thread ran while one request was served, checked against its reference."""
    client.infer("lstm", inputs)  # the first of its kind: the planners' caches made, nothing left to warm
    server.files.clear()
    server.recording = True
    try:
        reply = client.infer("lstm", inputs)
    finally:
        server.recording = False
    model = build_model(server.config.models["lstm"])
    for name, expected in model.reference(model.load_weights(), inputs).items():
        assert float(np.abs(reply.outputs[name] - expected).max()) <= 1e-5
    return set(server.files)


def test_a_request_routed_whole_crosses_at_most_20_files_of_the_manager(recorded: RecordedManager):
    with Client(recorded.address, timeout=60) as client:
        assert client.stats()["running_batch"] == "worker"
        files = files_of_one_request(recorded, client, {"tokens": list(range(1, 12))})
    assert "manager/loop/routing.py" in files and "manager/loop/frontend.py" in files  # the path was recorded
    assert not any("batching/scheduler" in name or "batching/dispatch" in name for name in files), sorted(files)
    assert len(files) <= MOST_FILES, sorted(files)


def test_the_recording_sees_every_file_a_request_of_the_manager_steps_crosses(tmp_path: Path):
    """The same count where the manager decides the steps: planning, scheduling and dispatch are on the path."""
    server = RecordedManager(tmp_path, workers=1)
    try:
        with Client(server.address, timeout=60) as client:
            assert client.stats()["running_batch"] == "manager"
            files = files_of_one_request(server, client, {"tokens": list(range(1, 12))})
    finally:
        server.close()
    assert {"manager/batching/scheduler.py", "manager/batching/dispatch.py", "common/plan.py"} <= files
    assert len(files) > MOST_FILES
