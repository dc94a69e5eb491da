"""The running batch's node columns (worker.running_batch): every node of every request held as a row of flat
arrays, and a plan's nodes in those columns whatever the request (its template, made once per plan), so that the
requests of a message join with a few array operations for them all and a step picks and reads its nodes with a
few more."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

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
PLAN_COLUMNS = ("cell", "need", "local", "copied", "ragged_start", "ragged_count", "chain", "carry")  # a template's


@dataclass(frozen=True)
class Template:
    """A plan's nodes in a running batch's columns, the same for every request of the plan: the columns whose values
    do not depend on the request (`columns`), the chains its nodes run in (worker.chain_runs), and where each node's
    inputs read and outputs write (`rows`, `ragged`) as places among its request's rows.

    A request's rows, in the order it takes them when it joins (`JoiningRows`): the zero row (read for no value,
    written for no output), its registers, then its external values, kind by kind in the order of the batch's
    kinds. An input reading an external value has its place as if the values of its kind (`external_kind`) came
    first among the request's: joining adds where they start when a request has external values of several kinds."""

    columns: np.ndarray  # [PLAN_COLUMNS, nodes]
    rows: np.ndarray  # [nodes, ports + outputs]: each input's, then each output's row among its request's
    external_kind: np.ndarray  # [nodes, ports + outputs]: the kind index of the external value an input reads, or -1
    ragged: np.ndarray  # [ragged values, ports]: among its request's rows
    register_kinds: tuple[ValueKind, ...]  # the kinds of its registers, in the order of the batch's kinds
    chaining: frozenset[int] = frozenset()  # the cell types of its nodes whose chains go on

    @staticmethod
    def of(plan: Plan, specs: list[CellTypeSpec], cell_of: dict[str, int], kind_index: dict[ValueKind, int],
           ports: int, outputs: int) -> Template:  # fmt: skip
        """The template of `plan` for node arrays of `ports` inputs and `outputs` outputs a node."""
        count = plan.nodes
        cell = np.empty(count, np.int64)
        inputs = np.full((count, ports), -1, np.int64)  # a register, -1 none, -2 - e an external value e of its kind
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
        chain, carry = np.ones(count, np.int64), np.zeros(count, np.int64)
        if chains:
            in_chains = np.zeros(count, bool)
            for start, end in chains:
                in_chains[start:end] = True
            chain, carry = chain_columns(cell, plan.need, inputs, written, in_chains)
        register_kinds = tuple(sorted(plan.register_groups, key=kind_index.__getitem__))
        groups = [plan.register_groups[register_kind] for register_kind in register_kinds]
        registers = sum(len(group) for group in groups)
        place = np.zeros(plan.registers + 1, np.int64)  # by register + 1: its row among the request's (0: zero row)
        if groups:
            place[np.concatenate(groups) + 1] = np.arange(1, registers + 1)
        external = inputs <= -2
        read = place[np.maximum(inputs, -1) + 1]
        read[external] = 1 + registers + (-2 - inputs[external])
        rows = np.concatenate([read, place[written + 1]], 1)
        external_kind = np.concatenate([np.where(external, kind, -1), np.full_like(written, -1)], 1)
        columns = cell, plan.need, np.arange(count), plan.has_copies, plan.ragged_start, plan.ragged_count, chain, carry
        chaining = frozenset(np.unique(cell[chain > 1]).tolist())
        ragged_rows = place[ragged + 1]
        return Template(np.stack(columns).astype(np.int64), rows, external_kind, ragged_rows, register_kinds, chaining)


class JoiningRows(NamedTuple):
    """The arena rows of requests joining together: `taken` holds each request's rows from `starts[request]`, in the
    order its template says; `external_bases` ([request, kind index]; None where all are 0): how far after its first
    kind's external values those of each kind start."""

    taken: np.ndarray
    starts: list[int]
    external_bases: np.ndarray | None


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

    def append(self, templates: list[Template], slots: list[int], priorities: list[int], rows: JoiningRows) -> None:
        """The nodes of requests joining together (their templates, request slots and priorities, and rows), after
        those held: an assignment per column for them all, whatever their number."""
        counts = [template.columns.shape[1] for template in templates]
        total = sum(counts)
        self.reserve(total)
        span = slice(self.count, self.count + total)
        for name, column in zip(PLAN_COLUMNS, joined([template.columns for template in templates], 1)):
            getattr(self, name)[span] = column
        ragged = [len(template.ragged) for template in templates]  # ragged rows, per request
        per_request = slots, priorities, rows.starts, list(itertools.accumulate(ragged[:-1], initial=len(self.ragged)))
        if len(templates) == 1:  # a request alone: its values broadcast
            request, priority, start, first_ragged = (values[0] for values in per_request)
        else:
            request, priority, start, first_ragged = np.repeat(np.array(per_request, np.int64), counts, 1)
            start = start[:, None]
        self.request[span], self.priority[span] = request, priority
        self.ragged_start[span] += first_ragged
        self.pending[span] = True
        at = joined([template.rows for template in templates]) + start
        if rows.external_bases is not None:
            kinds = np.concatenate([template.external_kind for template in templates])
            external = kinds >= 0
            requests = np.broadcast_to(np.repeat(np.arange(len(templates)), counts)[:, None], at.shape)
            at[external] += rows.external_bases[requests[external], kinds[external]]
        read, ports = rows.taken[at], self.inputs.shape[1]
        self.inputs[span], self.outputs[span] = read[:, :ports], read[:, ports:]
        if any(ragged):
            at = joined([template.ragged for template in templates]) + np.repeat(rows.starts, ragged)[:, None]
            self.ragged = np.concatenate([self.ragged, rows.taken[at]])
        self.count += total

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


def joined(arrays: list[np.ndarray], axis: int = 0) -> np.ndarray:
    """The arrays one after the other; the one itself, not a copy, when it is alone (a request joining alone)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis)


def ports_by_kind(kinds: tuple[ValueKind, ...], skip: frozenset[int] = frozenset()) -> PortGroups:
    """The ports of each kind of value, in order of first appearance (ports in `skip` left out): one gather per
    kind."""
    groups: dict[ValueKind, list[int]] = {}
    for port, kind in enumerate(kinds):
        if port not in skip:
            groups.setdefault(kind, []).append(port)
    return list(groups.items())
