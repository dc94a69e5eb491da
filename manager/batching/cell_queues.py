"""The scheduler's queues: one per cell type, holding as columns the lanes of that type with nodes
left to issue, oldest first; the ready lanes of a queue; and the order lanes are served in.

Within a queue, lanes are served by the request's `priority` (highest first, oldest first among
equals), but a lane left out of `MAX_PASSES` tasks in a row that took a lane of higher priority goes
before every other lane in the next one: priority reorders service, it never starves anyone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchmaker.common.graph import CellTypeSpec

FINISHED = np.iinfo(np.int64).max  # the `need` of a lane with nothing left to issue
NO_LAYOUT = -1  # the layout of a lane that is not a chain: it runs as waves
ONE_STEP_LAYOUT = 0  # the layout of a lane of one node (common.lanes.ONE_STEP): it fits a task of any layout
MAX_PASSES = 8  # tasks in a row that may take higher-priority lanes and leave out a ready one
FIRST = 2**62  # the rank of a lane passed over MAX_PASSES times: above any request's priority


class CellTypeQueue:
    """Lanes of one cell type with nodes left to issue, oldest first, as columns: the request's row
    and generation (a lane whose request ended is stale), the cursor (next node, an index into the
    request's plan), the lane's end, the `need` and size of the wave at the cursor, the request's
    priority, and how many tasks in a row took higher-priority lanes and left this one out."""

    COLUMNS = ("row", "generation", "cursor", "end", "need", "wave", "priority", "passes", "layout")

    def __init__(self, spec: CellTypeSpec, index: int):
        self.spec = spec
        self.index = index  # in the manager's cell layout
        self.size = 0
        for name in self.COLUMNS:
            setattr(self, name, np.zeros(64, np.int64))

    def add(self, lanes: list[tuple[int, ...]]) -> None:
        """Append lanes, each (row, generation, cursor, end, need, wave, priority, layout), in order."""
        count = len(lanes)
        while self.size + count > len(self.row):
            for name in self.COLUMNS:
                column = getattr(self, name)
                setattr(self, name, np.concatenate((column, np.zeros_like(column))))
        columns = np.array(lanes, np.int64).reshape(count, 8).T
        at = slice(self.size, self.size + count)
        for name, values in zip(("row", "generation", "cursor", "end", "need", "wave", "priority", "layout"), columns):
            getattr(self, name)[at] = values
        self.passes[at] = 0
        self.size += count

    def keep(self, mask: np.ndarray) -> None:
        kept = int(mask.sum())
        for name in self.COLUMNS:
            column = getattr(self, name)
            column[:kept] = column[: self.size][mask]
        self.size = kept


@dataclass
class Ready:
    """The lanes of a queue whose next wave may be issued, in queue order."""

    lanes: np.ndarray  # indices into the queue's columns
    rows: np.ndarray  # their requests' rows
    sizes: np.ndarray  # nodes in each lane's next wave
    first: np.ndarray  # the wave's first node, as an index into the plan store
    left_out: np.ndarray | None = None  # lanes that could have joined the task formed, had it room
    everyone: bool = False  # every ready lane that may run on the worker is in it, whole: nothing could join
    layout: int = NO_LAYOUT  # the chain layout all its lanes share (common.lanes), or none: waves

    @property
    def nodes(self) -> int:
        return int(self.sizes.sum())


def in_order_of_service(queue: CellTypeQueue, ready: Ready) -> Ready:
    """Ready lanes in the order they are served: those passed over MAX_PASSES times first, then by
    priority, highest first; queue order (oldest first) among equals. Unchanged when all rank alike."""
    lanes = ready.lanes
    rank = queue.priority[lanes]
    starving = queue.passes[lanes] >= MAX_PASSES
    if starving.any():
        rank = np.where(starving, FIRST, rank)
    if rank.min() == rank.max():
        return ready
    order = np.argsort(-rank, kind="stable")
    return Ready(lanes[order], ready.rows[order], ready.sizes[order], ready.first[order])


def count_passes(queue: CellTypeQueue, taken: Ready) -> None:
    """The lanes taken start counting afresh; those left out of a task that took a lane of higher
    priority count one more pass."""
    queue.passes[taken.lanes] = 0
    left_out = taken.left_out
    if left_out is None or not len(left_out):
        return
    lower = left_out[queue.priority[left_out] < queue.priority[taken.lanes].max()]
    queue.passes[lower] += 1
