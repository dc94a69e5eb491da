"""How many requests a worker's running batch holds at once (worker.held_requests): enough that every step can be
full, few enough that a step's cost, which grows with the nodes held, stays that of a few batches. Until it has
measured the rate requests are answered at, the manager routes no more than this per worker
(manager.batching.routed)."""

from __future__ import annotations

from collections.abc import Iterable

from batchmaker.common.graph import CellTypeSpec

WINDOW_BATCHES = 4  # of the largest batch of any cell type


def window(specs: Iterable[CellTypeSpec]) -> int:
    return WINDOW_BATCHES * max(spec.max_batch for spec in specs)
