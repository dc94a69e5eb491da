"""Unit tests for common/config.py: the shipped configs, file-level errors, and the [server] and [scheduler]
tables. tests/test_config_models.py checks the [models.x] tables, model building and weight loading."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchmaker.common.addresses import is_loopback
from batchmaker.common.config import (
    AFFINITIES,
    POLICIES,
    Config,
    ConfigError,
    load_config,
    resolve_running_batch,
    with_policy,
    with_running_batch,
)
from batchmaker.common.models import build_model
from batchmaker.common.models.chain_cells import LSTMModel

ROOT = Path(__file__).resolve().parents[1]

MODEL = """
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
vocab_size = 50
embedding_size = 8
hidden_size = 16
max_length = 20
batch_sizes = [1, 2, 4]
"""


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config_error(tmp_path: Path, text: str, *fragments: str) -> str:
    """Load `text` as a config; it must fail with a ConfigError whose message holds every fragment."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the error message: {message}"
    assert str(path) in message, f"the error should name the file: {message}"
    return message


# -- the shipped configuration --------------------------------------------------------------------


def test_default_config_loads() -> None:
    config = load_config(ROOT / "configs" / "default.toml")
    assert config.path == (ROOT / "configs" / "default.toml").resolve()
    assert config.server.address == "tcp://127.0.0.1:5555"
    assert config.server.devices == "auto"
    assert config.server.cpu_workers == 1
    assert config.server.threads_per_worker == 1
    assert config.scheduler.policy == "cellular"
    assert config.scheduler.max_tasks_to_submit == 5
    assert list(config.models) == ["lstm"]
    lstm = config.models["lstm"]
    assert lstm.builder == "batchmaker.common.models.lstm:build"
    assert lstm.weights == (ROOT / "weights" / "lstm-h256-random.pt").resolve()
    assert lstm.params["hidden_size"] == 256
    assert lstm.params["vocab_size"] == 8192
    assert lstm.default_cell.batch_sizes[0] == 1 and lstm.default_cell.batch_sizes[-1] == 64
    assert list(lstm.default_cell.batch_sizes) == sorted(lstm.default_cell.batch_sizes)
    assert lstm.default_cell.priority == 0


def test_default_config_builds_its_model() -> None:
    model = build_model(load_config(ROOT / "configs" / "default.toml").models["lstm"])
    assert isinstance(model, LSTMModel)
    assert model.hidden_size == 256 and model.vocab_size == 8192


def test_minimal_config_gets_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MODEL))
    assert config.server.address == "tcp://127.0.0.1:5555"
    assert config.scheduler.policy == "cellular"
    assert config.models["lstm"].params == {"vocab_size": 50, "embedding_size": 8, "hidden_size": 16, "max_length": 20}


def test_config_accepts_every_policy_affinity_and_device_form(tmp_path: Path) -> None:
    for policy in POLICIES:
        for affinity in AFFINITIES:
            for devices in ('"auto"', '"cpu"', '["cuda:0", "cuda:1"]', '["cpu", "cpu"]'):
                text = f'[server]\ndevices = {devices}\n[scheduler]\npolicy = "{policy}"\naffinity = "{affinity}"\n'
                config = load_config(write(tmp_path, text + MODEL))
                assert (config.scheduler.policy, config.scheduler.affinity) == (policy, affinity)


# -- file-level errors ------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    assert str(path) in str(excinfo.value)


def test_invalid_toml(tmp_path: Path) -> None:
    config_error(tmp_path, "[server\naddress = 'x'\n" + MODEL, "TOML")
    config_error(tmp_path, '[server]\naddress = "unterminated\n' + MODEL, "TOML")
    config_error(tmp_path, "[server]\ncpu_workers = 1\ncpu_workers = 2\n" + MODEL, "TOML")


def test_unknown_top_level_table(tmp_path: Path) -> None:
    config_error(tmp_path, "[sever]\naddress = 'tcp://127.0.0.1:1'\n" + MODEL, "sever")
    config_error(tmp_path, "metrics_port = 9000\n" + MODEL, "metrics_port")


def test_no_models(tmp_path: Path) -> None:
    config_error(tmp_path, "[server]\ncpu_workers = 1\n", "models")


# -- [server] ---------------------------------------------------------------------------------------------


