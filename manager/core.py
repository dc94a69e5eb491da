"""The batching core: the one place that owns live requests, their plans, the cell-type queues,
the workers' arena rows and every worker's tasks in flight.

It does no I/O and never calls back: each method returns what happened, as outcomes (a
request answered, failed or replayed) or as the tasks to send, and the event loop
(manager.server) turns those into messages and one stats event each. The parts it is made
of: the registry of live requests by client (manager.registry), the request table and plan
store (manager.request_table, manager.plan_store), the batching policy over the scheduler
(manager.policies, manager.scheduler), the dispatcher (manager.dispatch), admission control
(manager.admission) and the request processor (manager.request_processor), which follows
requests from admission to their answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from common.config import Config
from common.graph import CellTypeSpec, ValueKind
from common.models.base import Planner
from common.protocol import (
    BAD_REQUEST,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    OVERLOADED,
    UNAVAILABLE,
    UNKNOWN_MODEL,
    WORKER_LOST,
    RequestError,
    echo,
)
from common.task import CompletionNotice
from manager.admission import Admission, warm_up_capacity
from manager.dispatch import Dispatcher
from manager.outcomes import Outcome, Replayed
from manager.plan_store import make_tables
from manager.policies import make_policy, make_scheduler
from manager.records import Request, Task
from manager.registry import RequestRegistry
from manager.request_processor import RequestProcessor
from manager.worker_handle import WorkerHandle


class BatchingCore:
    def __init__(
        self,
        config: Config,
        models: dict[str, Planner],
        specs: list[CellTypeSpec],
        kinds: list[ValueKind],
        workers: dict[int, WorkerHandle],
    ):
        """`workers`: the registered workers by id, kept up to date by whoever registers them (the
        worker pool); `workers_changed` and `worker_lost` tell the core when the set changed."""
        self._server = config.server
        self._max_batches = {spec.key: spec.max_batch for spec in specs}
        self.models = models
        self.workers = workers
        self.requests = RequestRegistry()
        self.admission = Admission(self._server.max_queue_delay_ms)
        self.table, self.store = make_tables(specs, kinds)
        self.dispatcher = Dispatcher(self.table, self.store, workers)
        self.scheduler = make_scheduler(config, specs, self.table, self.store, self.dispatcher)
        self.policy = make_policy(config, models, self.scheduler, self.table)
        self.processor = RequestProcessor(self.table, self.store, self.scheduler, self.dispatcher, self.policy)

    # -- requests ------------------------------------------------------------------------------
    def admit(self, client: bytes, request_id: Any, message: dict[str, Any], arrival: float) -> Request:
        """Validate an `infer` message and admit its request; raises RequestError to refuse it.

        The cheap checks come first, so that refusing under load costs no plan."""
        name = message.get("model")
        if not isinstance(name, str):
            raise RequestError(BAD_REQUEST, "request lacks 'model' (the name of a served model)")
        model = self.models.get(name)
        if model is None:
            raise RequestError(UNKNOWN_MODEL, f"no model named {echo(name)}; this server has {', '.join(self.models)}")
        if "inputs" not in message:
            raise RequestError(BAD_REQUEST, "request lacks 'inputs' (a map)")
        if (client, request_id) in self.requests:
            raise RequestError(BAD_REQUEST, f"request id {request_id!r} is already in flight on this connection")
        deadline_ms = _optional_int(message, "deadline_ms", minimum=0)
        _optional_int(message, "priority")
        limit = self._server.max_queued_requests
        if len(self.requests) >= limit:
            raise RequestError(OVERLOADED, f"{len(self.requests)} requests in flight (limit {limit}); retry later")
        deadline_ms = deadline_ms if deadline_ms is not None else self._server.default_deadline_ms or None
        self.admission.check(self.processor.unfinished_nodes, deadline_ms)
        unfolded = self.policy.unfold(model, message["inputs"])
        queued = self.processor.unsubmitted_nodes
        if queued + unfolded.plan.nodes > self._server.max_queued_nodes:
            raise RequestError(OVERLOADED, f"{queued} cells queued (limit {self._server.max_queued_nodes}); retry later")
        request = self.processor.admit(client, request_id, model, message["inputs"], unfolded, arrival)
        if deadline_ms is not None:
            request.deadline = arrival + deadline_ms / 1e3
        self.requests.add(request)
        return request

    def cancel(self, client: bytes, request_id: Any) -> list[Outcome] | None:
        """End a client's request at its asking; None if no such request is in flight."""
        request = self.requests.get(client, request_id)
        if request is None:
            return None
        return self._fail([request], RequestError(CANCELLED, "cancelled by the client"))

    def clients_gone(self, clients: Iterable[bytes]) -> list[Outcome]:
        return self._fail(self.requests.of_clients(clients), RequestError(CANCELLED, "the client disconnected"))

    def expire(self) -> list[Outcome]:
        """End the requests whose deadline has passed."""
        return self._fail(list(self.requests.expired()), RequestError(DEADLINE_EXCEEDED, "the request's deadline passed"))

    def shutdown(self) -> list[Outcome]:
        message = "the server stopped before finishing the request; send it elsewhere"
        return self._fail(self.requests.all(), RequestError(UNAVAILABLE, message))

    def wait_ms(self, longest: int) -> int:
        """How long the event loop may sleep before the next deadline (at most `longest`)."""
        return self.requests.wait_ms(longest)

    # -- workers -------------------------------------------------------------------------------
    def schedule(self, worker: WorkerHandle) -> list[Task]:
        """Schedule(worker): the batched tasks to send it now (none if nothing is ready for it)."""
        tasks = self.policy.schedule(worker)
        for task in tasks:
            worker.tasks[task.task_id] = task
            self.processor.task_submitted(task)
        return tasks

    def complete(self, worker: WorkerHandle, notice: CompletionNotice) -> list[Outcome]:
        """The tasks a worker's notice reports finished: requests progress, and those done are answered."""
        for task_id in notice.task_ids:
            task = worker.tasks.pop(task_id, None)
            if task is not None:
                worker.tasks_completed += 1
                self.admission.completed(task.nodes, task.spec.max_batch, worker.worker_id, task.submitted)
                self.processor.task_completed(task, notice.errors.get(task_id))
        return self._outcomes()

    def workers_changed(self) -> None:
        """Workers registered or left: placement is checked only while there are several, and until
        admission has measured the capacity, it quotes the one the workers timed at warm-up."""
        self.scheduler.several_workers = len(self.workers) > 1
        timings = [worker.full_task_s for worker in self.workers.values()]
        self.admission.estimator.assume(warm_up_capacity(timings, self._max_batches))

    def worker_lost(self, worker: WorkerHandle, reason: str, draining: bool = False) -> list[Outcome]:
        """Forget a dead worker (already gone from `workers`) and replay, on the others, every request
        that had values there; one that has lost its worker more than `max_replays` times fails, and
        with no worker left they all do (UNAVAILABLE while `draining`: a stopping server's loss is not
        the request's)."""
        self.workers_changed()
        tasks = list(worker.tasks.values())
        worker.tasks.clear()
        for request in self.processor.worker_lost(worker, tasks):
            request.failures += 1
            if request.failures > self._server.max_replays:
                message = f"it lost its worker {request.failures} times (last: {reason}); it is not replayed again"
                self.processor.fail(request, RequestError(INTERNAL, message))
            elif not self.workers:
                code = UNAVAILABLE if draining else WORKER_LOST
                self.processor.fail(request, RequestError(code, f"its worker was lost ({reason}) and none remains"))
            else:
                self.processor.replay(request)
        return self._outcomes()

    # -- introspection -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The core's part of the `stats` reply."""
        return {
            "requests_in_flight": len(self.requests),
            "requests_waiting_for_a_batch": self.policy.queued_requests(),
            "admission": self.admission.snapshot(self.processor.unfinished_nodes),
            "ready_nodes": self.scheduler.ready_nodes(),
        }

    # -- outcomes ------------------------------------------------------------------------------
    def _fail(self, requests: list[Request], error: RequestError) -> list[Outcome]:
        for request in requests:
            self.processor.fail(request, error)
        return self._outcomes()

    def _outcomes(self) -> list[Outcome]:
        """What the processor concluded since the last call; the registry follows it."""
        outcomes = self.processor.take_outcomes()
        for outcome in outcomes:
            if isinstance(outcome, Replayed):
                self.requests.add(outcome.request)
            else:
                self.requests.remove(outcome.request)
        return outcomes


def _optional_int(message: dict[str, Any], field: str, minimum: int | None = None) -> int | None:
    value = message.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise RequestError(BAD_REQUEST, f"'{field}' must be an integer{bound}, got {echo(value)}")
    return value

