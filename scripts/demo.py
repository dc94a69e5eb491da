"""The demo behind ./scripts/demo: serve the default config, load it, check it, stop it.

Starts `batchmaker serve` on configs/default.toml, sends Poisson arrivals of real
English sentences (data/wmt16-ende/sample.en) for about 20 s, checks a random
sample of replies against the unbatched reference model, prints throughput,
latency, queueing vs compute time and batch sizes beside the numbers the results
page's JSON holds for the same model (docs/benchmarks/, and whether they were measured
on this machine), then stops the server and checks that none of its processes is left.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchmaker.bench import yardstick
from batchmaker.clients import Client
from batchmaker.clients.loadgen import run_open_loop, summarize
from batchmaker.clients.text import Vocabulary, load_sentences
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model
from batchmaker.manager.commands.launcher import launch, stop_server, wait_until_ready

TOLERANCE = 1e-5


def verify(samples, inputs, config_path: Path, count: int, seed: int) -> tuple[int, float]:
    """Compare `count` random successful replies with the reference model; returns (checked, max error)."""
    model = build_model(load_config(config_path).models["lstm"])
    state = model.load_weights()
    answered = [s for s in samples if s.error is None]
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(answered), size=min(count, len(answered)), replace=False)
    worst = 0.0
    for i in chosen:
        sample = answered[int(i)]
        expected = model.reference(state, inputs[sample.index])
        for name, value in expected.items():
            worst = max(worst, float(np.abs(sample.outputs[name] - value).max()))
    return len(chosen), worst


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

    config = load_config(args.config)
    address = args.address or config.server.address
    vocabulary = Vocabulary()
    max_length = config.models["lstm"].params.get("max_length", 400)
    inputs = [{"tokens": vocabulary.encode(s)[:max_length]} for s in load_sentences()]

    # The server's log: open while it runs, kept afterwards.
    log = tempfile.NamedTemporaryFile(prefix="batchmaker-demo-", suffix=".log", delete=False)  # noqa: SIM115
    print(f"starting the server on {address} (log: {log.name})")
    server = launch(args.config, log, *(("--address", address) if args.address else ()))
    try:
        wait_until_ready(address, server, timeout=120)
        print(f"sending {args.rate:.0f} requests/s (Poisson) for {args.duration:.0f} s ...")
        samples = asyncio.run(run_open_loop(address, "lstm", inputs, args.rate, args.duration, seed=args.seed))
        with Client(address) as client:
            stats = client.stats()
    finally:
        leftovers = stop_server(server)

    summary = summarize(samples)
    checked, worst = verify(samples, inputs, args.config, args.verify, args.seed)
    lengths = [len(inputs[s.index]["tokens"]) for s in samples]
    print()
    print(f"requests        {summary['requests']} sent, {summary['ok']} answered, errors {summary['errors'] or 'none'}")
    print(f"lengths         mean {np.mean(lengths):.1f} tokens, max {max(lengths)}")
    print(f"throughput      {summary['throughput_rps']:.1f} requests/s")
    lat, queue, compute = summary["latency_ms"], summary["queue_ms"], summary["compute_ms"]
    print(f"latency (ms)    p50 {lat['p50']:.2f}  p90 {lat['p90']:.2f}  p99 {lat['p99']:.2f}")
    print(f"queueing (ms)   p50 {queue['p50']:.2f}  p90 {queue['p90']:.2f}  p99 {queue['p99']:.2f}")
    print(f"compute (ms)    p50 {compute['p50']:.2f}  p90 {compute['p90']:.2f}  p99 {compute['p99']:.2f}")
    print(f"mean batch size {stats['mean_batch_size']:.1f} cells per task over {stats['tasks']} tasks")
    print(f"cellular        {stats['joining_tasks']} tasks joined new requests to running ones; "
          f"{stats['leaving_requests']} requests left while older ones still ran")
    for line in yardstick.lines(args.reference, args.rate, config.models["lstm"].params):
        print(line)
    print(f"verified        {checked} replies against the reference model, max abs error {worst:.2e}")
    print(f"shutdown        {'clean, no process left' if not leftovers else f'processes left: {leftovers}'}")
    print(f"server log      {log.name}")
    failed = worst > TOLERANCE or summary["ok"] != summary["requests"] or leftovers
    if failed:
        print("DEMO FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
