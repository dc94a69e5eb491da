"""Agenda-based batching (DyNet's on-the-fly batching), the graph policy's choice of cell type.

The agenda is every node whose producers have run. Each step runs the ready nodes of
the cell type whose ready nodes have the lowest mean depth (longest path from a node
without producers), all of them, in tasks of at most the type's largest batch size.
Running shallow nodes first lets deeper nodes of other requests catch up, so that
they batch together later.
"""

from __future__ import annotations

from manager.scheduler import CellTypeQueue, Scheduler
from manager.store import NodeColumns


class AgendaScheduler(Scheduler):
    def choose_cell_type(self) -> CellTypeQueue | None:
        best, lowest = None, 0.0
        depth = self._store.nodes.arrays["data"][:, NodeColumns.DEPTH]
        for queue in self._ordered:
            if not queue.size:
                continue
            ready = self.ready(queue)
            if not len(ready.lanes):
                continue
            mean = float((depth[ready.first] * ready.sizes).sum()) / ready.nodes
            if best is None or mean < lowest:
                best, lowest = queue, mean
        return best
