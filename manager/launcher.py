"""Run `batchmaker serve` as a child process, wait until it is ready, and stop it cleanly:
what the demo and the benchmarks do around their load."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import psutil

from clients import Client


def launch(config: Path, log: IO, *options: str) -> subprocess.Popen:
    """Start the server on `config` with its output going to `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "serve", str(config), *options], stdout=log, stderr=subprocess.STDOUT
    )


def wait_until_ready(address: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with Client(address, timeout=1.0) as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with status {server.returncode} before becoming ready")
            try:
                if client.health()["status"] == "ready":
                    return
            except TimeoutError:
                pass
            time.sleep(0.3)
    raise SystemExit(f"the server did not become ready within {timeout:.0f} s")


def stop_server(server: subprocess.Popen) -> list[int]:
    """SIGINT the server (like Ctrl-C) and return the pids of its processes still alive afterwards."""
    try:
        tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    _, alive = psutil.wait_procs(tree, timeout=10)
    return [p.pid for p in alive]
