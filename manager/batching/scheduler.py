"""Cellular batching: Algorithm 1 of the paper (Schedule, Batch, FormBatchedTask), on arrays.

One queue per cell type (manager.batching.cell_queues) holds the lanes (the paper's subgraphs: a request's
nodes of that cell type) that still have nodes to issue, oldest first, as columns: request row,
generation, cursor and end, served by priority. Schedule(worker) runs whenever a worker has few tasks
in flight and picks a cell type: one with a full batch of ready nodes, else one with ready nodes and
no running task, else any
with ready nodes; ties go to the higher priority. Batch then forms up to `max_tasks_to_submit`
tasks of that type for the worker and returns them; the caller sends them.

A lane's next wave is ready once every node of smaller depth of its request has been issued
(common.plan): on one worker the stream is FIFO, so a worker runs several steps of a request
ahead. A request is pinned to the worker its values are written on while it has tasks in
flight; with several workers, a request with nothing in flight may move (affinity "subgraph",
the paper's) to another worker of the same host, and reads the values it needs from the first
worker's arena: a request with values on a host stays on that host (a replay starts afresh, on
any), and moves only to a worker that said it can read the arenas of every worker holding its
values (GPUs without peer access may not). With affinity "request" it stays on the worker of its first task.
Readiness, placement, the arena's room and the batch size are checked for all lanes of a queue at once; nothing here
loops over cells.

Lane tasks (docs/architecture.md, "Lanes"): lanes that are chains (common.lanes) run several steps a
task, each lane as many as it can take within the join delay of expected work (manager.batching.join_delay)
and `max_steps_per_task`, lanes that end dropping off the batch. When ready lanes were left out for
want of room, no lane takes more steps than three quarters of the task's lanes can, so the batch stays
mostly full; a Batch call stops forming lane tasks once the worker holds two tasks and `max_join_delay_us`
of work, so a request that arrives waits for those tasks, however long the load made them, not for more.

Multi-step tasks of waves (the other lanes: a tree's levels, a stacked layer): when a task takes every
ready lane of its type that may run on the worker, whole waves, nothing else of that type waits that
could join it, so the same task goes on with the lanes' next waves, up to `max_steps_per_task` steps and
while it is expected to take at most the join delay. Lanes that end drop out of the later steps,
which run at the smallest batch size that holds them. A worker already holding more than that delay of
expected work gets single steps: what arrives joins the next step.
"""

from __future__ import annotations

import numpy as np

from batchmaker.common.graph import CellTypeSpec
from batchmaker.common.lanes import ONE_STEP, LaneLayout
from batchmaker.common.plan import Plan
from batchmaker.manager.batching.cell_queues import (
    FINISHED,
    NO_LAYOUT,
    ONE_STEP_LAYOUT,
    CellTypeQueue,
    Ready,
    count_passes,
    in_order_of_service,
)
from batchmaker.manager.batching.dispatch import Dispatcher
from batchmaker.manager.batching.join_delay import JoinDelay
from batchmaker.manager.batching.lane_tasks import LaneTasks
from batchmaker.manager.batching.plan_store import NodeColumns, PlanStore
from batchmaker.manager.batching.records import Request, Task
from batchmaker.manager.batching.request_table import NO_WORKER, RequestTable
from batchmaker.manager.batching.step_costs import StepCosts
from batchmaker.manager.batching.waves import Waves
from batchmaker.manager.batching.worker_handle import WorkerHandle

ROUNDING = 1e-6  # of a step: a delay that holds exactly k steps' cost holds k steps, whatever float division says
# Steps a lane that may stop early (a decoder, `CellTypeSpec.stop`) takes in one task, at most: its steps past
# the stop run for nothing, and at saturation that waste costs more than the hand-off of another task.
STEPS_BEFORE_A_STOP = 16


