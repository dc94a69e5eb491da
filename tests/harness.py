"""An in-process manager core (request processor, scheduler, dispatcher) with workers whose
arenas are real shared memory but whose stream is the test itself: tasks complete when the
test says so. Used to check scheduling decisions step by step."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.config import Config
from common.shm import SharedArray
from common.task import decode_task
from manager.dispatch import Dispatcher
from manager.plan_store import make_tables
from manager.policies import make_policy, make_scheduler
from manager.records import Request, Task
from manager.request_processor import RequestProcessor
from manager.server import load_models
from manager.worker_handle import WorkerHandle


class Harness:
    def __init__(
        self,
        config: Config,
        workers: int = 1,
        rows: int = 1024,
        max_tasks_to_submit: int = 5,
        affinity: str = "subgraph",
        hosts: list[int] | None = None,
    ):
        """`hosts`: each worker's host number (default: all on one host)."""
        self.models, self.specs, self.kinds = load_models(config)
        self._shared: list[SharedArray] = []
        self.workers = [self._worker(i, rows, host) for i, host in enumerate(hosts or [0] * workers)]
        self.sent: list[tuple[WorkerHandle, Any]] = []
        self.table, self.store = make_tables(self.specs, self.kinds)
        self.dispatcher = Dispatcher(self.table, self.store, {w.worker_id: w for w in self.workers})
        scheduling = dataclasses.replace(config.scheduler, max_tasks_to_submit=max_tasks_to_submit, affinity=affinity)
        config = dataclasses.replace(config, scheduler=scheduling)
        self.scheduler = make_scheduler(config, self.specs, self.table, self.store, self.dispatcher)
        self.scheduler.several_workers = len(self.workers) > 1
        self.policy = make_policy(config, self.models, self.scheduler, self.table)
        self.finished: list[tuple[Request, Any]] = []
        self.processor = RequestProcessor(
            self.table,
            self.store,
            self.scheduler,
            self.dispatcher,
            lambda r, e: self.finished.append((r, e)),
            self.policy,
        )
        self._next_id = 0
        self.task_requests: dict[int, list[Request]] = {}

    def _worker(self, index: int, rows: int, host: int) -> WorkerHandle:
        arenas = []
        for i, kind in enumerate(self.kinds):
            for space, arena_id in (("device", 2 * i), ("io", 2 * i + 1)):
                shared = SharedArray(kind.dtype, (rows, *kind.shape))
                self._shared.append(shared)
                arenas.append({"id": arena_id, "kind": kind.key, "space": space, "rows": rows, "shm": shared.name})
        return WorkerHandle(index, f"w{index}".encode(), {"index": index, "arenas": arenas}, self.kinds, host)

    def admit(self, model: str, inputs: dict[str, Any], name: Any = None, arrival: float = 0.0) -> Request:
        self._next_id += 1
        m = self.models[model]
        request_id = name if name is not None else self._next_id
        return self.processor.admit(b"client", request_id, m, inputs, self.policy.unfold(m, inputs), arrival)

    def schedule(self, worker: WorkerHandle) -> int:
        """Schedule(worker) as the manager runs it: the tasks formed are sent (here: recorded)."""
        tasks = self.policy.schedule(worker)
        for task in tasks:
            self.processor.task_submitted(task)
            self.sent.append((worker, decode_task(task.message)))
            self.task_requests[task.task_id] = self.processor.requests_of(task)
        return len(tasks)

    def requests_in(self, task: Task) -> list[Any]:
        """Ids of the requests the task holds nodes of, as they were when it was sent."""
        return [request.request_id for request in self.task_requests[task.task_id]]

    def in_flight(self, worker: WorkerHandle | None = None) -> list[Task]:
        workers = [worker] if worker else self.workers
        return [task for w in workers for task in w.tasks.values()]

    def complete_oldest(self, worker: WorkerHandle) -> Task:
        """The worker's stream finishes its oldest task (FIFO)."""
        task_id = min(worker.tasks)
        task = worker.tasks.pop(task_id)
        self.processor.task_completed(task, None)
        return task

    def slots_in_use(self) -> int:
        return sum(w.slots_in_use() for w in self.workers)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        for shared in self._shared:
            shared.close()
