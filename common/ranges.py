"""Index arithmetic on numpy arrays, shared by the manager's batching and a worker's running batch."""

from __future__ import annotations

import numpy as np


def consecutive(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """first[i], first[i] + 1, ..., first[i] + counts[i] - 1 for every i, concatenated."""
    if len(counts) == len(first) and (counts == 1).all():
        return first
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.repeat(first - starts, counts) + np.arange(total)
