"""The config read again at run time (SIGHUP through `batchmaker serve`, `batchmaker reload`), the command
line's `models load|unload`, and a worker lost while a version loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, SMALL_LSTM, free_port, start_server, stop_server, wait_until, write_config
from test_model_control import assert_matches, reference, versions, weights_file

from batchmaker.clients import Client, ServerError
from batchmaker.clients.cli import main as cli_main
from batchmaker.common.config import Config, load_config
from batchmaker.common.models import build_model, init_missing_weights
from batchmaker.common.protocol import BAD_REQUEST, UNKNOWN_MODEL
from batchmaker.manager.commands import launcher

SECOND_LSTM = SMALL_LSTM.replace("[models.lstm]", "[models.second]").replace('"lstm.pt"', '"second.pt"')
THIRD_LSTM = SMALL_LSTM.replace("[models.lstm]", "[models.third]").replace('"lstm.pt"', '"third.pt"')
# A builder whose workers wait for a file beside it before they build: a load that takes as long as the test wants.
GATED_BUILDER = """
import time
from pathlib import Path

from batchmaker.common.models import lstm

planner = lstm.planner


def build(config):
    while not Path(__file__).with_name("gate").exists():
        time.sleep(0.01)
    return lstm.build(config)
"""


def rewrite(path: Path, old: str, new: str) -> None:
    """Edit the config file in place, creating the weights a new model names."""
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    init_missing_weights(load_config(path))


def test_sighup_adds_removes_and_reloads_models(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM + SECOND_LSTM)
    metrics = f"127.0.0.1:{free_port()}"  # a command-line setting: the reload keeps it, not the file's (none)
    serve = [sys.executable, "-m", "batchmaker.manager.commands.cli", "serve", str(config.path)]
    serve += ["--metrics-address", metrics]
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(serve, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        launcher.wait_until_ready(config.server.address, server, timeout=120)
        # The supervisor's own readiness check, after which it restarts workers rather than giving up on them.
        wait_until(lambda: "batchmaker serving on" in (tmp_path / "serve.log").read_text(), "the supervisor ready")
        retrained = weights_file(config, "lstm-retrained.pt", seed=5)
        rewrite(config.path, SECOND_LSTM, THIRD_LSTM)
        rewrite(config.path, 'weights = "lstm.pt"', f'weights = "{retrained.name}"')
        server.send_signal(signal.SIGHUP)  # to the supervisor, which forwards it to the manager
        with Client(config.server.address, timeout=60) as client:
            wait_until(lambda: "third" in client.models()["models"], "the added model served")
            wait_until(lambda: versions(client).get(2) == "ready", "the retrained lstm served")
            assert versions(client, "second") in ({1: "draining"}, {1: "unloaded"})
            third = client.infer("third", {"tokens": [4, 5, 6]})
            lstm = client.infer("lstm", {"tokens": [4, 5, 6]})
            with pytest.raises(ServerError) as refused:
                client.infer("second", {"tokens": [1]})
            # A worker restarted now reads a config file that names other models than the manager started with:
            # it builds the manager's, then loads what came since, and serves them.
            lost = client.health()["workers"][0]["pid"]
            os.kill(lost, signal.SIGKILL)
            wait_until(lambda: pids(client) not in ([], [lost]), "a new worker")
            again = [client.infer(name, {"tokens": [4, 5, 6]}) for name in ("third", "lstm")]
        new = load_config(config.path)
        assert [reply.version for reply in again] == [1, 2]
        assert_matches(again[0].outputs, third.outputs)
        assert_matches(again[1].outputs, lstm.outputs)
        assert third.version == 1
        assert_matches(third.outputs, reference_of(new, "third")({"tokens": [4, 5, 6]}))
        assert lstm.version == 2
        assert_matches(lstm.outputs, reference(new, retrained)({"tokens": [4, 5, 6]}))
        assert refused.value.code == UNKNOWN_MODEL
        scraped = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
        assert 'batchmaker_requests_total{model="third",outcome="ok"} 2.0' in scraped  # a model added, labelled
        assert 'batchmaker_requests_total{model="lstm",outcome="ok"} 2.0' in scraped  # its version 2 counts as lstm
    finally:
        assert not launcher.stop_server(server)


def pids(client: Client) -> list[int]:
    return [worker["pid"] for worker in client.health()["workers"]]


def reference_of(config: Config, name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    model = build_model(config.models[name])
    state = model.load_weights()
    return lambda inputs: model.reference(state, inputs)


def test_a_server_setting_changed_in_the_file_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture):
    config = write_config(tmp_path, SMALL_LSTM, scheduler='policy = "padded"')
    server = start_server(config, workers=1)
    try:
        with server.client() as client, pytest.raises(ServerError) as baseline:
            client.call({"op": "load", "model": "lstm"})
        assert baseline.value.code == BAD_REQUEST
        assert "under the cellular policy only, not 'padded'" in baseline.value.message
        text = config.path.read_text()
        config.path.write_text(text + "[models.broken\n")
        assert cli_main(["reload", "--address", server.address]) == 1
        assert "error BAD_REQUEST: the config was not reloaded: " in capsys.readouterr().err
        config.path.write_text(text)
        rewrite(config.path, "arena_rows = 4096", "arena_rows = 8192\nmax_queued_requests = 50")
        rewrite(config.path, 'weights = "lstm.pt"', 'weights = "elsewhere.pt"')
        assert cli_main(["reload", "--address", server.address]) == 1
        error = capsys.readouterr().err
        refusal = "error BAD_REQUEST: the config was not reloaded: [server] arena_rows, [server] max_queued_requests"
        assert refusal in error
        assert "cannot change while the server runs" in error
        with server.client() as client:
            assert versions(client) == {1: "ready"}  # nothing of the file was applied, its weights included
    finally:
        stop_server(server)


def test_the_command_line_loads_lists_and_unloads(tmp_path: Path, capsys: pytest.CaptureFixture):
    config = write_config(tmp_path, SMALL_LSTM)
    retrained = weights_file(config, "lstm-retrained.pt", seed=3)
    server = start_server(config, workers=1)
    address = ["--address", server.address]
    try:
        assert cli_main(["models", "load", "lstm", "--weights", str(retrained), *address]) == 0
        assert '"version": 2' in capsys.readouterr().out
        with server.client() as client:
            wait_until(lambda: versions(client) == {1: "unloaded", 2: "ready"}, "version 1 unloaded")
            reply = client.infer("lstm", {"tokens": [7]})
        assert_matches(reply.outputs, reference(config, retrained)({"tokens": [7]}))
        assert cli_main(["models", *address]) == 0
        assert "  versions: 1 unloaded, 2 ready" in capsys.readouterr().out
        assert cli_main(["models", "unload", "lstm", *address]) == 0
        assert '"draining": [2]' in capsys.readouterr().out
        assert cli_main(["models", "unload", "lstm", *address]) == 1
        assert "error UNKNOWN_MODEL: no model named 'lstm'" in capsys.readouterr().err
        with server.client() as client:
            wait_until(lambda: versions(client) == {1: "unloaded", 2: "unloaded"}, "version 2 unloaded")
        assert cli_main(["models", *address]) == 0
        assert "lstm: not served; versions: 1 unloaded, 2 unloaded" in capsys.readouterr().out
    finally:
        stop_server(server)


def test_a_worker_lost_while_a_version_loads_leaves_the_load_to_the_others(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    (tmp_path / "gated_lstm.py").write_text(GATED_BUILDER)
    other = tmp_path / "gated.toml"
    gated = SMALL_LSTM.replace("batchmaker.common.models.lstm:build", "gated_lstm:build")
    other.write_text(gated.replace('"lstm.pt"', '"lstm-retrained.pt"'))
    retrained = weights_file(config, "lstm-retrained.pt", seed=9)
    server = start_server(config, workers=2)
    try:
        outcome: dict[str, dict] = {}
        with server.client(timeout=120) as client:
            loading = threading.Thread(
                target=lambda: outcome.update(reply=client.call({"op": "load", "model": "lstm", "config": str(other)}))
            )
            loading.start()
            with server.client() as watcher:
                wait_until(lambda: versions(watcher).get(2) == "loading", "version 2 loading")
                lost = watcher.health()["workers"][0]["pid"]
                os.kill(lost, signal.SIGKILL)
                wait_until(lambda: lost not in pids(watcher), "the worker written off")
                (tmp_path / "gate").touch()
                loading.join(timeout=120)
                assert outcome["reply"]["ok"] and outcome["reply"]["version"] == 2
                wait_until(lambda: len(pids(watcher)) == 2, "the lost worker restarted")
                answer = reference(config, retrained)
                replies = [watcher.infer("lstm", {"tokens": [n, n + 1]}) for n in range(40)]
        for n, reply in enumerate(replies):
            assert reply.version == 2
            assert_matches(reply.outputs, answer({"tokens": [n, n + 1]}))
    finally:
        stop_server(server)


def test_a_weights_file_rewritten_in_place_is_a_change_and_an_unchanged_file_none(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    server = start_server(config, workers=1)
    try:
        with server.client() as client:
            assert client.call({"op": "reload"})["loaded"] == {}
            retrained = weights_file(config, "lstm.pt", seed=21)  # the configured file, overwritten
            reloaded = client.call({"op": "reload"})
            assert reloaded["loaded"] == {"lstm": 2} and reloaded["unloaded"] == []
            reply = client.infer("lstm", {"tokens": [2, 3]})
        assert reply.version == 2
        assert_matches(reply.outputs, reference(config, retrained)({"tokens": [2, 3]}))
    finally:
        stop_server(server)
