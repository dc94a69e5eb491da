"""Forecast online: a long series sent in chunks, the GRU's state carried on the server between them.

    python examples/forecaster/stream.py [--address tcp://127.0.0.1:5555] [--length 600] [--chunk 50]

Each chunk is one request of a server-held session (docs/protocol.md, "Sessions"): the server starts
it from the final state the previous chunk left, so the client sends each reading once and keeps no
state. The last chunk sets `session_end`, which frees the state once answered. The forecast after the
last chunk equals that of one request holding the whole series; the script checks it and says so.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from batchmaker.clients import Client
from batchmaker.clients.messages import Reply
from examples.forecaster.forecast import forecast
from examples.forecaster.train import sensor_series

TOLERANCE = 1e-5  # float32: the chunked and the whole run sum in the same order, up to the batch they ran in


def forecast_in_chunks(client: Client, readings: np.ndarray, chunk: int, session: str,
                       model: str = "forecaster") -> list[Reply]:
    """One reply per chunk of `chunk` readings, in order; the session ends with the last."""
    starts = range(0, len(readings), chunk)
    return [
        client.infer(model, {"x": readings[start : start + chunk]}, session=session, session_end=start == starts[-1])
        for start in starts
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="tcp://127.0.0.1:5555")
    parser.add_argument("--length", type=int, default=600, help="readings in the whole series")
    parser.add_argument("--chunk", type=int, default=50, help="readings per request")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    readings, axis0 = sensor_series(np.random.default_rng(args.seed), args.length + 1)
    readings = readings[: args.length]
    with Client(args.address) as client:  # one address: a session lives on one server
        replies = forecast_in_chunks(client, readings, args.chunk, session=f"sensor-{uuid.uuid4().hex}")
        whole = forecast(client, readings)
    for reply, end in zip(replies, range(args.chunk, args.length + args.chunk, args.chunk)):
        print(f"after {min(end, args.length):5d} readings: next reading forecast {reply.outputs['logits'][0]:7.3f}")
    print(f"actual next reading {axis0[args.length]:7.3f}")
    difference = float(np.abs(replies[-1].outputs["logits"] - whole).max())
    same = difference <= TOLERANCE
    print(f"chunked and whole-series forecasts {'agree' if same else 'DIFFER'} (max abs difference {difference:.1e})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
