"""The demo behind ./scripts/demo: serve the default config, load it, check it, stop it.

Starts `batchmaker serve` on configs/default.toml, sends Poisson arrivals of real
English sentences (data/wmt16-ende/sample.en) for about 20 s from a client with the
library's defaults (a request refused OVERLOADED is sent again after a backoff, within
the call's timeout, as a user's client would), checks a random sample of replies
against the unbatched reference model, prints throughput, latency, queueing vs compute
time, batch sizes, refusals and resends beside the numbers the results page's JSON
holds for the same model (docs/benchmarks/, and whether they were measured on this
machine), then stops the server and checks that none of its processes is left.

It fails only where the server broke a promise: an answer that differs from the
reference model, a request that got no answer (a refusal is an answer: the server
keeping its promise under load), or a process left behind; its last line says which.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchmaker.bench import yardstick
from batchmaker.clients import AsyncClient, Client
from batchmaker.clients.loadgen import Sample, percentiles, send_open_loop, summarize
from batchmaker.clients.text import Vocabulary, load_sentences
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model
from batchmaker.common.protocol import OVERLOADED
from batchmaker.manager.commands.launcher import launch, stop_server, wait_until_ready

TOLERANCE = 1e-5
STATS_TIMEOUT_S = 10  # for the server's stats after the load


@dataclass
class Load:
    """The demo's requests, and what its client counted while sending them."""

    samples: list[Sample]
    retries: int  # resends after a backoff, of requests refused OVERLOADED
    resent: int  # requests sent to another server (none with one address)


async def send_load(address: str, inputs: list[dict[str, Any]], rate: float, duration: float, seed: int) -> Load:
    """Request n at the n-th Poisson arrival (`rate` a second, for `duration` s) with the n-th input of a seeded
    shuffle; latency counts from the arrival, so a slow server cannot hide its queueing."""
    async with AsyncClient(address) as client:  # the library's defaults: refusals are resent
        samples = await send_open_loop(client, "lstm", inputs, rate, duration, seed)
        return Load(samples, client.retries, client.resent)


def server_stats(address: str) -> dict[str, Any] | None:
    """The server's `stats`, or None when it does not answer them (its failure shows in the requests' outcomes)."""
    try:
        with Client(address, timeout=STATS_TIMEOUT_S) as client:
            return client.stats()
    except (TimeoutError, ConnectionError):
        return None


def verify(
    samples: list[Sample], inputs: list[dict[str, Any]], config_path: Path, count: int, seed: int
) -> tuple[int, int, float]:
    """Compare `count` random successful replies with the reference model: (checked, differing, max error)."""
    model = build_model(load_config(config_path).models["lstm"])
    state = model.load_weights()
    answered = [s for s in samples if s.error is None]
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(answered), size=min(count, len(answered)), replace=False)
    differing, worst = 0, 0.0
    for i in chosen:
        sample = answered[int(i)]
        expected = model.reference(state, inputs[sample.index])
        error = max(float(np.abs(sample.outputs[name] - value).max()) for name, value in expected.items())
        differing += error > TOLERANCE
        worst = max(worst, error)
    return len(chosen), differing, worst


def codes(errors: Counter[str]) -> str:
    return ", ".join(f"{code} {n}" for code, n in errors.most_common())


