"""Ask the served forecaster for the next readings of a freshly drawn sensor series.

    python examples/forecaster/forecast.py [--address tcp://127.0.0.1:5555] [--length 48] [--seed 7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from batchmaker.clients import Client
from examples.forecaster.train import sensor_series


def forecast(client: Client, readings: np.ndarray, model: str = "forecaster") -> np.ndarray:
    """The next readings of axis 0: the head's `logits` on the GRU's final state, for `x` = readings [T, F]."""
    return client.infer(model, {"x": readings.astype(np.float32)}).outputs["logits"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="tcp://127.0.0.1:5555")
    parser.add_argument("--length", type=int, default=48, help="readings sent")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    readings, axis0 = sensor_series(np.random.default_rng(args.seed), 2 * args.length)
    with Client(args.address) as client:
        predicted = forecast(client, readings[: args.length])
    future = axis0[args.length :]
    print("step  forecast  actual")
    for step, (guess, actual) in enumerate(zip(predicted, future), start=1):
        print(f"{step:4d}  {guess:8.3f}  {actual:6.3f}")


if __name__ == "__main__":
    main()
