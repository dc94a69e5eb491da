"""The request table: the one home of every admitted request until it is forgotten, and the
per-request state the scheduler reads for whole batches, as numpy columns indexed by a request's
row (a row is reused once its request is forgotten). It grows by doubling. Beside the rows, its
index of unanswered requests finds a request by client and id, and keeps the deadline heap and
the arrival heap.

Only the table's own methods write its columns and its index, each named for the event that
writes it: admission (`add`, which sets a row's columns to their starting values), the plan
store placing a request's plan (`place`), a task issued (`task_issued`, its later steps `step_issued`), a task ended
(`task_ended`), affinity (`bind`), lanes released (`set_runnable`), lanes stopped
(`stop_lanes`), the request answered (`conclude`) and forgetting (`remove`)."""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from batchmaker.common.graph import ValueKind
from batchmaker.manager.batching.deadlines import Deadlines, without_done

if TYPE_CHECKING:
    from batchmaker.common.plan import Plan
    from batchmaker.manager.batching.records import Request

NO_WORKER = -1
Region = str | ValueKind  # a plan store region: "node", "ragged", "reg", or the external values of a kind
BASE_COLUMNS = {"node": "node_base", "ragged": "ragged_base", "reg": "reg_base"}  # a region's column of starts


def grow_rows(array: np.ndarray, size: int, fill: float = 0) -> np.ndarray:
    """`array` with room for at least `size` rows (doubling), new rows set to `fill`."""
    if len(array) >= size:
        return array
    grown = np.full((max(size, 2 * len(array)), *array.shape[1:]), fill, dtype=array.dtype)
    grown[: len(array)] = array
    return grown


