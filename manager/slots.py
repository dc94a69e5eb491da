"""Slot allocation for one arena of one worker. The manager owns every allocation decision."""

from __future__ import annotations

from common.slots import FIRST_FREE_SLOT


class SlotAllocator:
    """A free list of arena rows; rows below FIRST_FREE_SLOT are reserved (zero and scratch)."""

    def __init__(self, rows: int):
        self.capacity = rows - FIRST_FREE_SLOT
        # Popping from the end hands out low rows first, which keeps the touched memory small.
        self._free = list(range(rows - 1, FIRST_FREE_SLOT - 1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def take(self) -> int:
        """One free row; callers check `available` first (the scheduler sizes tasks to fit)."""
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)