def test_unknown_server_key(tmp_path: Path) -> None:
    config_error(tmp_path, "[server]\nworkers = 2\n" + MODEL, "[server]", "workers")


@pytest.mark.parametrize("devices", ['"gpu"', '"cuda:0"', '[]', '["gpu0"]', '["cpu", 3]', "3", "true"])
def test_bad_devices(tmp_path: Path, devices: str) -> None:
    config_error(tmp_path, f"[server]\ndevices = {devices}\n" + MODEL, "devices")


@pytest.mark.parametrize("devices", ['["cuda:0", "cpu"]', '["cpu", "cuda:1", "cuda:0"]'])
def test_devices_mixing_cpu_and_gpus_are_refused(tmp_path: Path, devices: str) -> None:
    config_error(tmp_path, f"[server]\ndevices = {devices}\n" + MODEL, "devices", "mixes cpu")


@pytest.mark.parametrize("value", ["0", "-1", '"2"', "1.5", "true"])
def test_non_positive_or_ill_typed_cpu_workers(tmp_path: Path, value: str) -> None:
    config_error(tmp_path, f"[server]\ncpu_workers = {value}\n" + MODEL, "cpu_workers")


@pytest.mark.parametrize("value", ["0", "-1", '"2"', "1.5", "true"])
def test_max_clients_must_be_a_positive_integer(tmp_path: Path, value: str) -> None:
    message = config_error(tmp_path, f"[server]\nmax_clients = {value}\n" + MODEL, "max_clients")
    assert "must be an integer >= 1" in message


def test_max_clients_defaults_to_1024_and_takes_a_value(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, MODEL)).server.max_clients == 1024
    assert load_config(write(tmp_path, "[server]\nmax_clients = 1\n" + MODEL)).server.max_clients == 1


@pytest.mark.parametrize("key", ["session_ttl_ms", "max_sessions"])
@pytest.mark.parametrize("value", ["0", "-1", '"2"', "1.5", "true"])
def test_session_bounds_must_be_positive_integers(tmp_path: Path, key: str, value: str) -> None:
    message = config_error(tmp_path, f"[server]\n{key} = {value}\n" + MODEL, key)
    assert "must be an integer >= 1" in message


def test_session_bounds_default_and_take_values(tmp_path: Path) -> None:
    server = load_config(write(tmp_path, MODEL)).server
    assert (server.session_ttl_ms, server.max_sessions) == (60000, 10000)
    server = load_config(write(tmp_path, "[server]\nsession_ttl_ms = 5\nmax_sessions = 3\n" + MODEL)).server
    assert (server.session_ttl_ms, server.max_sessions) == (5, 3)


def test_bad_server_strings_and_limits(tmp_path: Path) -> None:
    config_error(tmp_path, '[server]\naddress = ""\n' + MODEL, "address")
    config_error(tmp_path, "[server]\naddress = 5555\n" + MODEL, "address")
    config_error(tmp_path, "[server]\narena_rows = 8\n" + MODEL, "arena_rows")
    config_error(tmp_path, "[server]\nthreads_per_worker = 0\n" + MODEL, "threads_per_worker")


def test_server_must_be_a_table(tmp_path: Path) -> None:
    config_error(tmp_path, 'server = "tcp://127.0.0.1:1"\n' + MODEL, "server")


# -- [scheduler] ------------------------------------------------------------------------------------------


def test_unknown_policy(tmp_path: Path) -> None:
    config_error(tmp_path, '[scheduler]\npolicy = "fifo"\n' + MODEL, "policy", "fifo")
    config_error(tmp_path, '[scheduler]\npolicy = "Cellular"\n' + MODEL, "policy")


def test_unknown_scheduler_key_and_bad_max_tasks(tmp_path: Path) -> None:
    config_error(tmp_path, "[scheduler]\nb_max = 64\n" + MODEL, "[scheduler]", "b_max")
    config_error(tmp_path, "[scheduler]\nmax_tasks_to_submit = 0\n" + MODEL, "max_tasks_to_submit")


