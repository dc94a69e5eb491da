"""The request table: per-request state the scheduler reads for whole batches, as numpy columns
indexed by a request's row (a row is reused once its request is forgotten). It grows by doubling."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from common.graph import ValueKind

if TYPE_CHECKING:
    from manager.records import Request

NO_WORKER = -1


def grow_rows(array: np.ndarray, size: int, fill: float = 0) -> np.ndarray:
    """`array` with room for at least `size` rows (doubling), new rows set to `fill`."""
    if len(array) >= size:
        return array
    grown = np.full((max(size, 2 * len(array)), *array.shape[1:]), fill, dtype=array.dtype)
    grown[: len(array)] = array
    return grown


class RequestTable:
    """Columns over request rows; a row is reused once its request is forgotten (its generation changes)."""

    COLUMNS: ClassVar[dict[str, tuple[type, int | float | bool]]] = {
        "node_base": (np.int64, 0),
        "reg_base": (np.int64, 0),
        "ragged_base": (np.int64, 0),
        "issued": (np.int64, 0),  # nodes issued to a worker
        "completed": (np.int64, 0),  # nodes whose task completed
        "inflight": (np.int64, 0),  # tasks in flight holding its nodes
        "home": (np.int64, NO_WORKER),  # worker whose rows its next values are written to
        "host": (np.int64, NO_WORKER),  # host number of the workers holding its values (all on one host)
        "bound": (np.int64, NO_WORKER),  # the only worker it may run on (request affinity, baseline groups)
        "runnable": (np.bool_, False),  # its lanes may be scheduled
        "generation": (np.int64, 0),
        "started": (np.float64, 0.0),  # first issue (perf_counter), 0 before
    }

    RESET = ("issued", "completed", "inflight", "home", "host", "bound", "started")  # the rest is set on admission

    def __init__(self, kinds: list[ValueKind], capacity: int = 1024):
        self.kinds = {kind: i for i, kind in enumerate(kinds)}  # column of each kind in ext_base and blocks
        for name, (dtype, fill) in self.COLUMNS.items():
            setattr(self, name, np.full(capacity, fill, dtype=dtype))
        self.ext_base = np.zeros((capacity, len(kinds)), np.int64)  # where its external values start, per kind
        self.blocks = np.zeros((capacity, len(kinds)), np.int64)  # arena rows it takes on a worker, per kind
        self.requests: list[Request | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))

    def add(self, request: Request) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.requests[row] = request
        for name in self.RESET:
            column = getattr(self, name)
            column[row] = self.COLUMNS[name][1]
        self.generation[row] += 1
        self.blocks[row] = 0
        for kind, registers in request.unfolded.plan.register_groups.items():
            self.blocks[row, self.kinds[kind]] = len(registers)
        request.row = row
        return row

    def remove(self, row: int) -> None:
        self.requests[row] = None
        self.runnable[row] = False
        self.generation[row] += 1
        self._free.append(row)

    def _grow(self) -> None:
        old = len(self.requests)
        for name, (_, fill) in self.COLUMNS.items():
            setattr(self, name, grow_rows(getattr(self, name), 2 * old, fill))
        self.ext_base = grow_rows(self.ext_base, 2 * old)
        self.blocks = grow_rows(self.blocks, 2 * old)
        self.requests.extend([None] * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))
