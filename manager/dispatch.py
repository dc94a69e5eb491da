"""SubmitBatchedTask and its counterpart at completion: slots, io rows and the task message.

At submission the dispatcher allocates each node's output slots on the chosen
worker, puts external inputs into the task message, and sends the task.
At completion it reads result rows back and frees every slot whose consumers
have all completed.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import numpy as np

from common.graph import CellTypeSpec, External, NodeOutput, Ragged, ValueKind
from common.slots import SCRATCH_SLOT, ZERO_SLOT
from common.task import TaskMessage, encode_task
from manager.state import NodeState, Task
from manager.workers import WorkerHandle


class _Needs:
    """Rows one node of a cell type may need, per kind: io rows for the host copies of its results
    (worst case), and device rows for its outputs counted twice. The second share stays free for the
    nodes that will read those outputs: a node's outputs are held until its consumers have run, so
    if a batch could fill the arena, nothing could take its next step and a full arena would deadlock.
    External inputs take no rows: they travel inline, in the task."""

    def __init__(self, spec: CellTypeSpec):
        outputs = collections.Counter(spec.outputs)
        self.device = [(kind, 2 * count) for kind, count in outputs.items()]
        self.io = list(outputs.items())


def _read_remote(
    remote: dict[tuple[int, int], tuple[list[int], list[int]]],
    producer: NodeState,
    port: int,
    position: int,
    kind: ValueKind,
) -> None:
    """Have the worker read this input from the producer's worker's arena (its task has completed)."""
    peer = producer.worker
    slots, positions = remote.setdefault((peer.worker_id, peer.arena_id[kind]), ([], []))
    slots.append(producer.out_slots[port])
    positions.append(position)


class Dispatcher:
    def __init__(self, specs: list[CellTypeSpec], send: Callable[[WorkerHandle, bytes], None]):
        self._cell_index = {spec.key: i for i, spec in enumerate(specs)}
        self._needs = {spec.key: _Needs(spec) for spec in specs}
        self._send = send
        self._next_task_id = 1

    def capacity(self, spec: CellTypeSpec, worker: WorkerHandle) -> int:
        """How many nodes of this cell type fit in the worker's free rows (at most one full batch)."""
        needs = self._needs[spec.key]
        limit = spec.max_batch
        for kind, count in needs.device:
            limit = min(limit, worker.slots[kind].available // count)
        for kind, count in needs.io:
            limit = min(limit, worker.io_slots[kind].available // count)
        return limit

    def submit(self, spec: CellTypeSpec, nodes: list[NodeState], worker: WorkerHandle) -> Task:
        size = spec.padded_size(len(nodes))
        task = Task(self._next_task_id, spec, nodes, worker, size)
        self._next_task_id += 1
        in_kinds, out_kinds, ragged = spec.inputs, spec.outputs, spec.ragged_inputs
        in_slots = [[] if port in ragged else [ZERO_SLOT] * size for port in range(len(in_kinds))]
        segments: list[list[int] | None] = [[] if port in ragged else None for port in range(len(in_kinds))]
        remote: list[dict[tuple[int, int], tuple[list[int], list[int]]]] = [{} for _ in in_kinds]
        inline: list[tuple[list[int], list[np.ndarray]] | None] = [None] * len(in_kinds)
        out_slots = [[SCRATCH_SLOT] * size for _ in out_kinds]
        downloads: dict[ValueKind, tuple[list[int], list[int]]] = {}
        out_allocators = [worker.slots[kind] for kind in out_kinds]
        for row, node in enumerate(nodes):
            node.worker = worker
            request = node.request
            for port, ref in enumerate(node.spec.inputs):
                kind_of_ref = type(ref)
                if kind_of_ref is NodeOutput:
                    producer = request.nodes[ref.node]
                    if producer.worker is worker:
                        in_slots[port][row] = producer.out_slots[ref.port]
                    else:
                        _read_remote(remote[port], producer, ref.port, row, in_kinds[port])
                elif kind_of_ref is External:
                    values = inline[port]
                    if values is None:
                        values = inline[port] = ([], [])
                    values[0].append(row)
                    values[1].append(request.graph.externals[ref.index])
                elif kind_of_ref is Ragged:
                    flat, rows = in_slots[port], segments[port]
                    for child in ref.refs:
                        producer = request.nodes[child.node]
                        if producer.worker is worker:
                            flat.append(producer.out_slots[child.port])
                        else:
                            _read_remote(remote[port], producer, child.port, len(flat), in_kinds[port])
                            flat.append(ZERO_SLOT)
                        rows.append(row)
            outs = tuple([allocator.take() for allocator in out_allocators])
            node.out_slots = outs
            for port, slot in enumerate(outs):
                out_slots[port][row] = slot
            for key, port in node.copies:
                kind = out_kinds[port]
                io_slot = worker.io_slots[kind].take()
                device_rows, io_rows = downloads.setdefault(kind, ([], []))
                device_rows.append(outs[port])
                io_rows.append(io_slot)
                task.results.append((node, key, kind, io_slot))
        message = TaskMessage(
            task.task_id,
            self._cell_index[spec.key],
            size,
            [
                (
                    worker.arena_id[k],
                    slots,
                    rows,
                    [(w, a, peer, at) for (w, a), (peer, at) in far.items()] or None,
                    None if values is None else (values[0], np.asarray(values[1], dtype=k.dtype).tobytes()),
                )
                for k, slots, rows, far, values in zip(in_kinds, in_slots, segments, remote, inline)
            ],
            [(worker.arena_id[k], slots) for k, slots in zip(out_kinds, out_slots)],
            [(worker.arena_id[k], dev, worker.io_arena_id[k], io) for k, (dev, io) in downloads.items()],
        )
        worker.tasks[task.task_id] = task
        task.submitted = time.perf_counter()
        self._send(worker, encode_task(message))
        return task

    def complete(self, task: Task) -> list[tuple[NodeState, int, np.ndarray]]:
        """Read the task's host copies and free the slots no one will read again.

        Results are stored on their requests; watched values are returned, in order,
        as (node, watch index, value) for the model to observe.
        """
        worker = task.worker
        observed = []
        for node, key, kind, io_slot in task.results:
            value = worker.io[kind][io_slot].copy()
            worker.io_slots[kind].give(io_slot)
            if type(key) is str:
                node.request.results[key] = value
            else:
                observed.append((node, key, value))
        for node in task.nodes:
            node.completed = True
            for producer in node.producers:
                self.release_consumer(producer)
            if node.live_consumers == 0:
                self._free_outputs(node)
        return observed

    def release_consumer(self, producer: NodeState) -> None:
        """One consumer of `producer` completed or was dropped; free its outputs after the last one."""
        producer.live_consumers -= 1
        if producer.live_consumers == 0 and producer.completed:
            self._free_outputs(producer)

    @staticmethod
    def _free_outputs(node: NodeState) -> None:
        allocators = node.worker.slots
        for kind, slot in zip(node.cell.outputs, node.out_slots):
            allocators[kind].give(slot)
        node.out_slots = ()