def test_multi_step_keys(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, MODEL)).scheduler.max_steps_per_task == 64
    assert load_config(write(tmp_path, MODEL)).scheduler.max_join_delay_us == 2000
    assert load_config(write(tmp_path, MODEL)).scheduler.latency_target_ms == 100
    text = "[scheduler]\nmax_steps_per_task = 1\nmax_join_delay_us = 500\nlatency_target_ms = 40\n" + MODEL
    scheduler = load_config(write(tmp_path, text)).scheduler
    assert (scheduler.max_steps_per_task, scheduler.max_join_delay_us, scheduler.latency_target_ms) == (1, 500, 40)
    for key in ("max_steps_per_task", "max_join_delay_us", "latency_target_ms"):
        for bad in ("0", "-3", "2.5", '"16"', "true"):
            config_error(
                tmp_path, f"[scheduler]\n{key} = {bad}\n" + MODEL, f"[scheduler] {key} must be an integer >= 1"
            )


def test_running_batch_key(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, MODEL)).scheduler.running_batch == "auto"
    text = '[scheduler]\nrunning_batch = "worker"\n' + MODEL
    assert load_config(write(tmp_path, text)).scheduler.running_batch == "worker"
    for bad in ('"workers"', "1", "true"):
        text = f"[scheduler]\nrunning_batch = {bad}\n" + MODEL
        config_error(tmp_path, text, "running_batch must be one of auto, manager, worker")
    for policy in ("padded", "graph"):
        text = f'[scheduler]\npolicy = "{policy}"\nrunning_batch = "worker"\n' + MODEL
        config_error(tmp_path, text, f"the {policy} policy's batches are formed by the manager")
    config = load_config(write(tmp_path, MODEL))
    assert with_running_batch(config, "worker").scheduler.running_batch == "worker"
    with pytest.raises(ConfigError, match="running_batch must be one of auto, manager, worker"):
        with_running_batch(config, "both")
    with pytest.raises(ConfigError, match="the graph policy's batches are formed by the manager"):
        with_running_batch(with_policy(config, "graph"), "worker")
    with pytest.raises(ConfigError, match="the padded policy's batches are formed by the manager"):
        with_policy(with_running_batch(config, "worker"), "padded")


def test_running_batch_auto_is_the_workers_on_cpu_workers_only(tmp_path: Path) -> None:
    """The workers decide the cellular policy's steps on two CPU workers or more; the manager for one, on GPUs and
    for the baselines; a value set in the file or on the command line stays as it is."""
    config = load_config(write(tmp_path, MODEL))

    def resolved(config: Config, devices: list[str]) -> str:
        return resolve_running_batch(config, devices).scheduler.running_batch

    assert resolved(config, ["cpu", "cpu"]) == resolved(config, ["cpu"] * 16) == "worker"
    assert resolved(config, ["cpu"]) == resolved(config, ["cuda:0", "cuda:1"]) == "manager"
    for policy in ("padded", "graph"):
        assert resolved(with_policy(config, policy), ["cpu", "cpu"]) == "manager"
    for chosen in ("manager", "worker"):
        assert resolved(with_running_batch(config, chosen), ["cpu"]) == chosen
        assert resolved(with_running_batch(config, chosen), ["cuda:0"]) == chosen


# -- [server] cuda_graphs -----------------------------------------------------------------------------------


def test_cuda_graphs_is_off_unless_set(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, MODEL)).server.cuda_graphs is False
    for devices in ('"auto"', '["cuda:0", "cuda:1"]'):
        text = f"[server]\ndevices = {devices}\ncuda_graphs = true\n" + MODEL
        assert load_config(write(tmp_path, text)).server.cuda_graphs is True


@pytest.mark.parametrize("value", ['"true"', "1", "0", '"yes"', "[true]"])
def test_cuda_graphs_must_be_a_boolean(tmp_path: Path, value: str) -> None:
    config_error(tmp_path, f"[server]\ncuda_graphs = {value}\n" + MODEL, "cuda_graphs must be true or false")


@pytest.mark.parametrize("devices", ['"cpu"', '["cpu", "cpu"]'])
def test_cuda_graphs_on_cpu_workers_is_refused(tmp_path: Path, devices: str) -> None:
    config_error(tmp_path, f"[server]\ndevices = {devices}\ncuda_graphs = true\n" + MODEL, "cuda_graphs", "GPU")


# -- worker sockets: addresses and keys ---------------------------------------------------------------------

WORKER_KEYS = """
[server.worker_curve]
secret_key = "keys/manager.key_secret"
allowed_workers = "keys/workers"
worker_secret_key = "/etc/batchmaker/worker.key_secret"
manager_public_key = "keys/manager.key"
"""


