"""The batching core the server runs (manager.batching.core), with workers whose arenas are real shared
memory but whose stream is the test itself: tasks complete when the test says so. Used to check
scheduling decisions step by step; requests are admitted, scheduled, completed and cancelled
through the core's own methods, as the event loop calls them."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from batchmaker.common.config import Config
from batchmaker.common.notice import CompletionNotice
from batchmaker.common.protocol import RequestError
from batchmaker.common.shm import SharedArray
from batchmaker.common.task import LaneTaskMessage, TaskMessage, decode_task, encode_task
from batchmaker.manager.batching.core import BatchingCore
from batchmaker.manager.batching.outcomes import Answered, Failed, Outcome
from batchmaker.manager.batching.records import Request, Task
from batchmaker.manager.batching.worker_handle import WorkerHandle
from batchmaker.manager.loop.server import load_models
from batchmaker.worker.batched_task import resolve, run_steps
from batchmaker.worker.lanes import resolve_lanes, run_lanes, step_batches
from batchmaker.worker.main import load_cells


def step_sizes(message: TaskMessage | LaneTaskMessage) -> list[int]:
    """The batch of each step of a sent task: a task of waves' padded sizes, a lane task's lanes still going."""
    if isinstance(message, LaneTaskMessage):
        return step_batches(message.steps)[0]
    return [step.batch_size for step in message.steps()]


class Harness:
    def __init__(
        self,
        config: Config,
        workers: int = 1,
        rows: int = 1024,
        max_tasks_to_submit: int = 5,
        affinity: str = "subgraph",
        hosts: list[int] | None = None,
        max_steps_per_task: int = 1,
        full_task_s: dict[str, float] | None = None,
    ):
        """`hosts`: each worker's host number (default: all on one host). Tasks are single steps unless
        `max_steps_per_task` says otherwise; `full_task_s` is what each worker says its warm-up timed."""
        self.config = config
        self.models, self.specs, self.kinds = load_models(config)
        self._shared: list[SharedArray] = []
        self._arenas: list[list[torch.Tensor]] = []  # each worker's arenas by id, for `run_oldest`
        self.workers = [self._worker(i, rows, host, full_task_s) for i, host in enumerate(hosts or [0] * workers)]
        scheduling = dataclasses.replace(
            config.scheduler,
            max_tasks_to_submit=max_tasks_to_submit,
            affinity=affinity,
            max_steps_per_task=max_steps_per_task,
        )
        config = dataclasses.replace(config, scheduler=scheduling)
        self.core = BatchingCore(config, self.models, self.specs, self.kinds, {w.worker_id: w for w in self.workers})
        self.core.workers_changed()
        self.table, self.scheduler, self.processor = self.core.table, self.core.scheduler, self.core.processor
        self.sent: list[tuple[WorkerHandle, Any]] = []
        self.finished: list[tuple[Request, RequestError | None]] = []  # answers (error None) and errors, in order
        self._next_id = 0
        self.task_requests: dict[int, list[Request]] = {}

    def _worker(self, index: int, rows: int, host: int, full_task_s: dict[str, float] | None) -> WorkerHandle:
        arenas = []
        self._arenas.append([])
        for i, kind in enumerate(self.kinds):
            for space, arena_id in (("device", 2 * i), ("io", 2 * i + 1)):
                shared = SharedArray(kind.dtype, (rows, *kind.shape))
                self._shared.append(shared)
                self._arenas[-1].append(torch.from_numpy(shared.array))
                arenas.append({"id": arena_id, "kind": kind.key, "space": space, "rows": rows, "shm": shared.name})
        registration = {"index": index, "arenas": arenas, "full_task_s": full_task_s}
        return WorkerHandle(index, f"w{index}".encode(), registration, self.kinds, host)

    def admit(
        self, model: str, inputs: dict[str, Any], name: Any = None, arrival: float = 0.0, **fields: Any
    ) -> Request:
        """Admit an `infer` request; `fields` are its other fields (priority, ...)."""
        self._next_id += 1
        request_id = name if name is not None else self._next_id
        return self.core.admit(b"client", request_id, {"model": model, "inputs": inputs, **fields}, arrival)

    def schedule(self, worker: WorkerHandle) -> int:
        """Schedule(worker) as the manager runs it: the tasks formed are sent (here: recorded)."""
        tasks = self.core.schedule(worker)
        for task in tasks:
            self.sent.append((worker, decode_task(encode_task(task.message))))  # as the worker reads it
            self.task_requests[task.task_id] = self.processor.requests_of(task)
        return len(tasks)

    def requests_in(self, task: Task) -> list[Any]:
        """Ids of the requests the task holds nodes of, as they were when it was sent."""
        return [request.request_id for request in self.task_requests[task.task_id]]

    def in_flight(self, worker: WorkerHandle | None = None) -> list[Task]:
        workers = [worker] if worker else self.workers
        return [task for w in workers for task in w.tasks.values()]

    def complete_oldest(self, worker: WorkerHandle) -> Task:
        """The worker's stream finishes its oldest task (FIFO) and says so in a notice."""
        task = worker.tasks[min(worker.tasks)]
        self._record(self.core.tasks_finished(worker, CompletionNotice(worker.worker_id, [task.task_id], {}, 0)))
        return task

    def run_oldest(self, worker: WorkerHandle, cells: list[torch.nn.Module]) -> Task:
        """The worker's stream runs its oldest task for real, with `cells`, on the worker's arenas (its
        peers': the other workers'), as the CPU backend runs it; then it completes."""
        message = decode_task(encode_task(worker.tasks[min(worker.tasks)].message))
        tensors = self._arenas[worker.worker_id]
        peers = {
            (other.worker_id, arena): tensor
            for other in self.workers
            if other is not worker
            for arena, tensor in enumerate(self._arenas[other.worker_id])
        }
        with torch.inference_mode():
            if isinstance(message, LaneTaskMessage):
                lanes = resolve_lanes(message, tensors, cells, peers, self.specs[message.cell_index].stop)
                for (_, _, io, io_slots), rows in zip(lanes.downloads, run_lanes(lanes)):
                    io.index_copy_(0, io_slots, rows)
            else:
                run_steps(resolve(message, tensors, cells, peers))
        return self.complete_oldest(worker)

    def run_on_cpu(self) -> None:
        """Schedule and run every task for real (`run_oldest`) until nothing is left."""
        _, cells, _ = load_cells(self.config)
        while any(self.schedule(worker) for worker in self.workers) or self.in_flight():
            for worker in self.workers:
                if worker.tasks:
                    self.run_oldest(worker, cells)

    def cancel(self, request: Request) -> None:
        """The client cancels the request."""
        self._record(self.core.cancel(request.client, request.request_id) or [])

    def _record(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            if isinstance(outcome, Answered):
                self.finished.append((outcome.request, None))
            elif isinstance(outcome, Failed):
                self.finished.append((outcome.request, outcome.error))

    def slots_in_use(self) -> int:
        return sum(w.slots_in_use() for w in self.workers)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        for shared in self._shared:
            shared.close()