class Scheduler:
    def __init__(
        self,
        specs: list[CellTypeSpec],
        max_tasks_to_submit: int,
        table: RequestTable,
        store: PlanStore,
        dispatcher: Dispatcher,
        workers: dict[int, WorkerHandle],
        affinity: str = "subgraph",
        max_steps_per_task: int = 1,
        max_join_delay_us: int = 0,
        latency_target_ms: int = 100,
    ):
        self.queues = {spec.key: CellTypeQueue(spec, i) for i, spec in enumerate(specs)}
        self._ordered = sorted(self.queues.values(), key=lambda q: -q.spec.priority)
        self._numbered = len(specs)  # cell type indices given so far: one is never given twice
        self.max_tasks_to_submit = max_tasks_to_submit
        self._table = table
        self._store = store
        self._dispatcher = dispatcher
        self._workers = workers  # the registered workers, whose handles hold their tasks in flight
        self._request_affinity = affinity == "request"
        self.several_workers = False  # set by the manager: placement only needs checking then
        self.max_steps_per_task = max_steps_per_task
        self.step_costs = StepCosts()
        self.join_delay = JoinDelay(max_join_delay_us, latency_target_ms, self.step_costs)
        self._layouts: dict[LaneLayout, int] = {ONE_STEP: ONE_STEP_LAYOUT}  # every chain layout queued so far, numbered
        self._layout_list: list[LaneLayout] = [ONE_STEP]  # the same, by number
        self._lane_tasks = LaneTasks(table, store, dispatcher)

    def add_cell_types(self, specs: list[CellTypeSpec]) -> int:
        """Queues for a loaded version's cell types, which the workers number after every earlier one, those of
        failed loads included (a worker that loaded one holds its indices until told to drop it). Returns the
        index of the first."""
        first = self._numbered
        for index, spec in enumerate(specs, first):
            self.queues[spec.key] = CellTypeQueue(spec, index)
        self._numbered += len(specs)
        self._ordered = sorted(self.queues.values(), key=lambda q: -q.spec.priority)
        return first

    def remove_cell_types(self, specs: list[CellTypeSpec]) -> None:
        """A failed load's cell types leave: no request was ever admitted to them, so their queues are empty."""
        for spec in specs:
            del self.queues[spec.key]
        self._ordered = sorted(self.queues.values(), key=lambda q: -q.spec.priority)

    # -- readiness ---------------------------------------------------------------------------
    def release(self, requests: list[Request]) -> None:
        """Queue the requests' lanes, in order; their cells run from now on."""
        generations = self._table.set_runnable(np.array([request.row for request in requests]), True).tolist()
        queued: dict[str, list[tuple[int, ...]]] = {}
        for request, generation in zip(requests, generations):
            for key, lane in self._lanes_of(request.unfolded.plan):  # (cursor, end, need, wave, layout)
                queued.setdefault(key, []).append((request.row, generation, *lane[:4], request.priority, lane[4]))
        for key, lanes in queued.items():
            self.queues[key].add(lanes)

    def _lanes_of(self, plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
        """Each lane of a plan as queued: its cell type, and its first node, end, need, first wave's size
        and layout number (found once per plan)."""
        lanes = plan.cache.get(self)
        if lanes is None:
            bounds = plan.lane_bounds.tolist()
            lanes = plan.cache[self] = [
                (key, (start, end, int(plan.need[start]), int(plan.wave_end[start]) - start, self._number(layout)))
                for key, layout, start, end in zip(plan.lane_cells, plan.lane_layouts, bounds, bounds[1:])
            ]
        return lanes

    def _number(self, layout: LaneLayout | None) -> int:
        return NO_LAYOUT if layout is None else self._layout_number(layout)

    def _layout_number(self, layout: LaneLayout) -> int:
        number = self._layouts.get(layout)
        if number is None:
            number = self._layouts[layout] = len(self._layout_list)
            self._layout_list.append(layout)
        return number

    def ready(self, queue: CellTypeQueue) -> Ready:
        """Lanes with a ready wave; lanes of ended requests and finished lanes leave the queue here."""
        table = self._table
        size = queue.size
        rows = queue.row[:size]
        live = (table.generation[rows] == queue.generation[:size]) & (queue.need[:size] != FINISHED)
        if not live.all():
            queue.keep(live)
            size = queue.size
            rows = queue.row[:size]
        lanes = np.flatnonzero(table.issued[rows] >= queue.need[:size])
        rows = rows[lanes]
        return Ready(lanes, rows, queue.wave[lanes], table.node_base[rows] + queue.cursor[lanes])

    def ready_nodes(self) -> dict[str, int]:
        return {key: self.ready(queue).nodes if queue.size else 0 for key, queue in self.queues.items()}

    # -- Algorithm 1 ---------------------------------------------------------------------------
    def schedule(self, worker: WorkerHandle) -> list[Task]:
        """Schedule(worker): pick a cell type and Batch it; returns the tasks formed, for the caller to send.

        When the chosen type can form no task on this worker (its ready nodes belong to requests
        that do not fit in the worker's arena, or run elsewhere), the next type in the order of
        choice gets its turn, so that requests holding rows can finish and free them."""
        for queue in self.choose_cell_types():
            tasks = self.batch(queue, worker)
            if tasks:
                return tasks
        return []

    def choose_cell_types(self) -> list[CellTypeQueue]:
        """Cell types with ready nodes, in Algorithm 1's order of choice: a full batch ready, then no
        task running, then any; ties (and the rest) by priority."""
        ready = [(queue, self.ready(queue).nodes) for queue in self._ordered if queue.size]  # by priority
        ready = [(queue, nodes) for queue, nodes in ready if nodes]
        full = [q for q, n in ready if n >= q.spec.max_batch]
        idle = [q for q, _ in ready if not self._running(q.spec.key) and q not in full]
        return full + idle + [q for q, _ in ready if q not in full and q not in idle]

    def _running(self, key: str) -> bool:
        """Whether a task of cell type `key` is in flight on any worker."""
        return any(worker.running[key] for worker in self._workers.values())

    def batch(self, queue: CellTypeQueue, worker: WorkerHandle) -> list[Task]:
        """Up to `max_tasks_to_submit` tasks of this type for `worker`. Lane tasks stop once the worker holds
        two tasks and the floor of the join delay of expected work: what arrives then waits for that work."""
        tasks: list[Task] = []
        multi_step = None  # whether this call's tasks may take several steps; decided when the first could
        queued = None  # expected seconds of the work the worker holds, with the lane tasks formed here
        while len(tasks) < self.max_tasks_to_submit:
            taken = self.form_batched_task(queue, worker)
            if taken is None or (taken.nodes < queue.spec.min_batch and tasks):
                break
            if taken.layout != NO_LAYOUT:
                queued = self.queued_seconds(worker) if queued is None else queued
                if len(worker.tasks) + len(tasks) >= 2 and queued >= self.join_delay.floor_s:
                    break
                task = self._issue_lanes(queue, taken, worker, self.join_delay.of_task(queue, taken))
                tasks.append(task)
                queued += self.expected_seconds(task)
                continue
            task = self._issue(queue, taken, worker)
            if taken.everyone and self.max_steps_per_task > 1:
                delay = self.join_delay.of_task(queue, taken)
                if multi_step is None:
                    multi_step = self.queued_seconds(worker) <= delay
                if multi_step:
                    self._more_steps(queue, task, taken, worker, delay)
            self._dispatcher.seal(task, queue.index)
            tasks.append(task)
        return tasks

    def _more_steps(self, queue: CellTypeQueue, task: Task, taken: Ready, worker: WorkerHandle, delay: float) -> None:
        """Go on with the next waves of the task's lanes while every lane still going is ready again, all
        of them fit, and the task is expected to take at most the join delay; a lane that ends drops out.

        The task took every ready lane of its type that may run here, and only its own requests'
        nodes are issued meanwhile: no other lane of the queue (another request's) turns ready, so
        only the task's lanes need checking. The steps are resolved to slots together, once."""
        spec = queue.spec
        cost = self.step_costs.seconds(spec.key, task.step_sizes[0])
        if cost is None or cost <= 0:
            return
        steps = min(self.max_steps_per_task, int(delay / cost + ROUNDING)) - 1
        going = queue.need[taken.lanes] != FINISHED
        lanes, rows = taken.lanes[going], taken.rows[going]
        if steps <= 0 or not len(lanes):
            return
        io_free = {kind: worker.io_slots[kind].available for kind in set(spec.outputs)}
        waves = self._wave_steps(queue, lanes, rows, steps, io_free)
        if waves.per_step:
            self._dispatcher.add_steps(task, waves, worker)

    def _wave_steps(
        self, queue: CellTypeQueue, lanes: np.ndarray, rows: np.ndarray, steps: int, io_free: dict
    ) -> Waves:
        """Up to `steps` more steps, a wave of each lane still going at a time."""
        spec, table, dispatcher = queue.spec, self._table, self._dispatcher
        found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        while len(found) < steps:
            if found:
                going = queue.need[lanes] != FINISHED
                if not going.all():
                    lanes, rows = lanes[going], rows[going]
                    if not len(lanes):
                        break
            if (table.issued[rows] < queue.need[lanes]).any():
                break
            sizes, first = queue.wave[lanes], table.node_base[rows] + queue.cursor[lanes]
            if int(sizes.sum()) > dispatcher.capacity(spec, None, io_free):
                break
            dispatcher.take_io_rows(spec, rows, sizes, first, io_free)
            table.step_issued(rows, sizes)
            self._advance(queue, Ready(lanes, rows, sizes, first))
            found.append((rows, sizes, first))
        return Waves.joined(found)

    def queued_seconds(self, worker: WorkerHandle) -> float:
        """Expected seconds of the work `worker` holds (its tasks in flight, not those being formed)."""
        return sum(self.expected_seconds(task) for task in worker.tasks.values())

    def expected_seconds(self, task: Task) -> float:
        """Expected seconds of a task: its steps at the cost of its first; a step with no estimate counts nothing."""
        cost = self.step_costs.seconds(task.spec.key, task.step_sizes[0])
        return 0.0 if cost is None else cost * len(task.step_sizes)

    def form_batched_task(self, queue: CellTypeQueue, worker: WorkerHandle) -> Ready | None:
        """The waves the next task of this type on `worker` takes: ready lanes in queue order whose
        request may run there and fits in its arena, up to a full batch (a wave may be split)."""
        ready = self.ready(queue)
        if not len(ready.lanes):
            return None
        ready = in_order_of_service(queue, ready)
        # A task takes lanes of one layout (waves: none), the first served's; one-step lanes fit any.
        layouts = queue.layout[ready.lanes]
        others = layouts != ONE_STEP_LAYOUT
        layout = int(layouts[int(np.argmax(others))])
        fits = (layouts == layout) | ~others
        alike = bool(fits.all())
        if not alike:
            ready = Ready(ready.lanes[fits], ready.rows[fits], ready.sizes[fits], ready.first[fits])
        table = self._table
        rows = ready.rows
        home = table.home[rows]
        here = home == worker.worker_id
        if self.several_workers or self._request_affinity:
            bound = table.bound[rows]
            allowed = (bound == NO_WORKER) | (bound == worker.worker_id)
            movable = home == NO_WORKER
            if self.several_workers and not self._request_affinity:  # to a worker that can read its values
                movable |= (table.inflight[rows] == 0) & (table.host[rows] == worker.host_number)
                if worker.unread:
                    self._keep_readable(movable & ~here, rows, movable, worker)
            keep = allowed & (here | movable)
        else:
            keep = np.ones(len(rows), bool)
        placed = int(keep.sum())  # the lanes that may run here
        # Requests new on this worker take their rows here: stop at the first that does not fit.
        new = ~here & keep
        if new.any():
            room = np.ones(len(rows), bool)
            for kind, column in table.kinds.items():
                needed = np.cumsum(np.where(new, table.blocks[rows, column], 0))
                room &= needed <= worker.slots[kind].available
            cut = np.argmin(room) if not room.all() else len(rows)
            keep[cut:] = False
        if not keep.all():
            ready = Ready(ready.lanes[keep], rows[keep], ready.sizes[keep], ready.first[keep])
        limit = self._dispatcher.capacity(queue.spec, worker)
        if not len(ready.lanes) or limit <= 0:
            return None
        total = np.cumsum(ready.sizes)
        if total[-1] <= limit:
            ready.everyone = alike and len(ready.lanes) == placed  # none waits for room
            ready.layout = layout
            return ready
        last = int(np.searchsorted(total, limit, side="left"))  # the lane that reaches the limit gives part of its wave
        sizes = ready.sizes[: last + 1].copy()
        sizes[last] = limit - (total[last] - sizes[last])
        lanes, rows, first = ready.lanes[: last + 1], ready.rows[: last + 1], ready.first[: last + 1]
        return Ready(lanes, rows, sizes, first, ready.lanes[last + 1 :], layout=layout)

    def _keep_readable(self, moving: np.ndarray, rows: np.ndarray, movable: np.ndarray, worker: WorkerHandle) -> None:
        """Of the requests `moving` to `worker`, clear in `movable` those with values on a worker whose arenas
        it cannot read, or has not yet said it can: a request's rows name every worker it has values on.
        Only for a worker with such peers, which are rare: a worker reports its peers as it registers."""
        requests = self._table.requests
        at = np.flatnonzero(moving)
        movable[at] = [worker.unread.isdisjoint(requests[row].rows) for row in rows[at]]

    def _issue(self, queue: CellTypeQueue, taken: Ready, worker: WorkerHandle) -> Task:
        """UpdateNodesDependency: the lanes advance, their requests count the issued nodes and are
        pinned to the worker; the dispatcher turns the waves into the task message."""
        task = self._dispatcher.make_task(queue.spec, taken.rows, taken.sizes, taken.first, worker)
        self._advance(queue, taken)
        count_passes(queue, taken)
        task.joining = self._table.task_issued(
            taken.rows, taken.sizes, worker.worker_id, worker.host_number, task.submitted
        )
        if self._request_affinity:
            self._table.bind(taken.rows, worker.worker_id)
        return task

    def _issue_lanes(self, queue: CellTypeQueue, taken: Ready, worker: WorkerHandle, delay: float) -> Task:
        """A lane task: each lane takes as many steps as it can within the join delay (`LaneTasks.steps`),
        lanes in descending order of steps; the lanes advance and their requests count the nodes, as for a
        task of waves."""
        cost = self.step_costs.seconds(queue.spec.key, queue.spec.padded_size(len(taken.lanes)))
        limit = 1
        if self.max_steps_per_task > 1 and cost is not None and cost > 0:
            limit = max(1, min(self.max_steps_per_task, int(delay / cost + ROUNDING)))
            if queue.spec.stop is not None:
                limit = min(limit, STEPS_BEFORE_A_STOP)
        steps = self._lane_tasks.steps(queue, taken, limit, worker)
        order = np.argsort(-steps, kind="stable")
        lanes, rows, steps, first = taken.lanes[order], taken.rows[order], steps[order], taken.first[order]
        layout = self._layout_list[taken.layout]
        task = self._lane_tasks.make(queue.spec, queue.index, layout, rows, steps, first, worker)
        done = Ready(lanes, rows, steps, first, taken.left_out)
        self._advance(queue, done)
        count_passes(queue, done)
        task.joining = self._table.task_issued(rows, steps, worker.worker_id, worker.host_number, task.submitted)
        if self._request_affinity:
            self._table.bind(rows, worker.worker_id)
        return task

    def _advance(self, queue: CellTypeQueue, taken: Ready) -> None:
        """Move the lanes' cursors past the nodes taken, to their next wave (or mark them finished)."""
        lanes = taken.lanes
        cursor = queue.cursor[lanes] + taken.sizes
        queue.cursor[lanes] = cursor
        going = cursor < queue.end[lanes]
        queue.need[lanes[~going]] = FINISHED
        if going.any():
            lanes, cursor = lanes[going], cursor[going]
            nodes = self._store.nodes.arrays["data"][taken.first[going] + taken.sizes[going]]
            queue.need[lanes] = nodes[:, NodeColumns.NEED]
            queue.wave[lanes] = nodes[:, NodeColumns.WAVE_END] - cursor
