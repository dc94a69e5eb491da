"""The plan store: plans of admitted requests, concatenated.

Per-node and per-register data of every admitted request lives here, each request's plan
arrays copied next to the others at admission, so a task gathers the data of all its nodes
with one fancy index, whatever requests they belong to; where a request's ranges start is in
its request-table row. The store grows by doubling and compacts when its tail is full,
moving live requests down.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.plan import ZERO_REF, Plan, Unfolded
from batchmaker.common.slots import ZERO_SLOT
from batchmaker.manager.request_table import NO_WORKER, Region, RequestTable, grow_rows

if TYPE_CHECKING:
    from batchmaker.manager.records import Request


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


class PlanStore:
    """Plans of admitted requests, concatenated: nodes, ragged inputs, registers and external values."""

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

    def add(self, request: Request, live: Iterable[Request]) -> None:
        """Copy a request's plan in; compacts first if a region's tail is full."""
        unfolded: Unfolded = request.unfolded
        plan = unfolded.plan
        needs = [
            (self.nodes, plan.nodes),
            (self.ragged, len(plan.ragged_refs)),
            (self.registers, plan.registers),
            *[(self.externals[kind], len(values)) for kind, values in unfolded.externals.items()],
        ]
        if not _fits(needs):
            self._compact(list(live))
            for log, count in needs:
                if 2 * (log.tail + count) > log.capacity:  # mostly live: grow, or compaction would repeat soon
                    log.reserve(count, log.live)
        table, row = self.table, request.row
        base = self.nodes.take(plan.nodes)
        table.place("node", row, base)
        self.nodes.arrays["data"][base : base + plan.nodes] = packed(plan, self.ports, self.outputs)
        if len(plan.ragged_refs):
            start = self.ragged.take(len(plan.ragged_refs))
            table.place("ragged", row, start)
            self.ragged.arrays["refs"][start : start + len(plan.ragged_refs), : plan.ragged_refs.shape[1]] = plan.ragged_refs
        start = self.registers.take(plan.registers)
        table.place("reg", row, start)
        self.registers.arrays["worker"][start : start + plan.registers] = NO_WORKER
        for kind, values in unfolded.externals.items():
            log = self.externals[kind]
            start = log.take(len(values))
            table.place(kind, row, start)
            log.arrays["values"][start : start + len(values)] = values

    def release(self, request: Request) -> None:
        plan = request.unfolded.plan
        self.nodes.live -= plan.nodes
        self.ragged.live -= len(plan.ragged_refs)
        self.registers.live -= plan.registers
        for kind, values in request.unfolded.externals.items():
            self.externals[kind].live -= len(values)

    def _compact(self, live: list[Request]) -> None:
        """Move every live request's ranges to the bottom of each region, in row order."""
        rows = np.array([request.row for request in live], np.int64)
        plans = [request.unfolded for request in live]
        self._compact_log(self.nodes, "node", rows, [u.plan.nodes for u in plans])
        self._compact_log(self.ragged, "ragged", rows, [len(u.plan.ragged_refs) for u in plans])
        self._compact_log(self.registers, "reg", rows, [u.plan.registers for u in plans])
        for kind, log in self.externals.items():
            sizes = [len(u.externals.get(kind, ())) for u in plans]
            self._compact_log(log, kind, rows, sizes)

    def _compact_log(self, log: _Log, region: Region, rows: np.ndarray, sizes: list[int]) -> None:
        counts = np.array(sizes, np.int64)
        keep = counts > 0
        rows, counts = rows[keep], counts[keep]
        old = self.table.bases(region)[rows]
        order = np.argsort(old, kind="stable")
        rows, counts, old = rows[order], counts[order], old[order]
        new = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
        if len(counts):
            source = np.repeat(old - new, counts) + np.arange(counts.sum())
            for array in log.arrays.values():
                array[: counts.sum()] = array[source]
        self.table.place(region, rows, new)
        log.tail = log.live = int(counts.sum())


def make_tables(specs: list[CellTypeSpec], kinds: list[ValueKind]) -> tuple[RequestTable, PlanStore]:
    """The request table and plan store for these cell types: ports sized for the widest cell."""
    table = RequestTable(kinds)
    ports = max((len(spec.inputs) for spec in specs), default=1)
    outputs = max((len(spec.outputs) for spec in specs), default=1)
    return table, PlanStore(table, ports, outputs)
