"""The request table: the home of every admitted request until it is forgotten, and the per-request
state the scheduler reads for whole batches, as numpy columns indexed by a request's row (a row
is reused once its request is forgotten). It grows by doubling.

Each column is written by the table's own methods, one event each: admission (`add`), a task
issued (`task_issued`), a task ended (`task_ended`), lanes released or stopped (`set_runnable`,
`stop_lanes`), and forgetting (`remove`); the plan store writes the bases of its ranges."""

from __future__ import annotations

from collections.abc import Iterator
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
        self.live: dict[int, Request] = {}  # by id(request), in admission order, until forgotten
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
        self.live[id(request)] = request
        return row

    def others(self, request: Request) -> Iterator[Request]:
        """The live requests besides `request`, in admission order."""
        return (other for other in self.live.values() if other is not request)

    def remove(self, request: Request) -> bool:
        """Forget a request (False if it was forgotten already)."""
        if self.live.pop(id(request), None) is None:
            return False
        row = request.row
        self.requests[row] = None
        self.runnable[row] = False
        self.generation[row] += 1
        self._free.append(row)
        return True

    def set_runnable(self, row: int, runnable: bool) -> int:
        """Whether its lanes may be scheduled; returns the generation its queued lanes carry."""
        self.runnable[row] = runnable
        return int(self.generation[row])

    def stop_lanes(self, row: int) -> None:
        """Its lanes in the scheduler's queues are stale from now on."""
        self.generation[row] += 1
        self.runnable[row] = False

    def bind(self, rows: np.ndarray | int, worker_id: int) -> None:
        """They may run on this worker only."""
        self.bound[rows] = worker_id

    def task_issued(self, rows: np.ndarray, sizes: np.ndarray, worker_id: int, host: int, now: float) -> bool:
        """A task took `sizes` nodes of the requests at `rows` to a worker: their next values are
        written there. Returns whether it mixes running requests with starting ones."""
        self.issued[rows] += sizes
        self.inflight[rows] += 1
        self.home[rows] = worker_id
        self.host[rows] = host
        starting = self.started[rows] == 0
        if not starting.any():
            return False
        self.started[rows[starting]] = now
        return not starting.all()

    def task_ended(self, rows: np.ndarray, counts: np.ndarray | None) -> None:
        """A task holding nodes of the requests at `rows` completed (`counts` nodes each) or was lost (None)."""
        self.inflight[rows] -= 1
        if counts is not None:
            self.completed[rows] += counts

    def _grow(self) -> None:
        old = len(self.requests)
        for name, (_, fill) in self.COLUMNS.items():
            setattr(self, name, grow_rows(getattr(self, name), 2 * old, fill))
        self.ext_base = grow_rows(self.ext_base, 2 * old)
        self.blocks = grow_rows(self.blocks, 2 * old)
        self.requests.extend([None] * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))
