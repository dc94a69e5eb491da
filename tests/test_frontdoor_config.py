"""The [http] and [grpc] tables: defaults, each mistake named, `batchmaker serve --http/--grpc`, and the
missing `oip` extra named at start-up."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_deploy_manifests import GRPC_TOKEN, check

from batchmaker.common.config import Config, ConfigError, load_config, with_door_addresses
from batchmaker.common.frontdoor_config import body_limit
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
    assert config.http.max_body_bytes is None and door_processes(config) == 1
    assert door_processes(config_of(tmp_path, "[http]\nprocesses = 3\n")) == 3
    assert door_processes(config_of(tmp_path, "[grpc]\n")) == 1


def test_the_body_limit_is_the_servers_frame_limit_unless_max_body_bytes_is_given(tmp_path: Path):
    def limit(config: Config) -> int:
        return body_limit(config.http, config.server.max_message_bytes)

    assert limit(config_of_top(tmp_path, "[grpc]\n")) == 1024 * 1024  # [server] max_message_bytes' default
    assert limit(config_of_top(tmp_path, "[server]\nmax_message_bytes = 5000\n[http]\n")) == 5000
    given = config_of_top(tmp_path, "[server]\nmax_message_bytes = 5000\n[http]\nmax_body_bytes = 9000\n")
    assert given.http.max_body_bytes == limit(given) == 9000


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
        ("[http]\nmax_body_bytes = 0\n", "max_body_bytes must be an integer >= 1"),
        ("[grpc]\ncontrol_token_file = 'absent'\n", "[grpc] control_token_file … is not a file"),
        ("[http]\ncontrol_token_file = 'empty'\n", "[http] control_token_file … is empty"),
        ("[grpc]\ntoken_file = 'token'\ncontrol_token_file = 'same'\n", "holds the same token as token_file"),
        ("http = 3\n", "[http] must be a table"),
    ],
)
def test_each_mistake_is_named(tmp_path: Path, tables: str, words: str):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "token").write_text("a-token\n")
    (tmp_path / "same").write_text("  a-token")
    with pytest.raises(ConfigError) as refused:
        config_of_top(tmp_path, tables)
    assert all(part in str(refused.value) for part in words.split(" … "))


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


def test_the_manifest_check_wants_a_control_token_file_from_the_secret(tmp_path: Path):
    """deploy/check_manifests.py takes the files the door tables name, a control_token_file among them, as the
    pod's: each must reach the containers from the Secret."""
    control = GRPC_TOKEN.replace("\n\n", '\n    control_token_file = "/door/control-token"\n\n')
    named = {"k8s/configmap.yaml": (GRPC_TOKEN, control)}
    refused = check(tmp_path / "named", named)
    assert refused.returncode == 1
    assert "batchmaker-gpu: container server must mount [grpc] control_token_file /door/control-token" in refused.stderr
    token = "              - {key: token, path: token}\n"
    mounted = token + "              - {key: control-token, path: control-token}\n"
    deployments = {f"k8s/deployment-{kind}.yaml": (token, mounted) for kind in ("cpu", "gpu")}
    done = check(tmp_path / "mounted", named | deployments)
    assert done.returncode == 0, done.stderr
