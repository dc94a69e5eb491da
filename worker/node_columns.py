"""The running batch's node columns (worker.running_batch): every node of every request held as a row of flat
arrays, and a plan's nodes in those columns whatever the request (its template, made once per plan), so that a
request joins with a few array operations and a step picks and reads its nodes with a few more."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.plan import Plan
from batchmaker.common.ranges import consecutive
from batchmaker.worker.chain_runs import chain_columns

PortGroups = list[tuple[ValueKind, list[int]]]  # ports by kind of value, in order of first appearance
COLUMNS = (
    "request", "cell", "need", "pending", "local", "copied", "priority", "inputs", "outputs", "ragged_start",
    "ragged_count", "chain", "carry",
)  # fmt: skip


@dataclass(frozen=True)
class Template:
    """A plan's nodes in a running batch's columns, the same for every request of the plan: cell indices, the
    registers each input reads (-1: the zero row; an external value of the port's kind is -2 - its index among
    those of its kind) and each output writes (-1: none), the registers of ragged inputs, and the chains its nodes
    run in (worker.chain_runs)."""

    cell: np.ndarray
    inputs: np.ndarray  # [nodes, ports]
    kind: np.ndarray  # [nodes, ports]: the index of the port's kind of value
    outputs: np.ndarray  # [nodes, outputs]
    ragged: np.ndarray  # [ragged values, ports]
    chain: np.ndarray  # the nodes its chain goes on for, itself included
    carry: np.ndarray  # its link's carry code
    chaining: frozenset[int] = frozenset()  # the cell types of its nodes whose chains go on

    @staticmethod
    def of(plan: Plan, specs: list[CellTypeSpec], cell_of: dict[str, int], kind_index: dict[ValueKind, int],
           ports: int, outputs: int) -> Template:  # fmt: skip
        """The template of `plan` for node arrays of `ports` inputs and `outputs` outputs a node."""
        count = plan.nodes
        cell = np.empty(count, np.int64)
        inputs = np.full((count, ports), -1, np.int64)
        kind = np.zeros((count, ports), np.int64)
        written = np.full((count, outputs), -1, np.int64)
        ragged = np.full((len(plan.ragged_refs), ports), -1, np.int64)
        chains = []  # the lanes the plan runs as chains (common.lanes) of more than a node, without ragged inputs
        for lane, key in enumerate(plan.lane_cells):
            start, end = int(plan.lane_bounds[lane]), int(plan.lane_bounds[lane + 1])
            cell[start:end] = cell_of[key]
            spec = specs[cell_of[key]]
            if plan.lane_layouts and plan.lane_layouts[lane] is not None and end - start > 1 and not spec.ragged_inputs:
                chains.append((start, end))
            for port, port_kind in enumerate(spec.inputs):
                if port in spec.ragged_inputs:
                    at = consecutive(plan.ragged_start[start:end], plan.ragged_count[start:end])
                    ragged[at, port] = np.maximum(plan.ragged_refs[at, port], -1)
                else:
                    inputs[start:end, port] = plan.inputs[start:end, port]
                    kind[start:end, port] = kind_index[port_kind]
            written[start:end, : len(spec.outputs)] = plan.outputs[start:end, : len(spec.outputs)]
        if not chains:
            return Template(cell, inputs, kind, written, ragged, np.ones(count, np.int64), np.zeros(count, np.int64))
        in_chains = np.zeros(count, bool)
        for start, end in chains:
            in_chains[start:end] = True
        chain, carry = chain_columns(cell, plan.need, inputs, written, in_chains)
        chaining = frozenset(np.unique(cell[chain > 1]).tolist())
        return Template(cell, inputs, kind, written, ragged, chain, carry, chaining)


class Nodes:
    """The nodes of every request held, as columns; rows `[0, count)` are used, in the order requests joined.
    A ragged input's rows are `ragged[ragged_start : ragged_start + ragged_count, port]`."""

    def __init__(self, ports: int, outputs: int, capacity: int = 1024):
        self.count = 0
        self.request = np.zeros(capacity, np.int64)  # the slot of the node's request
        self.cell = np.zeros(capacity, np.int64)
        self.need = np.zeros(capacity, np.int64)
        self.pending = np.zeros(capacity, bool)
        self.local = np.zeros(capacity, np.int64)  # the node's index in its request's plan
        self.copied = np.zeros(capacity, bool)  # the host reads one of its outputs
        self.priority = np.zeros(capacity, np.int64)  # its request's
        self.inputs = np.zeros((capacity, ports), np.int64)  # arena rows, per input port
        self.outputs = np.zeros((capacity, outputs), np.int64)
        self.ragged_start = np.zeros(capacity, np.int64)
        self.ragged_count = np.zeros(capacity, np.int64)
        self.chain = np.ones(capacity, np.int64)  # the nodes of its request its chain goes on for (chain_runs)
        self.carry = np.zeros(capacity, np.int64)
        self.ragged = np.zeros((0, ports), np.int64)

    def reserve(self, more: int) -> None:
        if self.count + more <= len(self.request):
            return
        grown = max(self.count + more, 2 * len(self.request))
        for name in COLUMNS:
            old = getattr(self, name)
            new = np.zeros((grown, *old.shape[1:]), old.dtype)
            new[: self.count] = old[: self.count]
            setattr(self, name, new)

    def widen(self, ports: int, outputs: int) -> None:
        """Room for nodes of up to `ports` inputs and `outputs` outputs (a cell type added while nodes are held)."""
        grow = {"inputs": ports, "outputs": outputs, "ragged": ports}
        for name, width in grow.items():
            old = getattr(self, name)
            if old.shape[1] < width:
                setattr(self, name, np.concatenate([old, np.zeros((len(old), width - old.shape[1]), np.int64)], 1))

    def keep(self, kept: np.ndarray) -> None:
        """Keep only the rows `kept` (ascending), moved to the front, with their ragged rows."""
        flat = consecutive(self.ragged_start[kept], self.ragged_count[kept])
        self.ragged = self.ragged[flat]
        for name in COLUMNS:
            column = getattr(self, name)
            column[: len(kept)] = column[kept]
        self.count = len(kept)
        self.ragged_start[: self.count] = np.cumsum(self.ragged_count[: self.count]) - self.ragged_count[: self.count]


def ports_by_kind(kinds: tuple[ValueKind, ...], skip: frozenset[int] = frozenset()) -> PortGroups:
    """The ports of each kind of value, in order of first appearance (ports in `skip` left out): one gather or
    scatter per kind."""
    groups: dict[ValueKind, list[int]] = {}
    for port, kind in enumerate(kinds):
        if port not in skip:
            groups.setdefault(kind, []).append(port)
    return list(groups.items())
