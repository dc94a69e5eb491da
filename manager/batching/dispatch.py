"""SubmitBatchedTask and its counterpart at completion: slots, host copies and the task message.

At submission the dispatcher gives requests new on the worker their rows there, resolves every
input of the task's nodes to a slot (a register's latest value, the zero row, or a value read
from another worker's arena) or to an inline external value, points every output at its
register's row on the worker, and encodes the task; a multi-step task gets one such step per wave
of its lanes, each with its own slot lists and batch size, all resolved in one pass, and a step
that repeats the one before shares its slot arrays (sent as its values alone: common.task). All of
it is numpy over the task's nodes; only the few nodes whose outputs the host reads (results,
watched values) take Python each.
At completion it reads those host copies back and frees their io rows.
"""

from __future__ import annotations

import time

import numpy as np

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.plan import ZERO_REF
from batchmaker.common.ranges import consecutive
from batchmaker.common.slots import SCRATCH_SLOT, ZERO_SLOT
from batchmaker.common.task import (
    InlineValues,
    RemoteRows,
    SlotCopy,
    SlotList,
    TaskInput,
    TaskMessage,
    TaskStep,
)
from batchmaker.manager.batching.plan_store import NodeColumns, PlanStore
from batchmaker.manager.batching.records import Request, Task
from batchmaker.manager.batching.request_table import RequestTable
from batchmaker.manager.batching.waves import Layout, Reads, Waves
from batchmaker.manager.batching.worker_handle import WorkerHandle


