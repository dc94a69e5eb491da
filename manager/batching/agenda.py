"""Agenda-based batching (DyNet's on-the-fly batching), the graph policy's choice of cell type.

The agenda is every node whose producers have run. Each step runs the ready nodes of
the cell type whose ready nodes have the lowest mean depth (longest path from a node
without producers), all of them, in tasks of at most the type's largest batch size.
Running shallow nodes first lets deeper nodes of other requests catch up, so that
they batch together later.
"""

from __future__ import annotations

from batchmaker.manager.batching.cell_queues import CellTypeQueue
from batchmaker.manager.batching.plan_store import NodeColumns
from batchmaker.manager.batching.scheduler import Scheduler


class AgendaScheduler(Scheduler):
    def choose_cell_types(self) -> list[CellTypeQueue]:
        """Cell types with ready nodes, lowest mean depth of their ready nodes first."""
        depth = self._store.nodes.arrays["data"][:, NodeColumns.DEPTH]
        means = []
        for queue in self._ordered:
            if not queue.size:
                continue
            ready = self.ready(queue)
            if len(ready.lanes):
                means.append((float((depth[ready.first] * ready.sizes).sum()) / ready.nodes, queue))
        return [queue for _, queue in sorted(means, key=lambda pair: pair[0])]