def failures(
    answered: int, lost: Counter[str], checked: int, differing: int, worst: float, leftovers: list[int]
) -> list[str]:
    """Why the demo fails, if it does: the promises the server broke."""
    reasons = []
    if differing:
        reasons.append(
            f"{differing} answer{'s' if differing > 1 else ''} of {checked} checked differ from the reference model "
            f"(max abs error {worst:.2e}, tolerance {TOLERANCE:.0e})"
        )
    if lost:
        count = sum(lost.values())
        reasons.append(f"{count} request{'s' if count > 1 else ''} got no answer ({codes(lost)})")
    elif not answered:
        reasons.append("every request was refused, so no answer could be checked")
    if leftovers:
        pids = ", ".join(map(str, leftovers))
        reasons.append(f"{len(leftovers)} of the server's processes left running (pid {pids})")
    return reasons


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.toml")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load (default: %(default)s)")
    parser.add_argument("--verify", type=int, default=200, help="replies checked against the reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--address", help="the server's client address (default: the config's, tcp://127.0.0.1:5555)")
    parser.add_argument(
        "--reference",
        type=Path,
        default=ROOT / "docs" / "benchmarks",
        help="the benchmark JSON to compare with (default: the results page's, docs/benchmarks)",
    )
    args = parser.parse_args()
    if not (args.rate > 0 and args.duration > 0 and args.verify >= 0):
        parser.error(f"--rate and --duration must be above 0 and --verify 0 or more, got {args.rate:g}, "
                     f"{args.duration:g} and {args.verify}")

    config = load_config(args.config)
    address = args.address or config.server.address
    vocabulary = Vocabulary()
    max_length = config.models["lstm"].params.get("max_length", 400)
    inputs = [{"tokens": vocabulary.encode(s)[:max_length]} for s in load_sentences()]

    # The server's log: open while it runs, kept afterwards.
    log = tempfile.NamedTemporaryFile(prefix="batchmaker-demo-", suffix=".log", delete=False)  # noqa: SIM115
    print(f"starting the server on {address} (log: {log.name})", flush=True)
    server = launch(args.config, log, *(("--address", address) if args.address else ()))
    try:
        wait_until_ready(address, server, timeout=120)
        print(f"sending {args.rate:.0f} requests/s (Poisson) for {args.duration:.0f} s ...", flush=True)
        load = asyncio.run(send_load(address, inputs, args.rate, args.duration, args.seed))
        stats = server_stats(address)
    finally:
        leftovers = stop_server(server)

    samples = load.samples
    summary = summarize(samples)
    refused = summary["errors"].get(OVERLOADED, 0)
    lost = Counter({code: n for code, n in summary["errors"].items() if code != OVERLOADED})
    checked, differing, worst = verify(samples, inputs, args.config, args.verify, args.seed)
    lengths = [len(inputs[s.index]["tokens"]) for s in samples]
    print()
    print(f"requests        {summary['requests']} sent: {summary['ok']} answered, {refused} refused to the end "
          f"(OVERLOADED), {sum(lost.values())} with no answer{f' ({codes(lost)})' if lost else ''}")
    print(f"resends         {load.retries} after a refusal and a backoff (client.retries), "
          f"{load.resent} to another server (client.resent)")
    print(f"lengths         mean {np.mean(lengths):.1f} tokens, max {max(lengths)}")
    print(f"throughput      {summary['throughput_rps']:.1f} requests/s")
    late = percentiles([(s.sent - s.scheduled) * 1e3 for s in samples])
    print(f"sent late (ms)  p50 {late['p50']:.2f}  p99 {late['p99']:.2f}: this client's delay behind the arrival "
          "times, from which latency counts")
    lat, queue, compute = summary["latency_ms"], summary["queue_ms"], summary["compute_ms"]
    print(f"latency (ms)    p50 {lat['p50']:.2f}  p90 {lat['p90']:.2f}  p99 {lat['p99']:.2f}")
    print(f"queueing (ms)   p50 {queue['p50']:.2f}  p90 {queue['p90']:.2f}  p99 {queue['p99']:.2f}")
    print(f"compute (ms)    p50 {compute['p50']:.2f}  p90 {compute['p90']:.2f}  p99 {compute['p99']:.2f}")
    if stats is None:
        print(f"server stats    none: the server did not answer `stats` within {STATS_TIMEOUT_S} s")
    else:
        if stats["running_batch"] == "worker":
            print(f"mean batch size {stats['mean_batch_size']:.1f} cells per step over {stats['steps']} steps, "
                  "each decided by the worker running it")
            print(f"cellular        {stats['leaving_requests']} requests left while older ones still ran")
        else:
            print(f"mean batch size {stats['mean_batch_size']:.1f} cells per task over {stats['tasks']} tasks")
            print(f"cellular        {stats['joining_tasks']} tasks joined new requests to running ones; "
                  f"{stats['leaving_requests']} requests left while older ones still ran")
    for line in yardstick.lines(args.reference, args.rate, config.models["lstm"].params):
        print(line)
    print(f"verified        {checked} replies against the reference model, {differing} differ, "
          f"max abs error {worst:.2e}")
    print(f"shutdown        {'clean, no process left' if not leftovers else f'processes left: {leftovers}'}")
    print(f"server log      {log.name}")
    reasons = failures(summary["ok"], lost, checked, differing, worst, leftovers)
    if reasons:
        print(f"DEMO FAILED: {'; '.join(reasons)}")
        return 1
    print("DEMO PASSED: every answer checked is the reference model's, every request was answered or refused, "
          "no process is left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
