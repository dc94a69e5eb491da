"""Overload benchmark behind ./scripts/overload: latency when offered several times what the server can do.

Serves a small LSTM on one CPU worker with an admission limit (`max_queued_requests`),
measures its capacity with a closed burst, then offers `--factor` times that rate
(open loop, Poisson) for `--duration` seconds, and prints:

* accepted requests' latency from their send, against the bound the admission limit implies
  (at most `limit` requests ahead, each served at capacity: limit / capacity);
* refused requests' latency (refusals skip the queue, so they should be far quicker);
* the latency of one request sent once the overload has passed (recovery).

The tests check the behaviour behind these numbers without clocks (tests/test_hardening.py);
the numbers themselves depend on the machine, so they are measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients import AsyncClient, Client
from clients.loadgen import percentiles, run_open_loop
from common.config import load_config
from common.models import init_missing_weights
from manager.launcher import launch, stop_server, wait_until_ready

CONFIG = """
[server]
address = "tcp://127.0.0.1:{port}"
cpu_workers = 1
max_queued_requests = {limit}

[models.lstm]
builder = "common.models.lstm:build"
weights = "lstm.pt"
vocab_size = 1000
embedding_size = 32
hidden_size = 64
max_length = 200
batch_sizes = [1, 2, 4, 8, 16, 32]
"""


async def capacity(address: str, inputs: list[dict]) -> float:
    """Requests per second of a closed burst of all `inputs` at once."""
    async with AsyncClient(address, timeout=120) as client:
        start = time.monotonic()
        await asyncio.gather(*(client.infer("lstm", i) for i in inputs))
        return len(inputs) / (time.monotonic() - start)


def show(values: list[float]) -> str:
    return ", ".join(f"{name} {value:.1f}" for name, value in percentiles(values).items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overload", description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=48, help="max_queued_requests (default 48)")
    parser.add_argument("--factor", type=float, default=3.0, help="offered load over capacity (default 3)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of overload (default 20)")
    parser.add_argument("--port", type=int, default=5571)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(1)
    inputs = [{"tokens": rng.integers(0, 1000, size=int(n)).tolist()} for n in rng.integers(20, 60, size=400)]
    with tempfile.TemporaryDirectory(prefix="batchmaker-overload-") as folder:
        path = Path(folder) / "config.toml"
        path.write_text(CONFIG.format(port=args.port, limit=args.limit))
        config = load_config(path)
        init_missing_weights(config)
        address = config.server.address
        with open(Path(folder) / "server.log", "w") as log:
            server = launch(path, log)
            try:
                wait_until_ready(address, server, timeout=120)
                rate = asyncio.run(capacity(address, inputs[:40]))
                print(f"capacity {rate:.0f} req/s; offering {args.factor * rate:.0f} req/s for {args.duration:.0f} s")
                samples = asyncio.run(
                    run_open_loop(address, "lstm", inputs, args.factor * rate, args.duration, keep_outputs=False)
                )
                with Client(address, timeout=60) as client:
                    start = time.monotonic()
                    client.infer("lstm", inputs[0])
                    recovery = time.monotonic() - start
            finally:
                stop_server(server)
    # From the actual send: at several times capacity the load generator itself falls behind its schedule.
    accepted = [(s.received - s.sent) * 1e3 for s in samples if s.error is None]
    refused = [(s.received - s.sent) * 1e3 for s in samples if s.error == "OVERLOADED"]
    lag = [(s.sent - s.scheduled) * 1e3 for s in samples]
    others = len(samples) - len(accepted) - len(refused)
    print(f"accepted {len(accepted)}: latency ms {show(accepted)}; "
          f"admission bound {args.limit / rate * 1e3:.0f} ms of queueing")
    print(f"refused  {len(refused)}: latency ms {show(refused)}")
    print(f"load generator behind its schedule, ms: {show(lag)}")
    print(f"other errors {others}; one request after the overload: {recovery * 1e3:.1f} ms")
    return 0 if others == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