class UnansweredIndex:
    """The requests admitted and not yet answered, by client and id, the deadlines of those that
    have one (a heap, so the event loop sleeps until the next), and their arrivals (a heap: a replay
    or a session's request that waited its turn is admitted after requests that arrived later).
    Written by the request table alone."""

    def __init__(self) -> None:
        self._by_client: dict[tuple[bytes, Any], Request] = {}
        self._deadlines: Deadlines[Request] = Deadlines()
        self._arrivals: list[tuple[float, int, Request]] = []  # (arrival, tie-breaker, request)

    def __len__(self) -> int:
        return len(self._by_client)

    def __contains__(self, key: tuple[bytes, Any]) -> bool:
        return key in self._by_client

    def get(self, client: bytes, request_id: Any) -> Request | None:
        return self._by_client.get((client, request_id))

    def of_clients(self, clients: Iterable[bytes]) -> list[Request]:
        gone = set(clients)
        return [request for (client, _), request in self._by_client.items() if client in gone] if gone else []

    def all(self) -> list[Request]:
        return list(self._by_client.values())

    def expired(self) -> Iterator[Request]:
        """Requests whose deadline has passed and that are not answered yet."""
        return self._deadlines.due(time.perf_counter())

    def earliest_arrival(self) -> float | None:
        """Arrival time of the oldest request not yet answered (answered ones leave the heap as they surface)."""
        arrivals = self._arrivals
        while arrivals and arrivals[0][2].done:
            heapq.heappop(arrivals)
        return arrivals[0][0] if arrivals else None

    def wait_ms(self, longest: int) -> int:
        """How long the event loop may sleep before the next deadline (at most `longest`)."""
        return self._deadlines.wait_ms(longest)

    def _add(self, request: Request) -> None:
        """A replay replaces the record it was made from."""
        self._by_client[(request.client, request.request_id)] = request
        heapq.heappush(self._arrivals, (request.arrival, id(request), request))
        if request.deadline is not None:
            self._deadlines.add(request.deadline, request)

    def _remove(self, requests: list[Request]) -> None:
        by_client = self._by_client
        for request in requests:
            key = (request.client, request.request_id)
            if by_client.get(key) is request:
                del by_client[key]
        self._arrivals = without_done(self._arrivals, len(by_client))  # answered behind a long-running one
        self._deadlines.forget_done(len(by_client))


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
        self._reset = [(name, self.COLUMNS[name][1]) for name in self.RESET]  # (column, its starting value)
        for name, (dtype, fill) in self.COLUMNS.items():
            setattr(self, name, np.full(capacity, fill, dtype=dtype))
        self.ext_base = np.zeros((capacity, len(kinds)), np.int64)  # where its external values start, per kind
        self.blocks = np.zeros((capacity, len(kinds)), np.int64)  # arena rows it takes on a worker, per kind
        self.requests: list[Request | None] = [None] * capacity
        self.live: dict[int, Request] = {}  # by id(request), in admission order, until forgotten
        self.unanswered = UnansweredIndex()
        self._free = list(range(capacity - 1, -1, -1))

    def add(self, requests: list[Request]) -> np.ndarray:
        """Admit requests: a row each, its columns at their starting values; returns the rows."""
        while len(self._free) < len(requests):
            self._grow()
        taken = self._free[-len(requests) :]
        del self._free[-len(requests) :]
        rows = np.array(taken[::-1], np.int64)
        for name, fill in self._reset:
            getattr(self, name)[rows] = fill
        self.blocks[rows] = [self._blocks_of(request.unfolded.plan) for request in requests]
        live, unanswered, table = self.live, self.unanswered, self.requests
        for request, row in zip(requests, rows.tolist()):
            table[row] = request
            request.row = row
            live[id(request)] = request
            unanswered._add(request)
        return rows

    def _blocks_of(self, plan: Plan) -> np.ndarray:
        """The arena rows a request of this plan takes on a worker, per kind (made once per plan)."""
        key = ("blocks", *self.kinds)
        blocks = plan.cache.get(key)
        if blocks is None:
            blocks = plan.cache[key] = np.zeros(len(self.kinds), np.int64)
            for kind, registers in plan.register_groups.items():
                blocks[self.kinds[kind]] = len(registers)
        return blocks

    def bases(self, region: Region) -> np.ndarray:
        """Where each row's range starts in a region of the plan store (a view: read it, write with `place`)."""
        if isinstance(region, ValueKind):
            return self.ext_base[:, self.kinds[region]]
        return getattr(self, BASE_COLUMNS[region])

    def place(self, region: Region, rows: np.ndarray | int, starts: np.ndarray | int) -> None:
        """The plan store put (or moved) the ranges of the requests at `rows` in `region` at `starts`."""
        if type(region) is str:  # written at every admission: no view of ext_base, no name formatted
            getattr(self, BASE_COLUMNS[region])[rows] = starts
        else:
            self.ext_base[rows, self.kinds[region]] = starts

    def others(self, requests: list[Request]) -> list[Request]:
        """The live requests besides `requests`, in admission order."""
        leaving = {id(request) for request in requests}
        return [other for other in self.live.values() if id(other) not in leaving]

    def conclude(self, requests: list[Request]) -> None:
        """The requests are answered, failed or replaced: they leave the index of unanswered requests
        (their rows stay until nothing of them is in flight)."""
        self.unanswered._remove(requests)

    def remove(self, requests: list[Request]) -> list[Request]:
        """Forget requests; returns those that were not forgotten already."""
        gone = [request for request in requests if self.live.pop(id(request), None) is not None]
        rows = [request.row for request in gone]
        for row in rows:
            self.requests[row] = None
        self.stop_lanes(np.array(rows, np.int64))  # a lane of them still queued must not run as a row's next request
        self._free.extend(rows)
        return gone

    def set_runnable(self, rows: np.ndarray | int, runnable: bool) -> np.ndarray:
        """Whether their lanes may be scheduled; returns the generations their queued lanes carry."""
        self.runnable[rows] = runnable
        return self.generation[rows]

    def stop_lanes(self, rows: np.ndarray | int) -> None:
        """Their lanes in the scheduler's queues are stale from now on."""
        self.generation[rows] += 1
        self.set_runnable(rows, False)

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

    def step_issued(self, rows: np.ndarray, sizes: np.ndarray) -> None:
        """A later step of a task already issued (manager.batching.scheduler: multi-step tasks) took `sizes` more
        nodes of the requests at `rows`, all of them already in the task."""
        self.issued[rows] += sizes

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
