"""Loads while workers come and go, through a real server: a version serves only once a worker that loaded it
is registered and every worker asked has answered; a load asked while no worker is registered waits for one (up
to `[server] load_wait_ms`); a load that fails leaves the old version serving and the cell types as they were."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL_LSTM, start_server, stop_server, wait_until, write_config
from test_config_reload import GATED_BUILDER, pids
from test_model_control import assert_matches, reference, versions, weights_file

from batchmaker.clients import Client, ServerError
from batchmaker.common.protocol import BAD_REQUEST

GATED_LSTM = SMALL_LSTM.replace("batchmaker.common.models.lstm:build", "gated_lstm:build")
# A builder that the worker of index 1 refuses: a load that one worker builds and another cannot.
REFUSING_BUILDER = """
import sys

from batchmaker.common.models import lstm

planner = lstm.planner


def build(config):
    if sys.argv[sys.argv.index("--index") + 1] == "1":
        raise ValueError("worker index 1 refuses this model")
    return lstm.build(config)
"""


def gated(directory: Path, models: str = GATED_LSTM) -> Path:
    """A config in `directory` whose workers build the LSTM only while the file `gate` beside it exists (it does
    now): with the gate closed, a worker that starts, or loads a version, waits before it builds."""
    (directory / "gated_lstm.py").write_text(GATED_BUILDER)
    (directory / "gate").touch()
    return directory / "gate"


@contextmanager
def loading(client: Client, message: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Send a load on a thread of its own; the map it yields gets the reply (`reply`) or the error (`error`)."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["reply"] = client.call(message)
        except ServerError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    try:
        yield outcome
    finally:
        thread.join(timeout=120)


def cell_types(client: Client) -> set[str]:
    """The cell types the scheduler has queues for."""
    return set(client.stats()["ready_nodes"])


def lose_the_only_worker(client: Client) -> int:
    """SIGKILL the one worker; returns its pid once the manager has written it off."""
    (worker,) = pids(client)
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: not pids(client), "the manager writing the worker off")
    return worker


def test_a_load_asked_while_the_only_worker_restarts_waits_for_it_and_serves_on_it(tmp_path: Path):
    gate = gated(tmp_path)
    config = write_config(tmp_path, GATED_LSTM)
    retrained = weights_file(config, "lstm-retrained.pt", seed=17)
    server = start_server(config, workers=1)
    try:
        with server.client(timeout=120) as client, server.client() as watcher:
            gate.unlink()  # the restarted worker waits before it registers
            lose_the_only_worker(watcher)
            with loading(client, {"op": "load", "model": "lstm", "weights": str(retrained)}) as outcome:
                wait_until(lambda: versions(watcher).get(2) == "loading", "version 2 loading")
                assert not pids(watcher) and not outcome  # no worker has it: it waits for one
                assert versions(watcher) == {1: "ready", 2: "loading"}
                gate.touch()  # the worker starts, registers, and is asked to load version 2
                wait_until(lambda: outcome, "the load's answer")
            assert outcome["reply"]["version"] == 2
            assert len(pids(watcher)) == 1
            reply = watcher.infer("lstm", {"tokens": [3, 1, 4]})
            assert cell_types(watcher) == {"lstm/layer0", "lstm@2/layer0"}
        assert reply.version == 2
        assert_matches(reply.outputs, reference(config, retrained)({"tokens": [3, 1, 4]}))
    finally:
        gate.touch()
        stop_server(server)


def test_a_load_no_worker_registers_for_fails_after_load_wait_ms_and_the_old_version_serves_on(tmp_path: Path):
    gate = gated(tmp_path)
    config = write_config(tmp_path, GATED_LSTM, server="load_wait_ms = 500")
    retrained = weights_file(config, "lstm-retrained.pt", seed=19)
    server = start_server(config, workers=1)
    try:
        with server.client(timeout=120) as client:
            before = cell_types(client)
            gate.unlink()
            lose_the_only_worker(client)
            with pytest.raises(ServerError) as refused:
                client.call({"op": "load", "model": "lstm", "weights": str(retrained)})
            assert refused.value.code == BAD_REQUEST
            why = "version 2 of model 'lstm': no worker registered to load it within 0.5 s ([server] load_wait_ms)"
            assert refused.value.message == why
            assert versions(client) == {1: "ready", 2: "failed"}
            assert client.models()["models"]["lstm"]["versions"][1]["reason"] in why
            assert cell_types(client) == before
            gate.touch()  # the worker registers and serves version 1; it is not asked for version 2
            old = client.infer("lstm", {"tokens": [2, 7]})
            assert client.call({"op": "load", "model": "lstm", "weights": str(retrained)})["version"] == 3
            new = client.infer("lstm", {"tokens": [2, 7]})
            assert versions(client) in (
                {1: "draining", 2: "failed", 3: "ready"},
                {1: "unloaded", 2: "failed", 3: "ready"},
            )
        assert (old.version, new.version) == (1, 3)
        assert_matches(old.outputs, reference(config, config.models["lstm"].weights)({"tokens": [2, 7]}))
        assert_matches(new.outputs, reference(config, retrained)({"tokens": [2, 7]}))
    finally:
        gate.touch()
        stop_server(server)


def test_the_only_worker_killed_while_it_loads_fails_the_load_and_the_old_version_serves_on(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    gate = gated(tmp_path)
    gate.unlink()  # the workers start with the plain LSTM; the version loaded waits at the gate
    table = tmp_path / "gated.toml"
    table.write_text(GATED_LSTM.replace('"lstm.pt"', '"lstm-retrained.pt"'))
    weights_file(config, "lstm-retrained.pt", seed=23)
    server = start_server(config, workers=1)
    try:
        with server.client(timeout=120) as client, server.client() as watcher:
            before = cell_types(watcher)
            with loading(client, {"op": "load", "model": "lstm", "config": str(table)}) as outcome:
                wait_until(lambda: versions(watcher).get(2) == "loading", "version 2 loading")
                lost = lose_the_only_worker(watcher)
                wait_until(lambda: outcome, "the load's answer")
            error = outcome["error"]
            assert error.code == BAD_REQUEST
            assert error.message.startswith("version 2 of model 'lstm': worker 0 was lost before the load ended")
            assert error.message.endswith("no worker left has it")
            assert versions(watcher) == {1: "ready", 2: "failed"}
            assert cell_types(watcher) == before
            # The restarted worker serves version 1 and is not asked for version 2: it would wait at the gate.
            wait_until(lambda: pids(watcher) not in ([], [lost]), "the worker restarted")
            reply = watcher.infer("lstm", {"tokens": [5, 9]})
        assert reply.version == 1
        assert_matches(reply.outputs, reference(config, config.models["lstm"].weights)({"tokens": [5, 9]}))
    finally:
        gate.touch()
        stop_server(server)


def test_loads_that_fail_leave_the_cell_types_as_they_were_and_a_later_load_serves(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    (tmp_path / "small").mkdir()
    small = write_config(tmp_path / "small", SMALL_LSTM.replace("hidden_size = 64", "hidden_size = 32"))
    (tmp_path / "refusing_lstm.py").write_text(REFUSING_BUILDER)
    table = tmp_path / "refusing.toml"
    table.write_text(SMALL_LSTM.replace("batchmaker.common.models.lstm:build", "refusing_lstm:build"))
    retrained = weights_file(config, "lstm-retrained.pt", seed=29)
    server = start_server(config, workers=2)
    try:
        with server.client(timeout=120) as client:
            before = cell_types(client)
            with pytest.raises(ServerError) as everywhere:  # weights every worker refuses
                client.call({"op": "load", "model": "lstm", "weights": str(small.models["lstm"].weights)})
            assert everywhere.value.code == BAD_REQUEST and "could not load it" in everywhere.value.message
            assert cell_types(client) == before
            # One worker builds it and the other cannot: the load fails, and the first drops it.
            with pytest.raises(ServerError) as one:
                client.call({"op": "load", "model": "lstm", "config": str(table)})
            assert one.value.code == BAD_REQUEST
            assert "could not load it: ValueError: worker index 1 refuses this model" in one.value.message
            assert cell_types(client) == before
            assert versions(client) == {1: "ready", 2: "failed", 3: "failed"}
            old = client.infer("lstm", {"tokens": [8, 8, 1]})
            # The next version's cells are numbered after those of the failed loads, which a worker may still hold.
            assert client.call({"op": "load", "model": "lstm", "weights": str(retrained)})["version"] == 4
            assert cell_types(client) == before | {"lstm@4/layer0"}
            new = [client.infer("lstm", {"tokens": [n, 8, 1]}) for n in range(20)]
        assert old.version == 1
        assert_matches(old.outputs, reference(config, config.models["lstm"].weights)({"tokens": [8, 8, 1]}))
        for n, reply in enumerate(new):
            assert reply.version == 4
            assert_matches(reply.outputs, reference(config, retrained)({"tokens": [n, 8, 1]}))
    finally:
        stop_server(server)
