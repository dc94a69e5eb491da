"""Soak test behind ./scripts/soak: hours of traffic in minutes, looking for leaks and lost requests.

Serves small LSTM, Seq2Seq and Child-Sum models on 2 CPU workers and, for
`--duration` seconds, mixes Poisson traffic to all three with malformed requests,
cancelled long requests and one SIGKILLed worker half-way through. It then checks
that every request was answered (results, or the error its kind calls for), that
no arena slot is held, and prints the manager's and workers' resident memory
sampled over the run, so a leak shows as growth between the first and last minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchmaker.clients import AsyncClient, Client, ServerError
from batchmaker.common.config import load_config
from batchmaker.common.models import init_missing_weights
from batchmaker.manager.commands.supervisor import Supervisor

MODELS = """
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
vocab_size = 1000
hidden_size = 64
max_length = 200
batch_sizes = [1, 2, 4, 8, 16, 32]

[models.seq2seq]
builder = "batchmaker.common.models.seq2seq:build"
weights = "seq2seq.pt"
src_vocab_size = 1000
tgt_vocab_size = 40
hidden_size = 64
max_decode_length = 60
batch_sizes = [1, 2, 4, 8, 16, 32]

[models.seq2seq.cells.decoder]
priority = 1

[models.childsum]
builder = "batchmaker.common.models.childsum:build"
weights = "childsum.pt"
vocab_size = 1000
hidden_size = 64
batch_sizes = [1, 2, 4, 8, 16, 32]
"""

BAD_REQUESTS = [
    ({"model": "lstm", "inputs": {"tokens": []}}, "INVALID_INPUT"),
    ({"model": "lstm", "inputs": {"tokens": [5000]}}, "INVALID_INPUT"),
    ({"model": "nope", "inputs": {"tokens": [1]}}, "UNKNOWN_MODEL"),
    ({"model": "lstm"}, "BAD_REQUEST"),
    ({"model": "childsum", "inputs": {"tree": {"tokens": [1, 2], "parents": [1, 0]}}}, "INVALID_INPUT"),
]


def random_tree(rng: np.random.Generator) -> dict:
    size = int(rng.integers(1, 30))
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, size)]
    tokens = [int(t) for t in rng.integers(0, 1000, size=size)]
    return {"tree": {"tokens": tokens, "parents": parents}}


def good_request(rng: np.random.Generator) -> tuple[str, dict]:
    kind = rng.choice(["lstm", "seq2seq", "childsum"])
    if kind == "childsum":
        return "childsum", random_tree(rng)
    return str(kind), {"tokens": rng.integers(0, 1000, size=int(rng.integers(1, 60))).tolist()}


async def drive(address: str, duration: float, rate: float, kill_worker) -> Counter:
    rng = np.random.default_rng(0)
    outcomes: Counter = Counter()
    async with AsyncClient(address, timeout=120) as client:

        async def expect(message: dict, allowed: set[str]) -> None:
            try:
                await client.call(message)
                outcome = "ok"
            except ServerError as exc:
                outcome = exc.code
            except TimeoutError:
                outcome = "LOST"
            outcomes[outcome if outcome in allowed else f"unexpected {outcome}"] += 1

        async def cancelled_long(request_id: str) -> None:
            message = {"id": request_id, "model": "lstm", "inputs": {"tokens": [7] * 200}}
            task = asyncio.create_task(expect(message, {"CANCELLED", "ok"}))
            await asyncio.sleep(0.005)
            await client.cancel(request_id)
            await task

        pending, start, n, killed = [], time.monotonic(), 0, False
        while time.monotonic() - start < duration:
            n += 1
            if n % 25 == 0:
                message, wanted = BAD_REQUESTS[n // 25 % len(BAD_REQUESTS)]
                pending.append(asyncio.create_task(expect(dict(message), {wanted})))
            elif n % 40 == 0:
                pending.append(asyncio.create_task(cancelled_long(f"long-{n}")))
            else:
                model, inputs = good_request(rng)
                pending.append(asyncio.create_task(expect({"model": model, "inputs": inputs}, {"ok"})))
            if not killed and time.monotonic() - start > duration / 2:
                kill_worker()
                killed = True
            if len(pending) > 5000:
                await asyncio.gather(*pending)
                pending = []
            await asyncio.sleep(float(rng.exponential(1 / rate)))
        await asyncio.gather(*pending)
    return outcomes


def rss_mb(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second (default: %(default)s)")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="batchmaker-soak-"))
    port = 20000 + os.getpid() % 20000
    (directory / "config.toml").write_text(
        textwrap.dedent(f"""
        [server]
        address = "tcp://127.0.0.1:{port}"
        cpu_workers = 2
        """) + MODELS
    )
    config = load_config(directory / "config.toml")
    init_missing_weights(config)
    supervisor = Supervisor(config)
    supervisor.start()
    samples: list[tuple[float, float, list[float]]] = []
    try:
        if not supervisor.wait_ready():
            print("the server did not start", file=sys.stderr)
            return 1
        watcher = threading.Thread(target=supervisor.watch, daemon=True)
        watcher.start()
        stop_sampling = threading.Event()

        def sample() -> None:
            started = time.monotonic()
            while not stop_sampling.wait(5.0):
                workers = [rss_mb(p.pid) for p in supervisor.workers]
                samples.append((time.monotonic() - started, rss_mb(supervisor.manager.pid), workers))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def kill_worker() -> None:
            victim = supervisor.workers[0].pid
            print(f"killing worker pid {victim}", flush=True)
            os.kill(victim, signal.SIGKILL)

        outcomes = asyncio.run(drive(supervisor.address, args.duration, args.rate, kill_worker))
        stop_sampling.set()
        time.sleep(1.0)
        with Client(supervisor.address) as client:
            stats = client.stats()
    finally:
        supervisor.request_stop()
        supervisor.stop()

    unexpected = {k: v for k, v in outcomes.items() if k.startswith("unexpected")}
    print(f"outcomes: {dict(outcomes)}")
    print(f"worker losses: {stats['worker_losses']}, replayed requests: {stats['replayed_requests']}")
    slots = {w: s["slots_in_use"] for w, s in stats["workers"].items()}
    print(f"slots in use after the run: {slots}")
    third = max(1, len(samples) // 3)
    first, last = samples[:third], samples[-third:]
    print("RSS (MB)             first third   last third")
    print(f"  manager            {np.mean([m for _, m, _ in first]):10.1f}   {np.mean([m for _, m, _ in last]):10.1f}")
    for i in range(len(samples[0][2]) if samples else 0):
        print(
            f"  worker {i}           {np.nanmean([w[i] for _, _, w in first]):10.1f}   "
            f"{np.nanmean([w[i] for _, _, w in last]):10.1f}"
        )
    failed = bool(unexpected) or any(slots.values())
    print("SOAK FAILED" if failed else "soak passed: every request answered as expected, no slot held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
