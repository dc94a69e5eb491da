"""Arena rows, shared by the manager and the workers: the reserved rows every arena has, and the allocator of
the free ones (the manager's for each worker's arenas on its path; a worker's for its running batch)."""

from __future__ import annotations

import numpy as np

ZERO_SLOT = 0  # always zero: an initial state, and the input of padding rows
SCRATCH_SLOT = 1  # written by padding rows, never read
FIRST_FREE_SLOT = 2


class SlotAllocator:
    """A stack of free arena rows, taken and given back a batch at a time; rows below
    FIRST_FREE_SLOT are reserved (zero and scratch)."""

    def __init__(self, rows: int):
        self.capacity = rows - FIRST_FREE_SLOT
        # Taking from the end hands out low rows first, which keeps the touched memory small.
        self._free = np.arange(rows - 1, FIRST_FREE_SLOT - 1, -1, dtype=np.int64)
        self._top = self.capacity

    @property
    def available(self) -> int:
        return self._top

    @property
    def in_use(self) -> int:
        return self.capacity - self._top

    def take(self, count: int) -> np.ndarray:
        """`count` free rows; callers check `available` first (the scheduler sizes tasks to fit)."""
        if count > self._top:
            raise RuntimeError(f"{count} rows asked of an arena with {self._top} free")
        self._top -= count
        return self._free[self._top : self._top + count][::-1].copy()

    def take_one(self) -> int:
        self._top -= 1
        return int(self._free[self._top])

    def give(self, slots: np.ndarray) -> None:
        """Rows back on the stack, highest first: the next `take` hands them out ascending (runs of
        consecutive rows, which a GPU worker copies to the host in one transfer each)."""
        count = len(slots)
        self._free[self._top : self._top + count] = np.sort(slots)[::-1]
        self._top += count

    def give_one(self, slot: int) -> None:
        self._free[self._top] = slot
        self._top += 1
