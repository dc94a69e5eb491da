"""Train the example forecaster: a GRU over float feature vectors and a Linear head, in seconds on a CPU.

    python examples/forecaster/train.py [--steps 200] [--seed 0] [--config examples/forecaster/forecaster.toml]

The task, synthetic: a sensor with two axes reads a noisy rotation, (A sin(wt + p), A cos(wt + p)) plus
Gaussian noise, with the amplitude A, angular speed w and phase p drawn per series. Given a window of
readings (`x`, float32 [T, 2]), the forecaster predicts the next HORIZON noise-free readings of axis 0
from the GRU's final state. The sizes come from the config's [models.forecaster] table (`input_size`,
`hidden_size`, `head_size` = HORIZON); the state dict is written to the file its `weights` names, with
the names the server reads (gru.weight_ih_l0, ..., head.weight, head.bias).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from batchmaker.common.config import ModelConfig
from examples.training import command_line, fit, save

CONFIG = Path(__file__).with_name("forecaster.toml")
NOISE = 0.05
WINDOWS = (16, 64)  # training windows' lengths are drawn from this range
BATCH = 32


def sensor_series(rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(noisy readings [length, 2], noise-free axis 0 [length]) of one randomly drawn rotation."""
    amplitude, speed, phase = rng.uniform(0.5, 1.5), rng.uniform(0.1, 0.5), rng.uniform(0, 2 * np.pi)
    angle = speed * np.arange(length) + phase
    clean = amplitude * np.stack([np.sin(angle), np.cos(angle)], axis=1)
    noisy = clean + rng.normal(0, NOISE, clean.shape)
    return noisy.astype(np.float32), clean[:, 0].astype(np.float32)


def window(rng: np.random.Generator, length: int, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """(readings [length, 2], the next `horizon` noise-free axis-0 values)."""
    readings, axis0 = sensor_series(rng, length + horizon)
    return readings[:length], axis0[length:]


class Forecaster(nn.Module):
    """The served layout: attribute names are the state dict's prefixes the chain GRU reads."""

    def __init__(self, input_size: int, hidden_size: int, horizon: int):
        super().__init__()
        self.gru = nn.GRU(input_size, hidden_size)
        self.head = nn.Linear(hidden_size, horizon)

    def forward(self, windows: list[torch.Tensor]) -> torch.Tensor:
        """The forecast [len(windows), horizon] from each window's final state."""
        _, h_n = self.gru(pack_sequence(windows, enforce_sorted=False))
        return self.head(h_n[-1])


def make_forecaster(config: ModelConfig) -> Forecaster:
    params = config.params
    return Forecaster(params["input_size"], params["hidden_size"], params["head_size"])


def train(config: ModelConfig, steps: int, seed: int) -> tuple[Forecaster, float]:
    """A forecaster trained on freshly drawn windows; returns it and the last minibatch's loss."""
    torch.manual_seed(seed)
    forecaster = make_forecaster(config)
    horizon = config.params["head_size"]

    def batch_loss(rng: np.random.Generator) -> torch.Tensor:
        pairs = [window(rng, int(rng.integers(*WINDOWS)), horizon) for _ in range(BATCH)]
        predicted = forecaster([torch.from_numpy(readings) for readings, _ in pairs])
        return nn.functional.mse_loss(predicted, torch.from_numpy(np.stack([future for _, future in pairs])))

    return forecaster, fit(forecaster, batch_loss, steps, learning_rate=0.01, seed=seed)


def mean_squared_error(forecaster: Forecaster, pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
    with torch.inference_mode():
        predicted = forecaster([torch.from_numpy(readings) for readings, _ in pairs]).numpy()
    return float(np.mean((predicted - np.stack([future for _, future in pairs])) ** 2))


def main(argv: list[str] | None = None) -> None:
    config, steps, seed = command_line(__doc__, CONFIG, "forecaster", argv)
    forecaster, loss = train(config, steps, seed)
    rng = np.random.default_rng(seed + 1)
    test = [window(rng, 48, config.params["head_size"]) for _ in range(200)]
    last_value = float(np.mean([(future - readings[-1, 0]) ** 2 for readings, future in test]))
    print(f"last loss {loss:.4f}; held-out mean squared error {mean_squared_error(forecaster, test):.4f} "
          f"(repeating the last reading: {last_value:.4f})")
    save(forecaster, config)


if __name__ == "__main__":
    main()
