"""Agenda-based batching (DyNet's on-the-fly batching), the graph policy's choice of cell type.

The agenda is every node whose producers have run. Each step runs the ready nodes of
the cell type whose ready nodes have the lowest mean depth (longest path from a node
without producers), all of them, in tasks of at most the type's largest batch size.
Running shallow nodes first lets deeper nodes of other requests catch up, so that
they batch together later.
"""

from __future__ import annotations

from manager.scheduler import CellTypeQueue, Scheduler
from manager.state import NodeState, Subgraph
from manager.workers import WorkerHandle


class AgendaScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._depth_sums = {key: 0 for key in self.queues}  # total depth of each type's ready nodes

    def choose_cell_type(self) -> CellTypeQueue | None:
        ready = [queue for queue in self._ordered if queue.num_ready > 0]
        if not ready:
            return None
        return min(ready, key=lambda q: self._depth_sums[q.spec.key] / q.num_ready)

    def node_ready(self, node: NodeState) -> None:
        super().node_ready(node)
        self._depth_sums[node.subgraph.cell_key] += node.depth

    def discard(self, subgraphs: list[Subgraph]) -> None:
        for subgraph in subgraphs:
            self._depth_sums[subgraph.cell_key] -= sum(node.depth for node in subgraph.ready)
        super().discard(subgraphs)

    def form_batched_task(self, queue: CellTypeQueue, worker: WorkerHandle) -> list[NodeState]:
        batch = super().form_batched_task(queue, worker)
        self._depth_sums[queue.spec.key] -= sum(node.depth for node in batch)
        return batch

    def _put_back(self, queue: CellTypeQueue, batch: list[NodeState]) -> None:
        super()._put_back(queue, batch)
        self._depth_sums[queue.spec.key] += sum(node.depth for node in batch)
