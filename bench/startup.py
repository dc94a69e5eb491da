"""`./scripts/bench startup`: how long the manager takes to start, and the memory each process holds.

The manager alone (`python -m batchmaker.manager`, no worker) is started on the ceiling's four built-in
models, and timed from its launch to its first answer (the `models` op, sent as it starts):
loading the config, building the planners and binding its sockets. Its resident memory is read
at that answer. Then a whole server (`batchmaker serve`, one CPU worker) is started and, once
ready, the resident memory of its supervisor, manager and worker is read. Every start is run
several times and the median reported, with the range.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil
import zmq

from batchmaker.bench.ceiling import MODELS
from batchmaker.bench.run import ROOT, git, machine
from batchmaker.common.config import load_config
from batchmaker.common.models import init_missing_weights
from batchmaker.manager.commands.launcher import ServerProcess, free_port_on, roles

MB = 2**20
ROLES = ("supervisor", "manager", "worker")


def manager_alone(config: Path, address: str) -> tuple[float, int]:
    """Seconds from the manager's launch to its first answer, and its resident bytes then."""
    worker_address = f"tcp://127.0.0.1:{free_port_on('127.0.0.1')}"
    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, 2)  # retry the connection every 2 ms until the manager binds
        socket.connect(address)
        start = time.perf_counter()
        command = [sys.executable, "-m", "batchmaker.manager", "--config", str(config), "--worker-address",
                   worker_address, "--running-batch", "manager"]  # as `batchmaker serve` starts it for one CPU worker
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        try:
            socket.send(msgpack.packb({"id": 1, "op": "models"}))
            if not socket.poll(120_000):
                raise SystemExit("the manager did not answer within 120 s of its launch")
            seconds = time.perf_counter() - start
            reply = msgpack.unpackb(socket.recv(), raw=False)
            if not reply.get("ok"):
                raise SystemExit(f"the manager refused the models op: {reply}")
            rss = psutil.Process(process.pid).memory_info().rss
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(30)
    return seconds, rss


def served(config: Path) -> dict[str, int]:
    """Resident bytes of each process of a whole server (one CPU worker) once it is ready."""
    server = ServerProcess(config, "127.0.0.1", subprocess.DEVNULL)
    try:
        server.wait_ready()
        return {role: psutil.Process(pid).memory_info().rss for pid, role in roles(server.process).items()}
    finally:
        server.stop()


def _spread(values: list[float]) -> dict[str, Any]:
    return {"runs": values, "median": float(np.median(values)), "min": min(values), "max": max(values)}


def run(quick: bool) -> dict[str, Any]:
    starts, servers = (3, 1) if quick else (7, 3)
    with tempfile.TemporaryDirectory(prefix="batchmaker-startup-") as tmp:
        address = f"tcp://127.0.0.1:{free_port_on('127.0.0.1')}"
        config_path = Path(tmp) / "startup.toml"
        config_path.write_text(
            f'[server]\naddress = "{address}"\ncpu_workers = 1\n' + MODELS.replace("{weights}", str(ROOT / "weights"))
        )
        init_missing_weights(load_config(config_path))
        alone = [manager_alone(config_path, address) for _ in range(starts)]
        whole = [served(config_path) for _ in range(servers)]
    return {
        "preset": "startup",
        "quick": quick,
        "commit": git("rev-parse", "HEAD"),
        "describe": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "manager_start_s": _spread([seconds for seconds, _ in alone]),
        "manager_alone_rss_mb": _spread([rss / MB for _, rss in alone]),
        "served_rss_mb": {role: _spread([sizes[role] / MB for sizes in whole]) for role in ROLES},
    }


def table(result: dict[str, Any]) -> str:
    def cell(spread: dict[str, Any], digits: int) -> str:
        return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f} to {spread['max']:.{digits}f})"

    start, rss = result["manager_start_s"], result["manager_alone_rss_mb"]
    servers = len(result["served_rss_mb"]["manager"]["runs"])
    lines = [
        f"startup at {result['describe']}: medians of {len(start['runs'])} manager starts and {servers} whole servers",
        "| measure | median (range) |",
        "|---|---|",
        f"| manager alone: launch to first answer, s | {cell(start, 2)} |",
        f"| manager alone: resident memory, MB | {cell(rss, 0)} |",
    ]
    for role, spread in result["served_rss_mb"].items():
        lines.append(f"| served, {role}: resident memory, MB | {cell(spread, 0)} |")
    return "\n".join(lines)


def main(quick: bool, out: Path) -> None:
    result = run(quick)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps(result, indent=1))
    print(table(result))
