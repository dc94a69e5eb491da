"""Lane tasks: chain lanes (common.lanes) run for several steps, described per lane in one message.

How many steps each lane takes (`steps`): its next nodes while each is ready, within the step limit
the scheduler derives from the join delay. When ready lanes were left out for want of room, no lane
takes more steps than three quarters of the task's lanes can: lanes that end leave their rows of the
batch idle until the task ends, while the lanes left out wait for it.

A lane task takes, for each lane, `steps[i]` consecutive nodes from its cursor (lanes in descending
order of steps, common.task). What it sends is per lane: each input's rows for the first step,
resolved as a single-step task resolves them (a register's row, a peer's, the zero row or an inline
value), and per output the row of the register the lane's last node writes, which the next task (or
a later reader of the lane's final state) reads. What varies step by step is packed, step after step,
and resolved in one pass: a sequence input's later values or rows (the request's tokens, the layer
below's outputs), the rows of an output read outside the lane at every step, and the host copies
(results, watched values), an io row each.
"""

from __future__ import annotations

import numpy as np

from batchmaker.common.graph import CellTypeSpec
from batchmaker.common.lanes import SEQUENCE, LaneLayout
from batchmaker.common.ranges import consecutive
from batchmaker.common.task import LaneInput, LaneTaskMessage, SlotList, StepDownload, TaskInput
from batchmaker.manager.batching.cell_queues import CellTypeQueue, Ready
from batchmaker.manager.batching.dispatch import Dispatcher
from batchmaker.manager.batching.plan_store import NodeColumns, PlanStore
from batchmaker.manager.batching.records import Task
from batchmaker.manager.batching.request_table import RequestTable
from batchmaker.manager.batching.worker_handle import WorkerHandle


