"""The plan store: plans of admitted requests, concatenated.

Per-node and per-register data of every admitted request lives here, so a task gathers the data of
all its nodes with one fancy index, whatever requests they belong to; where a request's ranges start
is in its request-table row. A plan's node matrix and ragged inputs are stored once, shared by every
request of its shape (models reuse one plan per shape), and kept while the plan may come again;
each request copies in only what is its own, its registers and external values. The store grows by
doubling and compacts when a region's tail is full, moving what is live down."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.plan import ZERO_REF, Plan
from batchmaker.common.slots import ZERO_SLOT
from batchmaker.manager.batching.request_table import NO_WORKER, Region, RequestTable, grow_rows

if TYPE_CHECKING:
    from batchmaker.manager.batching.records import Request


class _Log:
    """An append-only region of one or more arrays, shared by requests as contiguous ranges."""

    def __init__(self, columns: dict[str, tuple[np.dtype, tuple[int, ...], int]], capacity: int = 4096):
        self.columns = columns
        self.arrays = {name: np.full((capacity, *shape), fill, dtype) for name, (dtype, shape, fill) in columns.items()}
        self.capacity = capacity
        self.tail = 0
        self.live = 0

    def reserve(self, count: int, live: int) -> None:
        """Make room for `count` more entries: compaction is done by the caller when worthwhile."""
        size = max(self.tail + count, 2 * (live + count))
        for name, (_, _, fill) in self.columns.items():
            self.arrays[name] = grow_rows(self.arrays[name], size, fill)
        self.capacity = len(self.arrays[name])

    def take(self, count: int) -> int:
        base = self.tail
        self.tail += count
        self.live += count
        return base


class NodeColumns:
    """Columns of the plan store's node matrix: a request's nodes are copied in with one assignment."""

    NEED, WAVE_END, DEPTH, RAGGED_START, RAGGED_COUNT, HAS_COPIES = range(6)
    INPUTS = 6  # then one column per input port, then one per output


def packed(plan: Plan, ports: int, outputs: int) -> np.ndarray:
    """The plan's node arrays as the store's node matrix rows (made once per plan and kept on it)."""
    key = (ports, outputs)
    matrix = plan.cache.get(key)
    if matrix is None:
        matrix = np.zeros((plan.nodes, NodeColumns.INPUTS + ports + outputs), np.int64)
        for column, values in enumerate(
            (plan.need, plan.wave_end, plan.depth, plan.ragged_start, plan.ragged_count, plan.has_copies)
        ):
            matrix[:, column] = values
        matrix[:, NodeColumns.INPUTS : NodeColumns.INPUTS + ports] = ZERO_REF
        matrix[:, NodeColumns.INPUTS : NodeColumns.INPUTS + plan.inputs.shape[1]] = plan.inputs
        first_output = NodeColumns.INPUTS + ports
        matrix[:, first_output : first_output + plan.outputs.shape[1]] = plan.outputs
        plan.cache[key] = matrix
    return matrix


def _fits(needs: list[tuple[_Log, int]]) -> bool:
    """Every region has room for its count at its tail (a loop, not any() over a generator: once per request)."""
    for log, count in needs:
        if log.tail + count > log.capacity:
            return False
    return True


class _Stored:
    """A plan's node matrix and ragged inputs in the store: where they start, and how many live requests
    run it (a plan is shared by the requests of its shape)."""

    __slots__ = ("plan", "node_base", "ragged_base", "users")

    def __init__(self, plan: Plan, node_base: int, ragged_base: int):
        self.plan = plan
        self.node_base = node_base
        self.ragged_base = ragged_base
        self.users = 0


class PlanStore:
    """The plans of admitted requests (node matrices and ragged inputs, each plan once, however many
    requests run it) and each request's own registers and external values, concatenated."""

    def __init__(self, table: RequestTable, ports: int, outputs: int):
        self.table = table
        self.ports, self.outputs = ports, outputs
        self.nodes = _Log({"data": (np.int64, (NodeColumns.INPUTS + ports + outputs,), 0)})
        self.ragged = _Log({"refs": (np.int32, (ports,), -1)})
        # Where each register's latest value is (worker, slot), and the slot its next value goes to.
        self.registers = _Log(
            {"slot": (np.int64, (), ZERO_SLOT), "worker": (np.int64, (), NO_WORKER), "write": (np.int64, (), 0)}
        )
        self.externals = {
            kind: _Log({"values": (np.dtype(kind.dtype), kind.shape, 0)}) for kind in table.kinds
        }
        self._plans: dict[int, _Stored] = {}  # by id(plan); each holds its plan, so an id is never reused meanwhile

    def add(self, requests: list[Request], rows: np.ndarray, live: Callable[[], list[Request]]) -> None:
        """Place the plans of requests just given `rows` in the table (each plan stored once) and copy in
        their registers and external values, every request's of a region in one copy; compacts first if a
        region's tail is full. `live()`: the requests admitted before them (asked for only to compact)."""
        table = self.table
        placed = []
        for request in requests:
            plan = request.unfolded.plan
            stored = self._plans.get(id(plan)) or self._store(plan, live)
            if stored.users == 0:
                self.nodes.live += plan.nodes
                self.ragged.live += len(plan.ragged_refs)
            stored.users += 1
            placed.append(stored)
        table.place("node", rows, [stored.node_base for stored in placed])  # after any compaction moved them
        table.place("ragged", rows, [stored.ragged_base for stored in placed])
        registers = np.array([request.unfolded.plan.registers for request in requests], np.int64)
        externals = {kind: [] for kind in self.externals}
        for request in requests:
            for kind, values in request.unfolded.externals.items():
                externals[kind].append(values)
        needs = [(self.registers, int(registers.sum()))]
        needs += [(self.externals[kind], sum(map(len, values))) for kind, values in externals.items() if values]
        if not _fits(needs):
            self._compact(live())
            _reserve(needs)
        start = self.registers.take(int(registers.sum()))
        table.place("reg", rows, start + np.cumsum(registers) - registers)
        self.registers.arrays["worker"][start : self.registers.tail] = NO_WORKER
        for kind, values in externals.items():
            if not values:
                continue
            log = self.externals[kind]
            counts = np.array([len(v) for v in values], np.int64)
            start = log.take(int(counts.sum()))
            log.arrays["values"][start : log.tail] = values[0] if len(values) == 1 else np.concatenate(values)
            having = rows if len(values) == len(requests) else rows[[kind in r.unfolded.externals for r in requests]]
            table.place(kind, having, start + np.cumsum(counts) - counts)

    def write_to(self, where: np.ndarray, rows: np.ndarray) -> None:
        """The registers at `where` write their next values to arena `rows` (their request's rows on a worker)."""
        self.registers.arrays["write"][where] = rows

    def written_by(self, where: np.ndarray, worker_id: int) -> np.ndarray:
        """A task sent to `worker_id` writes the registers at `where`: from now on their latest values are in
        the rows their values go to there, which are returned."""
        registers = self.registers.arrays
        written = registers["write"][where]
        registers["slot"][where] = written
        registers["worker"][where] = worker_id
        return written

    def _store(self, plan: Plan, live: Callable[[], list[Request]]) -> _Stored:
        """Copy a plan's node matrix and ragged inputs in, once."""
        needs = [(self.nodes, plan.nodes), (self.ragged, len(plan.ragged_refs))]
        if not _fits(needs):
            self._compact_plans(live())
            _reserve(needs)
        base = self.nodes.take(plan.nodes)
        self.nodes.live -= plan.nodes  # counted live while requests run it (`add`)
        self.nodes.arrays["data"][base : base + plan.nodes] = packed(plan, self.ports, self.outputs)
        ragged = self.ragged.take(len(plan.ragged_refs))
        self.ragged.live -= len(plan.ragged_refs)
        if len(plan.ragged_refs):
            self.ragged.arrays["refs"][ragged : ragged + len(plan.ragged_refs), : plan.ragged_refs.shape[1]] = (
                plan.ragged_refs
            )
        stored = self._plans[id(plan)] = _Stored(plan, base, ragged)
        return stored

    def release(self, requests: list[Request]) -> None:
        """Forgotten requests' ranges are free (a plan's once no request runs it)."""
        for request in requests:
            plan = request.unfolded.plan
            stored = self._plans[id(plan)]
            stored.users -= 1
            if stored.users == 0:  # kept for its shape's next request until a compaction drops it
                self.nodes.live -= plan.nodes
                self.ragged.live -= len(plan.ragged_refs)
            self.registers.live -= plan.registers
            for kind, values in request.unfolded.externals.items():
                self.externals[kind].live -= len(values)

    def _compact(self, live: list[Request]) -> None:
        """Move every live request's registers and external values to the bottom of their regions, in row order."""
        rows = np.array([request.row for request in live], np.int64)
        plans = [request.unfolded for request in live]
        self._compact_log(self.registers, "reg", rows, [u.plan.registers for u in plans])
        for kind, log in self.externals.items():
            sizes = [len(u.externals.get(kind, ())) for u in plans]
            self._compact_log(log, kind, rows, sizes)

    def _compact_plans(self, live: list[Request]) -> None:
        """Drop the plans no live request runs, move the others to the bottom of their regions, and point
        their requests at them."""
        self._plans = {key: stored for key, stored in self._plans.items() if stored.users}
        kept = sorted(self._plans.values(), key=lambda stored: stored.node_base)
        for log, attribute, size in ((self.nodes, "node_base", _nodes), (self.ragged, "ragged_base", _ragged)):
            sizes = np.array([size(stored.plan) for stored in kept], np.int64)
            old = np.array([getattr(stored, attribute) for stored in kept], np.int64)
            new = np.cumsum(sizes) - sizes
            order = np.argsort(old, kind="stable")
            _move(log, old[order], new[order], sizes[order])
            for stored, base in zip(kept, new.tolist()):
                setattr(stored, attribute, base)
        for request in live:
            stored = self._plans[id(request.unfolded.plan)]
            self.table.place("node", request.row, stored.node_base)
            self.table.place("ragged", request.row, stored.ragged_base)

    def _compact_log(self, log: _Log, region: Region, rows: np.ndarray, sizes: list[int]) -> None:
        counts = np.array(sizes, np.int64)
        keep = counts > 0
        rows, counts = rows[keep], counts[keep]
        old = self.table.bases(region)[rows]
        order = np.argsort(old, kind="stable")
        rows, counts, old = rows[order], counts[order], old[order]
        new = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
        _move(log, old, new, counts)
        self.table.place(region, rows, new)


def _nodes(plan: Plan) -> int:
    return plan.nodes


def _ragged(plan: Plan) -> int:
    return len(plan.ragged_refs)


def _move(log: _Log, old: np.ndarray, new: np.ndarray, counts: np.ndarray) -> None:
    """Move the ranges `old` (ascending) of a region to `new`, packed at its bottom; the rest is free."""
    if len(counts):
        source = np.repeat(old - new, counts) + np.arange(counts.sum())
        for array in log.arrays.values():
            array[: counts.sum()] = array[source]
    log.tail = log.live = int(counts.sum())


def _reserve(needs: list[tuple[_Log, int]]) -> None:
    """Grow the regions that are mostly live, or compaction would repeat soon."""
    for log, count in needs:
        if 2 * (log.tail + count) > log.capacity:
            log.reserve(count, log.live)


def make_tables(specs: list[CellTypeSpec], kinds: list[ValueKind]) -> tuple[RequestTable, PlanStore]:
    """The request table and plan store for these cell types: ports sized for the widest cell."""
    table = RequestTable(kinds)
    ports = max((len(spec.inputs) for spec in specs), default=1)
    outputs = max((len(spec.outputs) for spec in specs), default=1)
    return table, PlanStore(table, ports, outputs)
