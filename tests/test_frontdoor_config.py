"""The [http] and [grpc] tables: defaults, each mistake named, `batchmaker serve --http/--grpc`, and the
missing `oip` extra named at start-up."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batchmaker.common.config import ConfigError, load_config, with_door_addresses
from batchmaker.manager.commands.doors import check_door_packages, door_arguments, door_processes
from batchmaker.manager.commands.preflight import check_door_addresses

MODEL = """
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
vocab_size = 10
embedding_size = 4
hidden_size = 4
batch_sizes = [1]
"""


def config_of(tmp_path: Path, tables: str):
    path = tmp_path / "config.toml"
    path.write_text(MODEL + tables)
    return load_config(path)


def test_the_front_door_is_off_without_its_tables_and_on_loopback_by_default(tmp_path: Path):
    assert door_processes(config_of(tmp_path, "")) == 0
    config = config_of(tmp_path, "[http]\n[grpc]\n")
    assert (config.http.address, config.grpc.address) == ("127.0.0.1:8000", "127.0.0.1:8001")
    assert config.http.max_body_bytes == 64 * 1024 * 1024 and door_processes(config) == 1
    assert door_processes(config_of(tmp_path, "[http]\nprocesses = 3\n")) == 3
    assert door_processes(config_of(tmp_path, "[grpc]\n")) == 1


def config_of_top(tmp_path: Path, tables: str):
    """A config whose tables come first (a top-level key must)."""
    path = tmp_path / "config.toml"
    path.write_text(tables + MODEL)
    return load_config(path)


@pytest.mark.parametrize(
    ("tables", "words"),
    [
        ("[http]\nadress = '127.0.0.1:1'\n", "unknown key(s) ['adress']"),
        ("[http]\naddress = 'localhost'\n", 'must look like "127.0.0.1:8000"'),
        ("[grpc]\naddress = '127.0.0.1:99999'\n", "[grpc] address"),
        ("[http]\nprocesses = 0\n", "processes must be an integer >= 1"),
        ("[grpc]\nmax_body_bytes = 5\n", "unknown key(s) ['max_body_bytes']"),
        ("[http]\ntls_cert = 'config.toml'\n", "tls_cert and tls_key go together"),
        ("[http]\ntls_client_ca = 'config.toml'\n", "needs tls_cert and tls_key"),
        ("[grpc]\ntoken_file = 'absent'\n", "is not a file"),
        ("[http]\ntoken_file = 'empty'\n", "is empty"),
        ("http = 3\n", "[http] must be a table"),
    ],
)
def test_each_mistake_is_named(tmp_path: Path, tables: str, words: str):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError) as refused:
        config_of_top(tmp_path, tables)
    assert words in str(refused.value)


def test_serve_flags_set_the_listeners_and_reach_the_front_door_processes(tmp_path: Path):
    config = with_door_addresses(config_of(tmp_path, "[http]\nprocesses = 2\n"), "127.0.0.1:9000", "127.0.0.1:9001")
    assert (config.http.address, config.http.processes, config.grpc.address) == ("127.0.0.1:9000", 2, "127.0.0.1:9001")
    assert door_arguments(config, "tcp://127.0.0.1:5555") == [
        "--manager", "tcp://127.0.0.1:5555", "--http", "127.0.0.1:9000", "--grpc", "127.0.0.1:9001"
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="must look like"):
        with_door_addresses(config, "nowhere", None)


def test_a_missing_extra_fails_start_up_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    config = config_of(tmp_path, "[grpc]\n")
    check_door_packages(config)  # installed here
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if it were not
    with pytest.raises(ConfigError) as refused:
        check_door_packages(config)
    assert "pip install 'batchmaker[oip]'" in str(refused.value) and "missing: aiohttp" in str(refused.value)
    check_door_packages(config_of(tmp_path, ""))  # no front door: nothing to miss


def test_a_listener_port_in_use_is_named_before_start(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = config_of(tmp_path, f'[grpc]\naddress = "127.0.0.1:{port}"\n')
        with pytest.raises(
            ConfigError, match=rf"\[grpc\] address 127.0.0.1:{port}: port {port} is in use.*--grpc 127.0.0.1:"
        ):
            check_door_addresses(config)
        done = subprocess.run(
            [sys.executable, "-m", "batchmaker.frontdoor", "--config", str(config.path)],
            capture_output=True, text=True, timeout=120, check=False
        )  # fmt: skip
    assert done.returncode == 2 and "cannot listen" in done.stderr
