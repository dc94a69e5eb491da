"""What the trained examples (tagger/, forecaster/) share: their command line, a seeded single-threaded
training loop, and saving the state dict where the config's `weights` points."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from batchmaker.common.config import ModelConfig, load_config
from batchmaker.common.models.base import save_weights


def command_line(doc: str, config: Path, model: str, argv: list[str] | None) -> tuple[ModelConfig, int, int]:
    """The [models.NAME] table to train (from --config, --model), --steps and --seed."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--config", type=Path, default=config)
    parser.add_argument("--model", default=model, help="the [models.NAME] table to train")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return load_config(args.config).models[args.model], args.steps, args.seed


def save(module: nn.Module, config: ModelConfig) -> None:
    """The state dict, at the path the config's `weights` names (relative to the config file)."""
    save_weights(module.state_dict(), config.weights)
    print(f"wrote {config.weights}")


def fit(module: nn.Module, batch_loss: Callable[[np.random.Generator], torch.Tensor], steps: int,
        learning_rate: float, seed: int) -> float:
    """Adam for `steps` minibatches drawn by `batch_loss(rng)`; returns the last minibatch's loss.

    One intra-op thread and a seeded generator: the same seed trains the same weights on any machine."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.Adam(module.parameters(), lr=learning_rate)
    module.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = batch_loss(rng)
        loss.backward()
        optimizer.step()
    module.eval()
    return float(loss.detach())
