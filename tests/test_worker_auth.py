"""Authentication of workers, with real processes: worker sockets other machines can reach need
CURVE keys (or an explicit insecure_workers), and only workers holding an allowed key register."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, SMALL_LSTM, free_port, start_server, start_worker, stop_server, wait_until, write_config

from batchmaker.clients import AsyncClient
from batchmaker.common.auth import generate_keypair
from batchmaker.common.models import build_model

TOLERANCE = 1e-5


class Keys:
    """The manager's key pair, and worker key pairs: `local` and `second` allowed, `intruder` not."""

    def __init__(self, root: Path):
        self.manager_public, self.manager_secret = generate_keypair(root, "manager")
        self.allowed = root / "workers"
        self.secrets = {}
        for name in ("local", "second", "intruder"):
            public, secret = generate_keypair(root / "pairs", name)
            if name != "intruder":
                self.allowed.mkdir(exist_ok=True)
                public.rename(self.allowed / public.name)
            self.secrets[name] = secret

    def table(self) -> str:
        return f"""
[server.worker_curve]
secret_key = "{self.manager_secret}"
allowed_workers = "{self.allowed}"
worker_secret_key = "{self.secrets["local"]}"
manager_public_key = "{self.manager_public}"
"""


def workers(server) -> list[dict]:
    with server.client(timeout=10) as client:
        return client.health()["workers"]


def answer_some(server, config) -> None:
    """A burst of requests, every answer equal to the reference."""
    sequences = [list(range(start, start + 30)) for start in range(0, 900, 30)]

    async def send() -> list:
        async with AsyncClient(server.address, timeout=60) as client:
            return await asyncio.gather(*(client.infer("lstm", {"tokens": tokens}) for tokens in sequences))

    model = build_model(config.models["lstm"])
    state = model.load_weights()
    for tokens, reply in zip(sequences, asyncio.run(send())):
        assert np.abs(reply.outputs["h"] - model.reference(state, {"tokens": tokens})["h"]).max() <= TOLERANCE


def kernel_time(server, pid: int) -> float:
    """The time the worker has spent in its cells, as it reports it: with its tasks' notices (the manager's
    steps) or its answers (the worker's running batch), and its heartbeats. It grows only as the worker serves."""
    with server.client(timeout=10) as client:
        return next(w["kernel_busy_s"] for w in client.stats()["workers"].values() if w["pid"] == pid)


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_only_workers_with_an_allowed_key_register(tmp_path: Path, running_batch: str):
    """The server's own worker and the readiness checks use the config's worker key; a worker of another
    host with another allowed key registers and serves; one whose key is not allowed is refused at the
    handshake, says so and exits, and the server serves on undisturbed."""
    keys = Keys(tmp_path / "keys")
    address = f"tcp://127.0.0.3:{free_port()}"
    config = write_config(
        tmp_path, SMALL_LSTM, server=f'worker_address = "{address}"\n' + keys.table(),
        scheduler=f'running_batch = "{running_batch}"',
    )  # fmt: skip
    server = start_server(config, workers=1)
    second = None
    try:
        intruder = start_worker(
            config, address, "--curve", str(keys.secrets["intruder"]), str(keys.manager_public),
            "--host-id", "intruder-host", "--index", "7", stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _, stderr = intruder.communicate(timeout=120)
        assert intruder.returncode == 1, stderr
        assert "refused this worker's CURVE key" in stderr
        assert len(workers(server)) == 1
        answer_some(server, config)

        second = start_worker(
            config, address, "--curve", str(keys.secrets["second"]), str(keys.manager_public),
            "--host-id", "second-host", "--index", "8",
        )  # fmt: skip
        wait_until(lambda: len(workers(server)) == 2, "the allowed worker registering", interval=0.1)
        assert [w["local"] for w in workers(server) if w["pid"] == second.pid] == [False]
        registered = kernel_time(server, second.pid)  # its warm-up's
        # What it reports over its CURVE sockets (notices or answers) reaches the manager, its work with it.
        wait_until(lambda: answer_some(server, config) or kernel_time(server, second.pid) > registered,
                   "the allowed worker serving requests", interval=0)
    finally:
        stop_server(server)
        if second is not None:
            assert second.wait(timeout=30) == 0  # told to stop as the manager shut down


def with_server_lines(config, lines: str) -> Path:
    """The config's file with `lines` added at the end of its [server] table (TOML that load_config may refuse)."""
    config.path.write_text(config.path.read_text().replace("[scheduler]\n", f"{lines}\n[scheduler]\n", 1))
    return config.path


def missing_keys(**missing: str) -> str:
    """A [server.worker_curve] table naming key files, those in `missing` absent."""
    files = {"secret_key": "manager.key_secret", "allowed_workers": "workers", "worker_secret_key": "worker.key_secret",
             "manager_public_key": "manager.key", **missing}
    return "[server.worker_curve]\n" + "".join(f'{key} = "{value}"\n' for key, value in files.items())


def refusal(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('worker_address = "tcp://0.0.0.0:{port}"', "add a [server.worker_curve] table"),
        (missing_keys(worker_secret_key="absent.key_secret"), "absent.key_secret does not exist"),
    ],
)
def test_serve_refuses_worker_sockets_it_cannot_secure(tmp_path: Path, lines: str, message: str):
    """A worker address other machines reach, without worker keys or insecure_workers; worker keys
    that cannot be read: `batchmaker serve` stops with a configuration error before starting anything."""
    path = with_server_lines(write_config(tmp_path, SMALL_LSTM), lines.format(port=free_port()))
    process = refusal(["-m", "batchmaker.manager.commands.cli", "serve", str(path)])
    assert process.returncode == 2, process.stderr
    assert message in process.stderr


@pytest.mark.parametrize(
    ("lines", "address", "message"),
    [
        ("", "tcp://0.0.0.0:{port}", "insecure_workers = true"),
        (missing_keys(secret_key="absent.key_secret"), "tcp://127.0.0.4:{port}", "absent.key_secret does not exist"),
    ],
)
def test_the_manager_refuses_worker_sockets_it_cannot_secure(tmp_path: Path, lines: str, address: str, message: str):
    """The manager process checks the worker address it is given (not only the config's), and its own keys."""
    path = with_server_lines(write_config(tmp_path, SMALL_LSTM), lines)
    process = refusal(["-m", "manager", "--config", str(path), "--worker-address", address.format(port=free_port())])
    assert process.returncode == 2, process.stderr
    assert message in process.stderr
