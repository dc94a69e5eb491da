"""Measure what a worker started by hand adds: throughput and latency before and after it joins.

Serves an LSTM (hidden size from --hidden) on one CPU worker with an explicit worker
address, offers open-loop Poisson load above capacity for --duration seconds, then
starts `batchmaker worker` by hand, waits for it to register, and offers the same load
again. On a machine with few cores a second CPU worker only helps when the cell's
compute, not the manager, is what saturates: try a large --hidden there.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchmaker.clients import Client
from batchmaker.clients.loadgen import run_open_loop, summarize
from batchmaker.common.config import load_config
from batchmaker.common.models import init_missing_weights
from batchmaker.manager.commands.supervisor import Supervisor


def offer(address: str, inputs: list[dict], rate: float, duration: float) -> str:
    summary = summarize(asyncio.run(run_open_loop(address, "lstm", inputs, rate, duration, keep_outputs=False)))
    latency = summary["latency_ms"]
    return f"{summary['throughput_rps']:7.1f} req/s, latency p50 {latency['p50']:8.1f} ms, p90 {latency['p90']:8.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024, help="LSTM hidden size (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=300.0, help="offered requests/s (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per phase")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="batchmaker-join-"))
    worker_address = f"ipc://{directory}/workers"
    (directory / "config.toml").write_text(
        textwrap.dedent(f"""
        [server]
        address = "tcp://127.0.0.1:{5600 + args.hidden % 97}"
        worker_address = "{worker_address}"
        cpu_workers = 1

        [models.lstm]
        builder = "batchmaker.common.models.lstm:build"
        weights = "lstm.pt"
        vocab_size = 1000
        embedding_size = 256
        hidden_size = {args.hidden}
        batch_sizes = [1, 2, 4, 8, 16, 32, 64]
        """)
    )
    config = load_config(directory / "config.toml")
    init_missing_weights(config)
    rng = np.random.default_rng(0)
    inputs = [{"tokens": rng.integers(0, 1000, size=int(n)).tolist()} for n in rng.integers(5, 45, size=2000)]

    supervisor = Supervisor(config)
    supervisor.start()
    joined = None
    try:
        if not supervisor.wait_ready():
            return 1
        threading.Thread(target=supervisor.watch, daemon=True).start()
        print(f"1 worker : {offer(supervisor.address, inputs, args.rate, args.duration)}", flush=True)
        joined = subprocess.Popen(
            [sys.executable, "-m", "batchmaker.manager.commands.cli", "worker", "--config", str(config.path),
             "--manager", worker_address, "--index", "1"],
            cwd=ROOT,
        )  # fmt: skip
        with Client(supervisor.address) as client:
            while len(client.health()["workers"]) < 2:
                time.sleep(0.2)
        print(f"2 workers: {offer(supervisor.address, inputs, args.rate, args.duration)}", flush=True)
        with Client(supervisor.address) as client:
            delays = [w["first_task_delay_ms"] for w in client.stats()["workers"].values()]
        print(f"first task after registration (ms): {', '.join(f'{d:.1f}' for d in delays)}")
    finally:
        supervisor.request_stop()
        supervisor.stop()
        if joined is not None:
            joined.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
