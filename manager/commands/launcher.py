"""Run `batchmaker serve` as a child process, wait until it is ready, and stop it cleanly:
what the demo, the benchmarks and the tests of several servers do around their load."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import psutil

from batchmaker.clients import Client

# The module each process runs with -m -> its role.
ROLES = {
    "batchmaker.manager.commands.cli": "supervisor",
    "batchmaker.manager": "manager",
    "batchmaker.worker": "worker",
    "batchmaker.frontdoor": "frontdoor",
}


def launch(config: Path, log: IO | int | None, *options: str) -> subprocess.Popen:
    """Start the server on `config` with its output going to `log` (a file, subprocess.DEVNULL, or None: ours)."""
    return subprocess.Popen(
        [sys.executable, "-m", "batchmaker.manager.commands.cli", "serve", str(config), *options],
        stdout=log,
        stderr=subprocess.STDOUT,
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


def roles(server: subprocess.Popen) -> dict[int, str]:
    """The server's processes by pid: "supervisor", "manager" or "worker" (from the module each runs)."""
    try:
        root = psutil.Process(server.pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    found = {}
    for process in processes:
        try:
            command = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        if len(command) > 2 and command[1] == "-m" and command[2] in ROLES:
            found[process.pid] = ROLES[command[2]]
    return found


def cpu_seconds(pids: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user and system) used so far by these processes, summed by their role; one gone counts nothing."""
    used: dict[str, float] = {}
    for pid, role in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        used[role] = used.get(role, 0.0) + times.user + times.system
    return used


def free_port_on(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`batchmaker serve` with one CPU worker on an address of its own (e.g. 127.0.0.2, 127.0.0.3: loopback
    addresses standing for hosts), so that one client can be pointed at several servers and one of them
    killed or drained. `port` (default: a free one) lets a replacement take the address of one that stopped."""

    def __init__(self, config: Path, host: str, log: IO | int | None, port: int | None = None):
        self.host = host
        self.address = f"tcp://{host}:{port or free_port_on(host)}"
        self.process = launch(config, log, "--address", self.address, "--workers", "1")

    def wait_ready(self, timeout: float = 120.0) -> None:
        wait_until_ready(self.address, self.process, timeout)

    def processes(self) -> list[psutil.Process]:
        """The supervisor and all its descendants (manager, workers)."""
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_all(self) -> None:
        """SIGKILL the supervisor and every child at once, like a host that loses power."""
        for process in self.processes():
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(10)

    def stop(self) -> list[int]:
        """Stop it (draining) if it still runs; the pids of its processes left alive afterwards."""
        return stop_server(self.process)