@pytest.mark.parametrize("address", ["auto", "ipc:///run/bm/workers", "tcp://127.0.0.2:6000", "tcp://localhost:6000"])
def test_worker_addresses_only_this_machine_reaches_need_no_keys(tmp_path: Path, address: str) -> None:
    server = load_config(write(tmp_path, f'[server]\nworker_address = "{address}"\n' + MODEL)).server
    assert server.worker_curve is None and not server.insecure_workers


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:6000", "tcp://10.0.0.7:6000", "tcp://*:6000", "tcp://eth0:6000"])
def test_a_worker_address_other_machines_reach_needs_keys_or_insecure_workers(tmp_path: Path, address: str) -> None:
    line = f'[server]\nworker_address = "{address}"\n'
    config_error(tmp_path, line + MODEL, "[server] worker_address", "[server.worker_curve]", "insecure_workers = true")
    assert load_config(write(tmp_path, line + "insecure_workers = true\n" + MODEL)).server.insecure_workers
    keys = load_config(write(tmp_path, line + WORKER_KEYS + MODEL)).server.worker_curve
    assert keys is not None
    assert keys.secret_key == (tmp_path / "keys" / "manager.key_secret").resolve()  # relative to the config file
    assert keys.allowed_workers == (tmp_path / "keys" / "workers").resolve()
    assert keys.worker_secret_key == Path("/etc/batchmaker/worker.key_secret")
    assert keys.manager_public_key == (tmp_path / "keys" / "manager.key").resolve()


def test_worker_keys_table_errors(tmp_path: Path) -> None:
    config_error(tmp_path, WORKER_KEYS.replace('manager_public_key = "keys/manager.key"\n', "") + MODEL,
                 "[server.worker_curve] manager_public_key must be a non-empty string")
    config_error(tmp_path, WORKER_KEYS + 'allowed_clients = "keys/clients"\n' + MODEL,
                 "[server.worker_curve] has unknown key(s) ['allowed_clients']")
    config_error(tmp_path, '[server]\ninsecure_workers = "yes"\n' + MODEL, "insecure_workers must be true or false")


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("ipc:///tmp/x", True),
        ("inproc://x", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://10.0.0.1:5555", False),
        ("ws://0.0.0.0:5555", False),
        ("tipc://{5560,0,0}", False),
        ("udp://0.0.0.0:5555", False),
        ("epgm://eth0;239.192.1.1:5555", False),
    ],
)
def test_only_ipc_inproc_and_loopback_tcp_are_local(address: str, local: bool):
    assert is_loopback(address) is local


# -- [server] cross_gpu_reads -------------------------------------------------------------------------------


def test_cross_gpu_reads_are_always_allowed_unless_set(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, MODEL)).server.cross_gpu_reads == "always"
    for value in ("peer-access", "never"):
        text = f'[server]\ncross_gpu_reads = "{value}"\n' + MODEL
        assert load_config(write(tmp_path, text)).server.cross_gpu_reads == value


@pytest.mark.parametrize("value", ['"sometimes"', "true", '""'])
def test_an_unknown_cross_gpu_reads_is_refused(tmp_path: Path, value: str) -> None:
    config_error(tmp_path, f"[server]\ncross_gpu_reads = {value}\n" + MODEL, "cross_gpu_reads")


def test_the_bundled_configs_name_their_random_weights_as_random():
    """init-weights writes random weights under the names these give: never a trained model's name."""
    configs = [*(ROOT / "configs").glob("*.toml")]
    assert configs
    for path in configs:
        for model in load_config(path).models.values():
            assert model.weights.stem.endswith("-random"), (path.name, model.name, model.weights.name)
    manifests = (ROOT / "deploy" / "k8s" / "configmap.yaml").read_text()
    assert re.findall(r'weights = "([^"]+)"', manifests) == ["/weights/lstm-h256-random.pt"]


def test_a_manager_started_alone_needs_running_batch_resolved(tmp_path: Path) -> None:
    """Only `batchmaker serve` knows the workers' devices that `auto` is resolved from."""
    command = [sys.executable, "-m", "batchmaker.manager", "--config", str(write(tmp_path, MODEL))]
    sockets = ["--address", f"ipc://{tmp_path}/clients", "--worker-address", f"ipc://{tmp_path}/workers"]
    command += [*sockets, "--metrics-address", ""]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "a manager started alone needs --running-batch manager or worker" in done.stderr
