"""How long a multi-step task may run: the join delay, chosen by load.

A request that arrives while its worker runs a multi-step task, or whose lanes were left out of the task
for want of room, waits for the task to end before it joins the batch. Every task also has a fixed cost,
paid once whatever its steps (manager.batching.step_costs): the manager forms, sends and completes it,
the worker takes it up. At a light load that cost is paid from idle time, so tasks stay short and a
request joins within `[scheduler] max_join_delay_us`, the floor. At saturation the same cost paid every
step or two is most of what the server does (a task a step: the manager's time a task is several steps'
compute), so the longer tasks run, the more requests the server holds at the same latency.

The load is read from the nodes of the task's cell type ready for it: while they all fit the task (nobody
waits to join it for want of room), the floor holds, whatever the number of requests in flight: tasks do not
grow while the server keeps up. As nodes are left out the delay rises, reaching, when a whole second batch
waits, the delay that makes the fixed cost a tenth of the task's compute, at most a fifth of
`[scheduler] latency_target_ms` (the latency the operator wants, e.g. the p90 bound): what one join may add
to a waiting request's latency. A fixed cost not yet measured keeps the floor. Tasks of waves (a tree's
levels) go on with their lanes' next waves only when nothing else could join them, so nobody is left out of
them: theirs stays at the floor.
"""

from __future__ import annotations

from batchmaker.manager.batching.cell_queues import CellTypeQueue, Ready
from batchmaker.manager.batching.step_costs import StepCosts

FIXED_SHARE = 0.1  # under full load, a task's fixed cost is at most this share of its compute
JOIN_SHARE = 0.2  # the share of the latency target one join delay may take


class JoinDelay:
    def __init__(self, floor_us: int, latency_target_ms: int, costs: StepCosts):
        self.floor_s = floor_us / 1e6
        self._cap_s = max(self.floor_s, JOIN_SHARE * latency_target_ms / 1e3)
        self._costs = costs

    def of_task(self, queue: CellTypeQueue, taken: Ready) -> float:
        """The join delay of a task taking `taken` from `queue`: by the nodes ready for it, those left out
        included."""
        spec = queue.spec
        ready = taken.nodes
        if taken.left_out is not None and len(taken.left_out):
            ready += int(queue.wave[taken.left_out].sum())
        batch_size = spec.padded_size(min(taken.nodes, spec.max_batch))
        return self.seconds(spec.key, batch_size, ready, spec.max_batch)

    def seconds(self, key: str, batch_size: int, ready: int, max_batch: int) -> float:
        """The expected duration a task of cell type `key` whose first step runs at `batch_size` may take,
        when `ready` nodes of that type (a batch holds `max_batch`) are ready for it."""
        waiting = min(1.0, ready / max_batch - 1.0)  # nodes left out for want of room, in full batches
        if waiting <= 0.0:
            return self.floor_s
        fixed = self._costs.fixed_seconds(key, batch_size)
        wanted = min(self._cap_s, max(self.floor_s, fixed / FIXED_SHARE))
        return self.floor_s + (wanted - self.floor_s) * waiting
