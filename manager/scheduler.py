"""Cellular batching: Algorithm 1 of the paper (Schedule, Batch, FormBatchedTask).

One queue of subgraphs per cell type. Schedule(worker) runs whenever a worker is
idle and picks a cell type: one with a full batch of ready nodes, else one with
ready nodes and no running task, else any with ready nodes; ties go to the higher
priority. Batch then submits up to `max_tasks_to_submit` tasks of that type to the
worker. A dependency between nodes submitted to the same worker counts as met at
submission (the worker's stream is FIFO), which lets a worker run several steps of
a subgraph ahead; subgraphs are pinned to the worker while they have tasks in flight.

With several workers, a subgraph that is not pinned may move: its next nodes can run on
another worker, which reads their inputs from the producing worker's arena once the
producing tasks have completed (affinity "subgraph", the paper's). With affinity
"request", every node of a request runs on the worker of its first node.
"""

from __future__ import annotations

from typing import Callable

from common.graph import CellTypeSpec
from manager.state import NodeState, Request, Subgraph, Task
from manager.workers import WorkerHandle

SubmitFn = Callable[[CellTypeSpec, list[NodeState], WorkerHandle], Task]
CapacityFn = Callable[[CellTypeSpec, WorkerHandle], int]


class CellTypeQueue:
    """Subgraphs of one cell type that have ready nodes or nodes still to submit, oldest first."""

    __slots__ = ("spec", "subgraphs", "num_ready", "running_tasks")

    def __init__(self, spec: CellTypeSpec):
        self.spec = spec
        self.subgraphs: dict[Subgraph, None] = {}  # insertion-ordered set
        self.num_ready = 0
        self.running_tasks = 0


class Scheduler:
    def __init__(
        self,
        specs: list[CellTypeSpec],
        max_tasks_to_submit: int,
        submit: SubmitFn,
        capacity: CapacityFn,
        affinity: str = "subgraph",
    ):
        self.queues = {spec.key: CellTypeQueue(spec) for spec in specs}
        self._ordered = sorted(self.queues.values(), key=lambda q: -q.spec.priority)
        self.max_tasks_to_submit = max_tasks_to_submit
        self._submit = submit
        self._capacity = capacity
        self._request_affinity = affinity == "request"
        self.several_workers = False  # set by the manager: placement only needs checking then

    # -- readiness ---------------------------------------------------------------------------
    def release(self, request: Request) -> None:
        """Queue a request's nodes that wait for no other node."""
        for node in request.nodes:
            if node.pending == 0:
                self.node_ready(node)

    def node_ready(self, node: NodeState) -> None:
        subgraph = node.subgraph
        subgraph.ready.append(node)
        queue = self.queues[subgraph.cell_key]
        queue.num_ready += 1
        if not subgraph.queued:
            subgraph.queued = True
            queue.subgraphs[subgraph] = None

    def discard(self, subgraphs: list[Subgraph]) -> None:
        """Take a finished request's subgraphs out of the queues: their remaining nodes will not run."""
        for subgraph in subgraphs:
            queue = self.queues[subgraph.cell_key]
            if subgraph.queued:
                del queue.subgraphs[subgraph]
                subgraph.queued = False
            queue.num_ready -= len(subgraph.ready)
            subgraph.ready.clear()

    # -- Algorithm 1 ---------------------------------------------------------------------------
    def schedule(self, worker: WorkerHandle) -> int:
        """Schedule(worker): pick a cell type and Batch it; returns the number of tasks submitted."""
        chosen = self.choose_cell_type()
        if chosen is None:
            return 0
        return self.batch(chosen, worker)

    def choose_cell_type(self) -> CellTypeQueue | None:
        queues = self._ordered  # highest priority first, so the first match wins ties
        chosen = next((q for q in queues if q.num_ready >= q.spec.max_batch), None)
        if chosen is None:
            chosen = next((q for q in queues if q.running_tasks == 0 and q.num_ready > 0), None)
        if chosen is None:
            chosen = next((q for q in queues if q.num_ready > 0), None)
        return chosen

    def batch(self, queue: CellTypeQueue, worker: WorkerHandle) -> int:
        num_tasks = 0
        while num_tasks < self.max_tasks_to_submit:
            batch = self.form_batched_task(queue, worker)
            if not batch:
                break
            if len(batch) < queue.spec.min_batch and num_tasks > 0:
                self._put_back(queue, batch)
                break
            task = self._submit(queue.spec, batch, worker)
            queue.running_tasks += 1
            self.update_nodes_dependency(queue, task)
            num_tasks += 1
        return num_tasks

    def form_batched_task(self, queue: CellTypeQueue, worker: WorkerHandle) -> list[NodeState]:
        limit = self._capacity(queue.spec, worker)
        batch: list[NodeState] = []
        if limit <= 0:
            return batch
        check_placement = self.several_workers and not self._request_affinity
        for subgraph in queue.subgraphs:
            if subgraph.pinned_worker not in (None, worker):
                continue
            if self._request_affinity and subgraph.request.worker not in (None, worker):
                continue
            ready = subgraph.ready
            if check_placement:
                self._take_placeable(ready, worker, batch, limit)
            else:
                while ready and len(batch) < limit:
                    batch.append(ready.popleft())
            if len(batch) == limit:
                break
        queue.num_ready -= len(batch)
        return batch

    @staticmethod
    def _take_placeable(ready, worker: WorkerHandle, batch: list[NodeState], limit: int) -> None:
        """Take the ready nodes whose inputs `worker` can read: its own, or those of completed tasks."""
        waiting = []
        while ready and len(batch) < limit:
            node = ready.popleft()
            if all(p.worker is worker or p.completed for p in node.producers):
                batch.append(node)
            else:
                waiting.append(node)
        ready.extendleft(reversed(waiting))

    def _put_back(self, queue: CellTypeQueue, batch: list[NodeState]) -> None:
        for node in reversed(batch):
            node.subgraph.ready.appendleft(node)
        queue.num_ready += len(batch)

    def update_nodes_dependency(self, queue: CellTypeQueue, task: Task) -> None:
        """Nodes just submitted satisfy their consumers (same worker: FIFO stream); pin their subgraphs."""
        worker = task.worker
        pinned: set[Subgraph] = set()
        for node in task.nodes:
            request = node.request
            if request.worker is None:
                request.worker = worker
            if request.started is None:
                request.started = task.submitted
            request.in_flight += 1
            subgraph = node.subgraph
            if subgraph not in pinned:
                pinned.add(subgraph)
                subgraph.pinned_worker = worker
                subgraph.running_tasks += 1
            subgraph.remaining -= 1
            if subgraph.remaining == 0:
                del queue.subgraphs[subgraph]
                subgraph.queued = False
            for consumer in node.consumers:
                consumer.pending -= 1
                if consumer.pending == 0:
                    self.node_ready(consumer)

    def task_completed(self, task: Task) -> None:
        """Unpin subgraphs whose last running task this was."""
        self.queues[task.spec.key].running_tasks -= 1
        seen: set[Subgraph] = set()
        for node in task.nodes:
            subgraph = node.subgraph
            if subgraph in seen:
                continue
            seen.add(subgraph)
            subgraph.running_tasks -= 1
            if subgraph.running_tasks == 0:
                subgraph.pinned_worker = None

    def ready_nodes(self) -> dict[str, int]:
        return {key: queue.num_ready for key, queue in self.queues.items()}
