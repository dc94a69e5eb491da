"""What the trained examples (tagger/, forecaster/) share: a seeded, single-threaded training loop."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn


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
