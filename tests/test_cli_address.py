"""How the command lines find their server, run as a user runs them (subprocesses, against a real
server): --address, then --config FILE's [server] address, then BATCHMAKER_ADDRESS; a clear error
when none is given or the config cannot be read; and, before the request, a short health check that
says at once when nothing answers, apart from a request that is only slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import RunningServer, free_port
from test_clients_failover import FakeServer
from test_serve_cli import BATCHMAKER

from batchmaker.common.models import build_model

CLIENT = [sys.executable, "-m", "batchmaker.clients.cli"]  # batchmaker-client, as the client distribution runs it
COMMANDS = {"batchmaker": [BATCHMAKER], "batchmaker-client": CLIENT}
TOKENS = [5, 17, 342, 9]


def run(command: list[str], *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A command line run with the user's environment, less PYTHONPATH and BATCHMAKER_ADDRESS unless `env` sets it."""
    base = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "BATCHMAKER_ADDRESS")}
    return subprocess.run(
        [*command, *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=120, check=False
    )


def infer_h(result: subprocess.CompletedProcess[str]) -> np.ndarray:
    assert result.returncode == 0, result.stderr
    return np.asarray(json.loads(result.stdout)["outputs"]["h"], np.float32)


def reference_h(server: RunningServer, tokens: list[int]) -> np.ndarray:
    model = build_model(server.config.models["lstm"])
    return model.reference(model.load_weights(), {"tokens": tokens})["h"]


def infer_args(*extra: str) -> list[str]:
    return ["infer", "--model", "lstm", "--tokens", " ".join(map(str, TOKENS)), "--json", *extra]


def dead_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def config_at(folder: Path, address: str) -> Path:
    path = folder / "elsewhere.toml"
    path.write_text(f'[server]\naddress = "{address}"\n\n[models.lstm]\nbuilder = "a.b:build"\nweights = "w.pt"\n')
    return path


@pytest.mark.parametrize("name", COMMANDS)
def test_the_address_comes_from_the_environment_or_the_config(name: str, lstm_server: RunningServer, tmp_path: Path):
    command = COMMANDS[name]
    expected = reference_h(lstm_server, TOKENS)
    from_environment = run(command, *infer_args(), env={"BATCHMAKER_ADDRESS": lstm_server.address})
    assert np.abs(infer_h(from_environment) - expected).max() <= 1e-5
    from_config = run(command, *infer_args("--config", str(lstm_server.config.path)))
    assert np.abs(infer_h(from_config) - expected).max() <= 1e-5

    # --address wins over both, --config over the environment
    elsewhere = str(config_at(tmp_path, dead_address()))
    given = run(
        command,
        *infer_args("--address", lstm_server.address, "--config", elsewhere),
        env={"BATCHMAKER_ADDRESS": dead_address()},
    )
    assert np.abs(infer_h(given) - expected).max() <= 1e-5
    configured = run(
        command, *infer_args("--config", str(lstm_server.config.path)), env={"BATCHMAKER_ADDRESS": dead_address()}
    )
    assert np.abs(infer_h(configured) - expected).max() <= 1e-5


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize(
    "subcommand", [["health"], ["models"], ["stats"], ["infer", "--model", "lstm", "--tokens", "1"]]
)
def test_no_address_names_the_three_ways_to_give_one(name: str, subcommand: list[str]):
    result = run(COMMANDS[name], *subcommand)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("error USAGE: no server address: "), result.stderr
    assert "--address ADDRESS" in result.stderr and "BATCHMAKER_ADDRESS=" in result.stderr
    assert "--config FILE" in result.stderr


@pytest.mark.parametrize("name", COMMANDS)
def test_a_config_that_cannot_be_read_is_named(name: str, tmp_path: Path):
    missing = tmp_path / "missing.toml"
    result = run(COMMANDS[name], "health", "--config", str(missing))
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"error USAGE: cannot take the server address from --config {missing}: "
    ), result.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    result = run(COMMANDS[name], "health", "--config", str(broken))
    assert result.returncode == 1 and "cannot take the server address from --config" in result.stderr
    assert "TOML" in result.stderr, result.stderr


def test_the_client_reads_a_config_address_of_the_wrong_type_as_an_error(tmp_path: Path):
    path = tmp_path / "wrong.toml"
    path.write_text("[server]\naddress = 5555\n")
    result = run(CLIENT, "health", "--config", str(path))
    assert result.returncode == 1
    assert "[server] address must be a string" in result.stderr, result.stderr


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize(
    "subcommand", [["health"], ["models"], ["stats"], ["infer", "--model", "lstm", "--tokens", "1"]]
)
def test_nothing_listening_is_said_by_the_health_check(name: str, subcommand: list[str]):
    address = dead_address()
    result = run(COMMANDS[name], *subcommand, env={"BATCHMAKER_ADDRESS": address})
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(
        f"error NO_SERVER: no server at {address} (from BATCHMAKER_ADDRESS): nothing answered a health check within 3 s"
    ), result.stderr
    assert "batchmaker serve CONFIG" in result.stderr and "--connect-timeout" in result.stderr


def test_a_server_that_answers_health_but_not_the_request_is_a_timeout(tmp_path: Path):
    server = FakeServer("held", mode="hold")
    try:
        result = run(
            [BATCHMAKER], "infer", "--address", server.address, "--model", "m", "--inputs", '{"n": 1}', "--timeout", "1"
        )
    finally:
        server.release()
        server.close()
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"error TIMEOUT: the server at {server.address} answered a health check, but not the infer request within 1 s"
    ), result.stderr
    assert [m.get("op", "infer") for m in server.messages] == ["health", "infer"]