class LaneTasks:
    def __init__(self, table: RequestTable, store: PlanStore, dispatcher: Dispatcher):
        self._table = table
        self._store = store
        self._dispatcher = dispatcher

    def steps(self, queue: CellTypeQueue, taken: Ready, limit: int, worker: WorkerHandle) -> np.ndarray:
        """How many steps each lane of the task takes, at most `limit`: its next nodes while each is ready
        (its lane's earlier ones count as issued), fewer when lanes were left out (above), and one each
        when the downloads of more would not fit the worker's io rows."""
        spec, table = queue.spec, self._table
        lanes, rows = taken.lanes, taken.rows
        left = np.minimum(queue.end[lanes] - queue.cursor[lanes], limit)
        if limit == 1 or int(left.max()) == 1:
            return np.ones(len(lanes), np.int64)
        window = consecutive(taken.first, left)  # the next `left` nodes of each lane
        starts = np.cumsum(left) - left
        offset = np.arange(len(window)) - np.repeat(starts, left)
        nodes = self._store.nodes.arrays["data"][window]
        ready = np.repeat(table.issued[rows], left) + offset >= nodes[:, NodeColumns.NEED]
        steps = np.minimum(np.minimum.reduceat(np.where(ready, limit, offset), starts), left)
        if not taken.everyone:
            steps = np.minimum(steps, np.sort(steps)[len(steps) // 4])
        copies = int(nodes[offset < np.repeat(steps, left), NodeColumns.HAS_COPIES].sum())
        if any(copies * spec.outputs.count(kind) > worker.io_slots[kind].available for kind in set(spec.outputs)):
            return np.ones(len(lanes), np.int64)  # the downloads of one step fit (form_batched_task saw to it)
        return steps

    def make(
        self,
        spec: CellTypeSpec,
        cell_index: int,
        layout: LaneLayout,
        rows: np.ndarray,
        steps: np.ndarray,
        first: np.ndarray,
        worker: WorkerHandle,
    ) -> Task:
        """The lane task on `worker` of `steps[i]` nodes from node `first[i]` of the request at `rows[i]`
        (steps descending), its message made (encoded as it is sent)."""
        table, store, dispatcher = self._table, self._store, self._dispatcher
        task = dispatcher.open_task(spec, rows, steps, worker)
        data_of = store.nodes.arrays["data"]
        # Every step's nodes, packed step after step: the lanes still going at each step are its first ones.
        step_of, lane_of = np.nonzero(np.arange(int(steps[0]))[:, None] < steps[None, :])
        nodes, node_rows = first[lane_of] + step_of, rows[lane_of]
        node_data = data_of[nodes]
        lanes = len(rows)  # the first step's nodes are the first `lanes`
        inputs = []
        for port, (kind, rule) in enumerate(zip(spec.inputs, layout.rules(len(spec.inputs)))):
            first_step = dispatcher.one_step_input(spec, port, node_data[:lanes], rows, worker)
            later: TaskInput | bytes | None = None
            if rule.mode == SEQUENCE and len(nodes) > lanes:
                later_data, later_rows = node_data[lanes:], node_rows[lanes:]
                refs = later_data[:, NodeColumns.INPUTS + port]
                if (refs <= -2).all():  # the request's own inputs: their values, raw
                    positions = table.ext_base[later_rows, table.kinds[kind]] + (-2 - refs)
                    later = store.externals[kind].arrays["values"][positions].tobytes()
                else:
                    later = dispatcher.one_step_input(spec, port, later_data, later_rows, worker)
            inputs.append(LaneInput(rule.mode, rule.source, worker.arena_id[kind], first_step, later))
        last = first + steps - 1
        outputs, written_at = [], []
        for port, kind in enumerate(spec.outputs):  # each lane's last value, or every step's
            writers, writer_rows = (node_data, node_rows) if port in layout.every_step else (data_of[last], rows)
            where = table.reg_base[writer_rows] + writers[:, NodeColumns.INPUTS + store.ports + port]
            written = store.written_by(where, worker.worker_id)
            outputs.append(SlotList(worker.arena_id[kind], written))
            if port in layout.every_step:
                written_at.append((port, where))
        every_step = _last_writes(written_at, step_of)
        outputs = [
            output._replace(slots=output.slots[every_step[port]]) if port in every_step else output
            for port, output in enumerate(outputs)
        ]
        batch = np.bincount(step_of)
        downloads = self._downloads(task, spec, rows, nodes, node_data, lane_of, worker)
        task.message = LaneTaskMessage(
            task.task_id, cell_index, steps, inputs, outputs, list(every_step.items()), downloads
        )
        task.step_nodes = batch.tolist()
        task.step_sizes = spec.padded_sizes(batch)
        task.batch_size = int(steps.sum())
        return task

    def _downloads(
        self, task: Task, spec: CellTypeSpec, rows: np.ndarray, nodes: np.ndarray, node_data: np.ndarray,
        lane_of: np.ndarray, worker: WorkerHandle,
    ) -> list[StepDownload]:
        """An io row for each value the host reads (results, watched values), copied from the step that
        computes it: its entry among the output's rows of every step, packed step after step (`nodes`, their
        matrix rows `node_data` and lanes `lane_of` are packed so: an entry is a position among them)."""
        table = self._table
        copied = np.flatnonzero(node_data[:, NodeColumns.HAS_COPIES])  # in the order the steps compute them
        if not len(copied):
            return []
        found: dict[int, tuple[list[int], list[int]]] = {}
        for lane, node, entry in zip(lane_of[copied].tolist(), nodes[copied].tolist(), copied.tolist()):
            request = table.requests[rows[lane]]
            for key, port in request.unfolded.plan.copies[node - int(table.node_base[request.row])]:
                kind = spec.outputs[port]
                io_slot = worker.io_slots[kind].take_one()
                taken, io = found.setdefault(port, ([], []))
                taken.append(entry)
                io.append(io_slot)
                task.reads.append((request, key, kind, io_slot))
        return [
            StepDownload(port, np.array(taken), worker.io_arena_id[spec.outputs[port]], np.array(io))
            for port, (taken, io) in found.items()
        ]


def _last_writes(written_at: list[tuple[int, np.ndarray]], step_of: np.ndarray) -> dict[int, np.ndarray]:
    """For outputs written at every step (port, the register each packed row writes): the packed rows to
    write, so that each register is written once, with its latest value. A register a step reads and
    overwrites in place may take another output's value at the next step (both of one kind), so the
    latest step wins across outputs; within a step no two outputs share a register."""
    if not written_at:
        return {}
    where = np.concatenate([registers for _, registers in written_at])
    steps = np.tile(step_of, len(written_at))
    order = np.lexsort((steps, where))
    latest = np.ones(len(order), bool)
    latest[:-1] = where[order][1:] != where[order][:-1]
    kept = np.zeros(len(where), bool)
    kept[order[latest]] = True
    return {
        port: np.flatnonzero(part)
        for (port, _), part in zip(written_at, np.split(kept, len(written_at)))
    }
