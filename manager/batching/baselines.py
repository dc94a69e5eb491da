"""The baseline policies benchmarks compare cellular batching with (manager.batching.policies): requests
run in groups, and a group is answered together.

Requests wait in queues by key until a worker runs out of work; then the next queue in round-robin
order releases a group of them to the scheduler, bound to that worker. A member whose answer is known
is held (`Lifecycle.HELD`) until no member is left running and, padded, every member's padding has
run; then the held members are answered together. A member that fails or is replayed no longer holds
its group back.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

import numpy as np

from batchmaker.common.models.base import Planner
from batchmaker.common.plan import Unfolded
from batchmaker.manager.batching.records import Group, Lifecycle, Request, Task
from batchmaker.manager.batching.request_table import RequestTable
from batchmaker.manager.batching.scheduler import Scheduler
from batchmaker.manager.batching.worker_handle import WorkerHandle


class GroupPolicy:
    """The graph policy (DyNet, TensorFlow Fold): a group of one model's requests, merged into one graph."""

    pads = False  # a held member's remaining cells stop (padded: its padding runs on)
    holds_answers = True  # a member whose answer is known is held until its group is answered

    def __init__(self, scheduler: Scheduler, table: RequestTable, group_sizes: dict[str, int]):
        self.scheduler = scheduler
        self._table = table
        self._group_sizes = group_sizes  # by model name
        self._queues: dict[Hashable, collections.deque[Request]] = {}
        self._turns: collections.deque[Hashable] = collections.deque()  # non-empty queues, next first

    def unfold(self, model: Planner, inputs: object) -> Unfolded:
        return model.plan(inputs)

    def queue_key(self, request: Request) -> Hashable:
        return request.model.name

    def admit(self, requests: list[Request]) -> None:
        for request in requests:
            key = self.queue_key(request)
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = collections.deque()
                self._turns.append(key)
            queue.append(request)

    def schedule(self, worker: WorkerHandle) -> list[Task]:
        tasks = self.scheduler.schedule(worker)
        while not tasks and self._release_group(worker):
            tasks = self.scheduler.schedule(worker)
        return tasks

    def queued_requests(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def waits_for_group(self, request: Request) -> bool:
        """Whether its cells wait in a queue here, its group not yet released to the scheduler."""
        return request.group is None

    def answers(self, requests: list[Request]) -> tuple[list[Request], list[Request]]:
        """Of members whose answer is known (held by the request processor): those of the groups this ends,
        to answer now, and those whose cells stop."""
        ended: dict[Group, None] = {}
        for request in requests:
            group = request.group
            assert group is not None, "every request of a baseline runs in a group"
            group.unanswered -= 1
            ended[group] = None
        return self._answerable(ended), ([] if self.pads else requests)

    def task_ended(self, rows: np.ndarray) -> list[Request]:
        """A task's end may finish its members' padding."""
        table = self._table
        groups = {table.requests[row].group: None for row in rows.tolist() if table.requests[row] is not None}
        return self._answerable(groups)

    def left(self, request: Request, held: bool) -> list[Request]:
        group = request.group
        if group is None or held:  # its answer was counted already
            return []
        group.unanswered -= 1
        return self._answerable({group: None})

    def _answerable(self, groups: dict[Group | None, None]) -> list[Request]:
        """The held members of the groups among `groups` with no member left running and all padding run."""
        return [
            member
            for group in groups
            if group is not None and group.unanswered == 0 and all(self._padding_done(m) for m in group.members)
            for member in group.members
            if member.lifecycle is Lifecycle.HELD
        ]

    def _padding_done(self, request: Request) -> bool:
        need = request.unfolded.plan.padding_need
        return request.done or need is None or self._table.completed[request.row] >= need

    def _release_group(self, worker: WorkerHandle) -> bool:
        """Release the next queue's oldest requests (those not already ended) as one group."""
        while self._turns:
            key = self._turns.popleft()
            queue = self._queues[key]
            members: list[Request] = []
            size = self._group_sizes[queue[0].model.name]
            while queue and len(members) < size:
                request = queue.popleft()
                if not request.done:
                    members.append(request)
            if queue:
                self._turns.append(key)
            else:
                del self._queues[key]
            if members:
                group = Group(members)
                for request in members:
                    request.group = group
                    self._table.bind(request.row, worker.worker_id)
                self.scheduler.release(members)
                return True
        return False


class PaddedPolicy(GroupPolicy):
    """The padded policy (TensorFlow, MXNet bucketing): a group of one bucket's requests, padded to its length."""

    pads = True

    def __init__(self, scheduler: Scheduler, table: RequestTable, group_sizes: dict[str, int], bucket_width: int):
        super().__init__(scheduler, table, group_sizes)
        self.bucket_width = bucket_width

    def unfold(self, model: Planner, inputs: object) -> Unfolded:
        return model.plan_padded(inputs, self.bucket_width)

    def queue_key(self, request: Request) -> Hashable:
        return request.model.name, request.unfolded.plan.padded_length
