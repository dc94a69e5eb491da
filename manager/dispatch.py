"""SubmitBatchedTask and its counterpart at completion: slots, host copies and the task message.

At submission the dispatcher gives requests new on the worker their rows there, resolves every
input of the task's nodes to a slot (a register's latest value, the zero row, or a value read
from another worker's arena) or to an inline external value, points every output at its
register's row on the worker, and encodes the task; a multi-step task gets one such step per wave
of its lanes, each with its own slot lists and batch size. All of it is numpy over the task's nodes;
only the few nodes whose outputs the host reads (results, watched values) take Python each.
At completion it reads those host copies back and frees their io rows.
"""

from __future__ import annotations

import time

import numpy as np

from common.graph import CellTypeSpec, ValueKind
from common.plan import ZERO_REF
from common.slots import SCRATCH_SLOT, ZERO_SLOT
from common.task import InlineValues, RemoteRows, SlotCopy, SlotList, TaskInput, TaskMessage, TaskStep, encode_task
from manager.plan_store import NodeColumns, PlanStore
from manager.records import Request, Task
from manager.request_table import RequestTable
from manager.worker_handle import WorkerHandle


def _expand(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """first[i], first[i] + 1, ..., first[i] + counts[i] - 1 for every i, concatenated."""
    if len(counts) == len(first) and (counts == 1).all():
        return first
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.repeat(first - starts, counts) + np.arange(total)


class Dispatcher:
    def __init__(self, table: RequestTable, store: PlanStore, workers: dict[int, WorkerHandle]):
        self._table = table
        self._store = store
        self._workers = workers
        self._next_task_id = 1

    @staticmethod
    def capacity(spec: CellTypeSpec, worker: WorkerHandle) -> int:
        """How many nodes of this cell type the worker's io rows can take copies of (at most a full batch)."""
        limit = spec.max_batch
        for kind in set(spec.outputs):
            limit = min(limit, worker.io_slots[kind].available // spec.outputs.count(kind))
        return limit

    def make_task(
        self, spec: CellTypeSpec, rows: np.ndarray, counts: np.ndarray, first: np.ndarray, worker: WorkerHandle
    ) -> Task:
        """The batched task on `worker` of `counts[i]` nodes from node `first[i]` of the request at `rows[i]`:
        rows placed, inputs and outputs resolved to slots; `seal` encodes it once its steps are added."""
        task = Task(self._next_task_id, spec, worker.worker_id, rows, counts.copy())
        self._next_task_id += 1
        task.submitted = time.perf_counter()
        table = self._table
        for row in rows[table.home[rows] != worker.worker_id]:
            self._place(table.requests[row], worker)
        self._add_step(task, rows, counts, first, worker)
        return task

    def add_step(self, task: Task, rows: np.ndarray, counts: np.ndarray, first: np.ndarray, worker: WorkerHandle) -> None:
        """One more wave of lanes the task already runs (`rows` are some of its requests), after its last step."""
        if len(rows) == len(task.rows) and (rows == task.rows).all():  # every lane goes on, in the same order
            task.counts += counts
        else:  # some lanes have ended: find the others among the task's rows
            order = np.argsort(task.rows)
            task.counts[order[np.searchsorted(task.rows, rows, sorter=order)]] += counts
        self._add_step(task, rows, counts, first, worker)

    def seal(self, task: Task, cell_index: int) -> None:
        """Encode the task's message, its steps in order."""
        first, *later = task.steps
        task.message = encode_task(TaskMessage(task.task_id, cell_index, *first, tuple(later)))
        task.steps = []

    def _add_step(self, task: Task, rows: np.ndarray, counts: np.ndarray, first: np.ndarray, worker: WorkerHandle) -> None:
        table, store, spec = self._table, self._store, task.spec
        count = int(counts.sum())
        size = spec.padded_size(count)
        nodes = _expand(first, counts)
        node_rows = np.repeat(rows, counts) if len(nodes) != len(rows) else rows
        reg_base = table.reg_base[node_rows]
        node_data = store.nodes.arrays["data"][nodes]  # the task's rows of the node matrix
        registers = store.registers.arrays
        inputs = []
        for port, kind in enumerate(spec.inputs):
            arena = worker.arena_id[kind]
            if port in spec.ragged_inputs:
                inputs.append(self._ragged(port, kind, node_data, node_rows, worker))
                continue
            refs = node_data[:, NodeColumns.INPUTS + port]
            slots = np.full(size, ZERO_SLOT, np.int64)
            remote = inline = None
            held = refs >= 0
            if held.any():
                where = reg_base[held] + refs[held]
                slots[:count][held] = registers["slot"][where]
                remote = self._remote(np.flatnonzero(held), registers["worker"][where], slots, worker, kind)
            external = refs <= -2
            if external.any():
                at = table.ext_base[node_rows[external], table.kinds[kind]] + (-2 - refs[external])
                inline = InlineValues(np.flatnonzero(external), store.externals[kind].arrays["values"][at].tobytes())
            inputs.append(TaskInput(arena, slots, None, remote, inline))
        outputs = []
        for port, kind in enumerate(spec.outputs):
            where = reg_base + node_data[:, NodeColumns.INPUTS + store.ports + port]
            slots = np.full(size, SCRATCH_SLOT, np.int64)
            slots[:count] = written = registers["write"][where]
            registers["slot"][where] = written
            registers["worker"][where] = worker.worker_id
            outputs.append(SlotList(worker.arena_id[kind], slots))
        downloads = self._downloads(task, nodes, node_data, node_rows, outputs, worker)
        task.steps.append(TaskStep(size, inputs, outputs, downloads))
        task.step_nodes.append(count)
        task.step_sizes.append(size)
        task.batch_size += size

    def _place(self, request: Request, worker: WorkerHandle) -> None:
        """The request's next values go to its rows on `worker` (taken now, unless it has been there)."""
        held = request.rows.get(worker.worker_id)
        groups = request.unfolded.plan.register_groups
        if held is None:
            held = request.rows[worker.worker_id] = {kind: worker.slots[kind].take(len(regs)) for kind, regs in groups.items()}
        write = self._store.registers.arrays["write"]
        base = self._table.reg_base[request.row]
        for kind, regs in groups.items():
            write[base + regs] = held[kind]

    def release_rows(self, request: Request) -> None:
        """Give back the arena rows a request holds on every worker."""
        for worker_id, held in request.rows.items():
            slots = self._workers[worker_id].slots
            for kind, rows in held.items():
                slots[kind].give(rows)
        request.rows = {}

    def _remote(self, positions: np.ndarray, owners: np.ndarray, slots: np.ndarray, worker: WorkerHandle, kind: ValueKind) -> list[RemoteRows] | None:
        """Inputs whose value lives on another worker of its host (whose task has completed): read from its arena."""
        elsewhere = owners != worker.worker_id
        if not elsewhere.any():
            return None
        reads = []
        for peer in np.unique(owners[elsewhere]):
            mine = np.flatnonzero(owners == peer)
            at = positions[mine]
            worker.rows_read_from[int(peer)] += len(at)
            reads.append(RemoteRows(int(peer), self._workers[int(peer)].arena_id[kind], slots[at].copy(), at))
            slots[at] = ZERO_SLOT
        return reads

    def _ragged(self, port: int, kind: ValueKind, node_data: np.ndarray, node_rows: np.ndarray, worker: WorkerHandle) -> TaskInput:
        """A ragged input: every node's values flattened, with the batch row each belongs to."""
        store, table = self._store, self._table
        counts = node_data[:, NodeColumns.RAGGED_COUNT]
        starts = node_data[:, NodeColumns.RAGGED_START] + table.ragged_base[node_rows]
        flat = _expand(starts, counts)
        arena = worker.arena_id[kind]
        if len(flat) == 0:
            return TaskInput(arena, np.zeros(0, np.int64), np.zeros(0, np.int64), None, None)
        refs = store.ragged.arrays["refs"][flat, port]
        where = np.repeat(table.reg_base[node_rows], counts) + refs
        slots = store.registers.arrays["slot"][where].copy()
        slots[refs == ZERO_REF] = ZERO_SLOT
        owners = store.registers.arrays["worker"][where]
        remote = self._remote(np.arange(len(flat)), owners, slots, worker, kind)
        segments = np.repeat(np.arange(len(node_data)), counts)
        return TaskInput(arena, slots, segments, remote, None)

    def _downloads(self, task: Task, nodes, node_data, node_rows, outputs, worker: WorkerHandle) -> list[SlotCopy]:
        """Rows the host reads at completion (results, watched values): an io row each."""
        copied = np.flatnonzero(node_data[:, NodeColumns.HAS_COPIES])
        if not len(copied):
            return []
        table, spec = self._table, task.spec
        copies: dict = {}
        for position in copied:
            request = table.requests[node_rows[position]]
            local = int(nodes[position] - table.node_base[request.row])
            for key, port in request.unfolded.plan.copies[local]:
                kind = spec.outputs[port]
                io_slot = worker.io_slots[kind].take_one()
                device, io = copies.setdefault(kind, ([], []))
                device.append(int(outputs[port].slots[position]))
                io.append(io_slot)
                task.reads.append((request, key, kind, io_slot))
        return [SlotCopy(worker.arena_id[k], device, worker.io_arena_id[k], io) for k, (device, io) in copies.items()]

    def complete(self, task: Task) -> list[tuple[Request, int, np.ndarray]]:
        """Read the task's host copies and free their io rows.

        Results are stored on their requests; watched values are returned, in order,
        as (request, watch index, value) for the model to observe.
        """
        worker = self._workers[task.worker_id]
        observed = []
        for request, key, kind, io_slot in task.reads:
            value = worker.io[kind][io_slot].copy()
            worker.io_slots[kind].give_one(io_slot)
            if type(key) is str:
                request.results[key] = value
            else:
                observed.append((request, key, value))
        return observed