class Dispatcher:
    def __init__(self, table: RequestTable, store: PlanStore, workers: dict[int, WorkerHandle]):
        self._table = table
        self._store = store
        self._workers = workers
        self._next_task_id = 1

    @staticmethod
    def capacity(spec: CellTypeSpec, worker: WorkerHandle | None, io_free: dict[ValueKind, int] | None = None) -> int:
        """How many nodes of this cell type the worker's free io rows (or `io_free` of them) can take
        copies of, at most a full batch."""
        limit = spec.max_batch
        for kind in set(spec.outputs):
            free = worker.io_slots[kind].available if io_free is None else io_free[kind]
            limit = min(limit, free // spec.outputs.count(kind))
        return limit

    def take_io_rows(
        self, spec: CellTypeSpec, rows: np.ndarray, counts: np.ndarray, first: np.ndarray, io_free: dict[ValueKind, int]
    ) -> None:
        """Count off `io_free` the io rows that the downloads of `counts[i]` nodes from node `first[i]` of
        the request at `rows[i]` will take (for steps not yet resolved)."""
        nodes = consecutive(first, counts)
        copied = np.flatnonzero(self._store.nodes.arrays["data"][nodes, NodeColumns.HAS_COPIES])
        if not len(copied):
            return
        table = self._table
        node_rows = np.repeat(rows, counts)
        for position in copied:
            request = table.requests[node_rows[position]]
            for _, port in request.unfolded.plan.copies[int(nodes[position] - table.node_base[request.row])]:
                io_free[spec.outputs[port]] -= 1

    def make_task(
        self, spec: CellTypeSpec, rows: np.ndarray, counts: np.ndarray, first: np.ndarray, worker: WorkerHandle
    ) -> Task:
        """The batched task on `worker` of `counts[i]` nodes from node `first[i]` of the request at `rows[i]`:
        rows placed, inputs and outputs resolved to slots; `seal` encodes it once its steps are added."""
        task = self.open_task(spec, rows, counts, worker)
        self._add_steps(task, Waves.one(rows, counts, first), worker)
        return task

    def open_task(self, spec: CellTypeSpec, rows: np.ndarray, counts: np.ndarray, worker: WorkerHandle) -> Task:
        """A new task on `worker` of `counts[i]` nodes of the request at `rows[i]`, its requests' rows placed there."""
        task = Task(self._next_task_id, spec, worker.worker_id, rows, counts.copy())
        self._next_task_id += 1
        task.submitted = time.perf_counter()
        moving = rows[self._table.home[rows] != worker.worker_id]
        if len(moving):
            self._place([self._table.requests[row] for row in moving.tolist()], worker)
        return task

    def one_step_input(
        self, spec: CellTypeSpec, port: int, node_data: np.ndarray, node_rows: np.ndarray, worker: WorkerHandle
    ) -> TaskInput:
        """Input `port` of these nodes (rows of the node matrix, of the requests at `node_rows`) as one step
        of as many rows, resolved on `worker` as a single-step task resolves it."""
        layout = Layout.one_step(len(node_rows), len(node_rows))
        reads = Reads(self._store.registers.arrays, [], layout, worker.worker_id)
        kind = spec.inputs[port]
        if port in spec.ragged_inputs:
            return self._ragged(port, kind, node_data, node_rows, layout, reads, worker)[0]
        reg_base = self._table.reg_base[node_rows]
        return self._regular(port, kind, node_data, node_rows, reg_base, layout, reads, worker)[0]

    def add_steps(self, task: Task, waves: Waves, worker: WorkerHandle) -> None:
        """More steps of lanes the task already runs (each step's rows are some of its requests), after its last."""
        order = np.argsort(task.rows)
        np.add.at(task.counts, order[np.searchsorted(task.rows, waves.rows, sorter=order)], waves.counts)
        self._add_steps(task, waves, worker)

    def seal(self, task: Task, cell_index: int) -> None:
        """The task's message, its steps in order (encoded as it is sent)."""
        first, *later = task.steps
        task.message = TaskMessage(task.task_id, cell_index, *first, tuple(later))
        task.steps = []

    def _add_steps(self, task: Task, waves: Waves, worker: WorkerHandle) -> None:
        """Resolve the nodes of every step at once, then cut the slot lists into a step each.

        A step reads a register's value from an earlier step of the same call when one wrote it (on
        this worker, at its row here), else the value it held before (`Reads`)."""
        table, store, spec = self._table, self._store, task.spec
        step_nodes = waves.step_nodes()
        step_sizes = [spec.padded_size(count) for count in step_nodes]
        layout = (
            Layout.one_step(step_nodes[0], step_sizes[0]) if len(step_sizes) == 1 else Layout(step_nodes, step_sizes)
        )
        rows, counts, first, _ = waves
        nodes = consecutive(first, counts)
        node_rows = np.repeat(rows, counts) if len(nodes) != len(rows) else rows
        reg_base = table.reg_base[node_rows]
        node_data = store.nodes.arrays["data"][nodes]  # the task's rows of the node matrix
        registers = store.registers.arrays
        out_where = [
            reg_base + node_data[:, NodeColumns.INPUTS + store.ports + port] for port in range(len(spec.outputs))
        ]
        reads = Reads(registers, out_where, layout, worker.worker_id)
        inputs: list[list[TaskInput]] = [[] for _ in step_sizes]
        for port, kind in enumerate(spec.inputs):
            if port in spec.ragged_inputs:
                entries = self._ragged(port, kind, node_data, node_rows, layout, reads, worker)
            else:
                entries = self._regular(port, kind, node_data, node_rows, reg_base, layout, reads, worker)
            for step, entry in enumerate(entries):
                inputs[step].append(entry)
        outputs: list[list[SlotList]] = [[] for _ in step_sizes]
        for port, kind in enumerate(spec.outputs):
            where = out_where[port]
            slots = np.full(layout.rows, SCRATCH_SLOT, np.int64)
            slots[layout.node_rows] = store.written_by(where, worker.worker_id)
            for step, step_slots in enumerate(layout.split(slots)):
                outputs[step].append(SlotList(worker.arena_id[kind], step_slots))
        downloads = self._downloads(task, nodes, node_data, node_rows, outputs, layout, worker)
        for step, size in enumerate(step_sizes):
            task.steps.append(TaskStep(size, inputs[step], outputs[step], downloads[step]))
        task.step_nodes.extend(step_nodes)
        task.step_sizes.extend(step_sizes)
        task.batch_size += layout.rows

    def _place(self, requests: list[Request], worker: WorkerHandle) -> None:
        """The requests' next values go to their rows on `worker`: taken now for those new there (a kind's
        for all of them at once), and written into their registers' next rows."""
        worker_id = worker.worker_id
        new = [request for request in requests if worker_id not in request.rows]
        for request in new:
            request.rows[worker_id] = {}
        if new:
            blocks = self._table.blocks[[request.row for request in new]]  # rows each takes, per kind
            for kind, column in self._table.kinds.items():
                counts = blocks[:, column].tolist()
                taken = worker.slots[kind].take(sum(counts))
                start = 0
                for request, count in zip(new, counts):
                    if count:
                        request.rows[worker_id][kind] = taken[start : start + count]
                        start += count
        where, rows = [], []
        for request in requests:
            base = int(self._table.reg_base[request.row])
            held = request.rows[worker_id]
            for kind, registers in request.unfolded.plan.register_groups.items():
                where.append(base + registers)
                rows.append(held[kind])
        if where:
            self._store.write_to(np.concatenate(where), np.concatenate(rows))

    def release_rows(self, requests: list[Request]) -> None:
        """Give back the arena rows requests hold on every worker, a kind of a worker at a time."""
        given: dict[tuple[int, ValueKind], list[np.ndarray]] = {}
        for request in requests:
            for worker_id, held in request.rows.items():
                for kind, rows in held.items():
                    given.setdefault((worker_id, kind), []).append(rows)
            request.rows = {}
        for (worker_id, kind), rows in given.items():
            self._workers[worker_id].slots[kind].give(rows[0] if len(rows) == 1 else np.concatenate(rows))

    def _regular(
        self, port: int, kind: ValueKind, node_data: np.ndarray, node_rows: np.ndarray, reg_base: np.ndarray,
        layout: Layout, reads: Reads, worker: WorkerHandle,
    ) -> list[TaskInput]:
        """An input of one row per node, a step each: a register's slot (or a peer's), the zero row,
        or an external value sent inline."""
        table, store = self._table, self._store
        refs = node_data[:, NodeColumns.INPUTS + port]
        slots = np.full(layout.rows, ZERO_SLOT, np.int64)
        owners = None
        held = np.flatnonzero(refs >= 0)
        if len(held):
            found, held_owners = reads.at(reg_base[held] + refs[held], held)
            rows = held if layout.steps == 1 else layout.position[held]
            slots[rows] = found
            if (held_owners != worker.worker_id).any():
                owners = np.full(layout.rows, worker.worker_id, np.int64)
                owners[rows] = held_owners
        inline: list[InlineValues | None] = [None] * layout.steps
        external = np.flatnonzero(refs <= -2)
        if len(external):
            where = table.ext_base[node_rows[external], table.kinds[kind]] + (-2 - refs[external])
            values = store.externals[kind].arrays["values"][where]
            for step, part in layout.by_step(external):
                positions = layout.position[external[part]] - layout.offset[step]
                inline[step] = InlineValues(positions, values[part].tobytes())
        arena = worker.arena_id[kind]
        step_slots = layout.split(slots)
        remote = self._remote_per_step(step_slots, None if owners is None else layout.split(owners), worker, kind)
        return [TaskInput(arena, s, None, r, i) for s, r, i in zip(step_slots, remote, inline)]

    def _remote_per_step(
        self, step_slots: list[np.ndarray], step_owners: list[np.ndarray] | None, worker: WorkerHandle, kind: ValueKind
    ) -> list[list[RemoteRows] | None]:
        """Each step's reads from peers' arenas (none when every value read lives on `worker`)."""
        if step_owners is None:
            return [None] * len(step_slots)
        return [self._remote(np.arange(len(s)), o, s, worker, kind) for s, o in zip(step_slots, step_owners)]

    def _remote(
        self, positions: np.ndarray, owners: np.ndarray, slots: np.ndarray, worker: WorkerHandle, kind: ValueKind
    ) -> list[RemoteRows] | None:
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

    def _ragged(
        self, port: int, kind: ValueKind, node_data: np.ndarray, node_rows: np.ndarray, layout: Layout, reads: Reads,
        worker: WorkerHandle,
    ) -> list[TaskInput]:
        """A ragged input, a step each: the step's nodes' values flattened, with the batch row each belongs to."""
        store, table = self._store, self._table
        counts = node_data[:, NodeColumns.RAGGED_COUNT]
        starts = node_data[:, NodeColumns.RAGGED_START] + table.ragged_base[node_rows]
        flat = consecutive(starts, counts)
        arena = worker.arena_id[kind]
        if len(flat) == 0:
            return [TaskInput(arena, np.zeros(0, np.int64), np.zeros(0, np.int64), None, None)] * layout.steps
        refs = store.ragged.arrays["refs"][flat, port]
        node_of = np.repeat(np.arange(len(node_data)), counts)
        slots, owners = reads.at(table.reg_base[node_rows][node_of] + refs, node_of)
        slots[refs == ZERO_REF] = ZERO_SLOT
        if layout.steps == 1:
            return [
                TaskInput(arena, slots, node_of, self._remote(np.arange(len(flat)), owners, slots, worker, kind), None)
            ]
        step_of = layout.step_of[node_of]
        segments = layout.position[node_of] - layout.offset[step_of]
        bounds = np.searchsorted(step_of, np.arange(layout.steps + 1))
        cut = bounds[1:-1]
        step_slots = np.split(slots, cut)
        remote = self._remote_per_step(step_slots, np.split(owners, cut), worker, kind)
        return [TaskInput(arena, s, g, r, None) for s, g, r in zip(step_slots, np.split(segments, cut), remote)]

    def _downloads(
        self, task: Task, nodes, node_data, node_rows, outputs, layout: Layout, worker: WorkerHandle
    ) -> list[list[SlotCopy]]:
        """Rows the host reads at completion (results, watched values): an io row each, copied by the
        step that computes them (a later step may overwrite the value)."""
        copied = np.flatnonzero(node_data[:, NodeColumns.HAS_COPIES])
        if not len(copied):
            return [[] for _ in range(layout.steps)]
        table, spec = self._table, task.spec
        copies: list[dict] = [{} for _ in range(layout.steps)]
        for position in copied:
            request = table.requests[node_rows[position]]
            local = int(nodes[position] - table.node_base[request.row])
            step = int(layout.step_of[position])
            row = int(layout.position[position] - layout.offset[step])
            for key, port in request.unfolded.plan.copies[local]:
                kind = spec.outputs[port]
                io_slot = worker.io_slots[kind].take_one()
                device, io = copies[step].setdefault(kind, ([], []))
                device.append(int(outputs[step][port].slots[row]))
                io.append(io_slot)
                task.reads.append((request, key, kind, io_slot))
        return [
            [SlotCopy(worker.arena_id[k], device, worker.io_arena_id[k], io) for k, (device, io) in step.items()]
            for step in copies
        ]

    def read_copies(self, task: Task) -> list[tuple[Request, str | int, np.ndarray]]:
        """Read the task's host copies (a kind's in one copy) and free their io rows: (request, result
        name or watch index, value) each, in the order of `task.reads`."""
        worker = self._workers[task.worker_id]
        by_kind: dict[ValueKind, list[int]] = {}
        for _, _, kind, io_slot in task.reads:
            by_kind.setdefault(kind, []).append(io_slot)
        values = {}
        for kind, io_slots in by_kind.items():
            slots = np.array(io_slots, np.int64)
            values[kind] = iter(worker.io[kind][slots])  # a copy: the rows go back at once
            worker.io_slots[kind].give(slots)
        return [(request, key, next(values[kind])) for request, key, kind, _ in task.reads]
