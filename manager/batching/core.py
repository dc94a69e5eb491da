"""The batching core: the one place that owns live requests, their plans, the cell-type queues,
the workers' arena rows and every worker's tasks in flight.

It does no I/O and never calls back: each method returns what happened, as outcomes (a
request answered, failed, replayed or refused before admission, or a streamed request's partial
reply) or as the tasks to send, and the event loop (manager.loop.server) turns those into messages
and one stats event each. The parts it is made
of: the request table, which holds every live request and indexes the unanswered ones by
client with their deadlines, and the plan store (manager.batching.request_table, manager.batching.plan_store),
the session store and the turns its requests take (manager.batching.sessions, manager.batching.session_turns),
the batching policy over the scheduler (manager.batching.policies, manager.batching.scheduler), the dispatcher
(manager.batching.dispatch), admission control (manager.batching.admission) and the request processor
(manager.batching.request_processor), which follows requests from admission to their answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable
from typing import Any

from batchmaker.common.config import Config
from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.models.base import Planner
from batchmaker.common.notice import CompletionNotice
from batchmaker.common.protocol import (
    BAD_REQUEST,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    OVERLOADED,
    UNAVAILABLE,
    WORKER_LOST,
    RequestError,
)
from batchmaker.common.task import LaneTaskMessage
from batchmaker.manager.batching.admission import (
    Admission,
    Burst,
    check_room,
    deadline_of,
    inputs_of,
    stream_and_priority,
    warm_up_capacity,
)
from batchmaker.manager.batching.dispatch import Dispatcher
from batchmaker.manager.batching.outcomes import Outcome, Refused
from batchmaker.manager.batching.plan_store import make_tables
from batchmaker.manager.batching.policies import make_policy, make_scheduler
from batchmaker.manager.batching.records import Request, Task
from batchmaker.manager.batching.request_processor import RequestProcessor
from batchmaker.manager.batching.routed import Routed
from batchmaker.manager.batching.session_turns import SessionTurns
from batchmaker.manager.batching.sessions import SessionStore, Waiting, session_fields
from batchmaker.manager.batching.versions import Versions
from batchmaker.manager.batching.worker_handle import WorkerHandle

log = logging.getLogger(__name__)
BurstMessage = tuple[bytes, Any, dict[str, Any], float]  # an `infer` message: client, id, message, arrival


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
        self._kinds = set(kinds)
        self.versions = Versions(models)
        self.workers = workers
        self.admission = Admission(self._server.max_queue_delay_ms)
        self.table, self.store = make_tables(specs, kinds)
        self.requests = self.table.unanswered  # read here; the table writes it
        self.dispatcher = Dispatcher(self.table, self.store, workers)
        self.scheduler = make_scheduler(config, specs, self.table, self.store, self.dispatcher, workers)
        self.policy = make_policy(config, models, self.scheduler, self.table)
        self.processor = RequestProcessor(self.table, self.store, self.dispatcher, self.policy)
        self.sessions = SessionStore(self._server.session_ttl_ms, self._server.max_sessions)
        self._turns = SessionTurns(self.sessions, self._run_in_session)

    # -- requests ------------------------------------------------------------------------------
    def admit(self, client: bytes, request_id: Any, message: dict[str, Any], arrival: float) -> Request | None:
        """Validate an `infer` message and admit its request; raises RequestError to refuse it.

        A request of a session whose previous request is unanswered waits, unadmitted, for its turn
        (None is returned; it is admitted then, or refused as an outcome)."""
        [result] = self.admit_burst([(client, request_id, message, arrival)])
        if isinstance(result, RequestError):
            raise result
        return result

    def admit_burst(self, messages: list[BurstMessage], routed: int = 0) -> list[Request | RequestError | None]:
        """Validate and admit the `infer` messages of a burst, (client, id, message, arrival) each, in order:
        for each, its request (None: it waits for its session) or the RequestError refusing it. `routed`: requests
        in flight routed to workers whole, which `max_queued_requests` counts too.

        Each is checked and planned in turn, the cheap checks first, so that refusing under load costs no
        plan; the limits count the burst's requests before it. Those admitted get their records together,
        in order: one update of the request table, the plan store and the queues for the burst."""
        burst = Burst(routed)
        results: list[Request | RequestError | None] = []
        for client, request_id, message, arrival in messages:
            try:
                results.append(self._take(burst, client, request_id, message, arrival))
            except RequestError as error:
                results.append(error)
            except Exception as exc:  # a model's bug costs its request, never the others of the burst
                log.exception("request %r failed", request_id)
                results.append(RequestError(INTERNAL, f"{type(exc).__name__}: {exc}"))
        self._record(burst)
        return results

    def _take(
        self, burst: Burst, client: bytes, request_id: Any, message: dict[str, Any], arrival: float
    ) -> Request | None:
        fields = session_fields(message)
        pinned = None if fields is None or fields.start else self.sessions.model_of(fields.name)
        model = self.versions.resolve(message.get("model"), message.get("version"), pinned)
        inputs = inputs_of(message, model)
        stream, priority = stream_and_priority(message, model)
        self.check_id(client, request_id, burst.keys)
        deadline_ms = deadline_of(message, self._server.default_deadline_ms)
        check_room(self.in_flight + len(burst.requests) + burst.routed, self._server.max_queued_requests)
        if fields is None:
            return self._plan(burst, client, request_id, model, inputs, arrival, deadline_ms, priority, stream)
        self._record(burst)  # a session's request follows the burst's requests before it
        waiting = Waiting(client, request_id, model, inputs, fields, arrival, deadline_ms, priority, stream)
        return self._turns.arrive(waiting)

    def check_id(self, client: bytes, request_id: Any, *others: Container[tuple[bytes, Any]]) -> None:
        """Refuse a request whose id is in flight on its connection: here, or in any of `others` (routed, a burst's)."""
        key = (client, request_id)
        if key in self.requests or any(key in keys for keys in others) or self.sessions.holds(client, request_id):
            raise RequestError(BAD_REQUEST, f"request id {request_id!r} is already in flight on this connection")

    @property
    def in_flight(self) -> int:
        """Requests admitted and unanswered, and those waiting for their session."""
        return len(self.requests) + self.sessions.waiting

    def _run_in_session(self, waiting: Waiting, inputs: dict[str, Any]) -> Request:
        """Admit a session's request whose turn came, on `inputs` (its session's state its initial state)."""
        return self._admit_alone(
            waiting.client, waiting.request_id, waiting.model, inputs, waiting.arrival, waiting.deadline_ms,
            waiting.priority, waiting.stream,
        )  # fmt: skip

    def _admit_alone(
        self, client: bytes, request_id: Any, model: Planner, inputs: Any, arrival: float, deadline_ms: int | None,
        priority: int, stream: bool,
    ) -> Request:  # fmt: skip
        """A request checked and planned as `_plan` does, recorded at once in a burst of its own."""
        burst = Burst()
        request = self._plan(burst, client, request_id, model, inputs, arrival, deadline_ms, priority, stream)
        self._record(burst)
        return request

    def _plan(
        self, burst: Burst, client: bytes, request_id: Any, model: Planner, inputs: Any, arrival: float,
        deadline_ms: int | None, priority: int, stream: bool,
    ) -> Request:
        """A request checked against the expected wait and the queued cells (the burst's included) and
        planned: its record, which joins the burst."""
        self.admission.check(self.unfinished_nodes + burst.nodes, deadline_ms)
        unfolded = self.policy.unfold(model, inputs)
        queued = self.processor.unsubmitted_nodes + burst.nodes
        if queued + unfolded.plan.nodes > self._server.max_queued_nodes:
            limit = self._server.max_queued_nodes
            raise RequestError(OVERLOADED, f"{queued} cells queued (limit {limit}); retry later")
        deadline = arrival + deadline_ms / 1e3 if deadline_ms is not None else None
        request = Request(client, request_id, model, inputs, unfolded, arrival, deadline, priority, stream)
        burst.add(request)
        return request

    def take_over(self, routed: Routed) -> None:
        """A request routed whole whose values a worker's running batch cannot hold (all its steps' rows at once):
        admitted here, its steps run by the manager a few lanes at a time. RequestError if a limit refuses it."""
        deadline_ms = None if routed.deadline is None else max(0, round((routed.deadline - routed.arrival) * 1e3))
        self._admit_alone(
            routed.client, routed.request_id, routed.model, routed.inputs, routed.arrival, deadline_ms, routed.priority,
            routed.stream,
        )  # fmt: skip

    def _record(self, burst: Burst) -> None:
        """The burst's requests so far get their records (table rows, plans, queued lanes)."""
        if burst.requests:
            self.processor.admit(burst.requests)
            self.admission.admitted(len(burst.requests), burst.nodes)
            burst.clear()

    def cancel(self, client: bytes, request_id: Any) -> list[Outcome] | None:
        """End a client's request at its asking; None if no such request is in flight."""
        error = RequestError(CANCELLED, "cancelled by the client")
        request = self.requests.get(client, request_id)
        if request is not None:
            return self._fail([request], error)
        waiting = self.sessions.take((client, request_id))
        return None if waiting is None else self._refuse([waiting], error)

    def clients_gone(self, clients: Iterable[bytes]) -> list[Outcome]:
        gone = set(clients)
        error = RequestError(CANCELLED, "the client disconnected")
        return self._refuse(self.sessions.of_clients(gone), error) + self._fail(self.requests.of_clients(gone), error)

    def expire(self) -> list[Outcome]:
        """End the requests whose deadline has passed, and the sessions idle for longer than their TTL."""
        now = time.perf_counter()
        self.sessions.expire(now)
        error = RequestError(DEADLINE_EXCEEDED, "the request's deadline passed")
        expired = list(self.requests.expired()) if self.requests else []
        return self._refuse(self.sessions.past_deadline(now), error) + self._fail(expired, error)

    def shutdown(self) -> list[Outcome]:
        error = RequestError(UNAVAILABLE, "the server stopped before finishing the request; send it elsewhere")
        return self._refuse(self.sessions.all_waiting(), error) + self._fail(self.requests.all(), error)

    def partials(self, client_waiting: Callable[[bytes], bool]) -> list[Outcome]:
        """Once per event loop turn: a partial reply for each streamed request whose outputs grew, unless
        its client has replies waiting unread (`client_waiting`); then it gets one later, coalesced."""
        if not self.requests:  # none streams (a turn of requests routed whole to the workers)
            return []
        self.processor.stream_partials(client_waiting)
        return self._outcomes()

    def wait_ms(self, longest: int) -> int:
        """How long the event loop may sleep before the next deadline (at most `longest`), a waiting
        session request's included."""
        return min(self.requests.wait_ms(longest), self.sessions.wait_ms(longest))

    @property
    def unfinished_nodes(self) -> int:
        """Cells a newly admitted request waits for: those queued and those its workers have yet to run."""
        return self.processor.unsubmitted_nodes + sum(worker.nodes_in_flight for worker in self.workers.values())

    # -- versions ------------------------------------------------------------------------------
    def check_cell_types(self, specs: list[CellTypeSpec]) -> None:
        """Refuse the cell types of a version to load when they need what the server was not sized for at
        start: a kind of value it has no arenas for, or more ports than its plan store holds."""
        kinds = {kind for spec in specs for kind in (*spec.inputs, *spec.outputs)}
        unknown = sorted(kind.key for kind in kinds - self._kinds)
        if unknown:
            raise RequestError(
                BAD_REQUEST, f"its cells use value kinds no model of this server had at start ({', '.join(unknown)}); "
                "the workers' arenas are made at start: restart the server with the model in its config",
            )  # fmt: skip
        inputs, outputs = max(len(spec.inputs) for spec in specs), max(len(spec.outputs) for spec in specs)
        if inputs > self.store.ports or outputs > self.store.outputs:
            raise RequestError(
                BAD_REQUEST, f"its cells have {inputs} inputs and {outputs} outputs, more than any cell of this server "
                "had at start; restart the server with the model in its config",
            )  # fmt: skip

    def add_cell_types(self, specs: list[CellTypeSpec]) -> int:
        """A version being loaded brings its cell types (`check_cell_types` passed), numbered after every
        earlier one; returns the index of the first."""
        self._max_batches.update({spec.key: spec.max_batch for spec in specs})
        return self.scheduler.add_cell_types(specs)

    def remove_cell_types(self, specs: list[CellTypeSpec]) -> None:
        """A version whose load failed takes its cell types away again."""
        for spec in specs:
            del self._max_batches[spec.key]
        self.scheduler.remove_cell_types(specs)

    def in_use(self, planner: Planner, by_sessions: bool) -> bool:
        """Whether a request in flight runs on `planner` (or, `by_sessions`, a live session may send one)."""
        if by_sessions and planner.name in self.sessions.models_in_use():
            return True
        return any(request.model is planner for request in self.table.live.values())

    # -- workers -------------------------------------------------------------------------------
    def schedule(self, worker: WorkerHandle) -> list[Task]:
        """Schedule(worker): the batched tasks to send it now (none if nothing is ready for it)."""
        tasks = self.policy.schedule(worker)
        for task in tasks:
            worker.start(task)
            self.processor.task_submitted(task)
        return tasks

    def tasks_finished(self, worker: WorkerHandle, notice: CompletionNotice) -> list[Outcome]:
        """The tasks a worker's notice reports finished: requests progress, and those done are answered.

        Admission's capacity goes by the manager's time for a task (the rate the whole server drains its
        queue at); the step costs of lane tasks go by the worker's own, which excludes the manager's lag
        in reading notices (a saturated manager reads them late, and its time would make every step look
        dear and every lane task short)."""
        started = time.perf_counter()
        timed = dict(zip(notice.task_ids, notice.busy_us))
        costs = self.scheduler.step_costs
        for task_id in notice.task_ids:
            task = worker.finish(task_id)
            if task is not None:
                steps = len(task.step_sizes)
                busy = self.admission.measure_task(
                    task.nodes, task.spec.max_batch, worker.worker_id, task.submitted, steps
                )
                by_worker = isinstance(task.message, LaneTaskMessage) and task_id in timed
                if by_worker:
                    busy = timed[task_id] / 1e6
                costs.record(task.spec.key, task.step_sizes[0], steps, busy, by_worker)
                self.processor.task_finished(task, notice.errors.get(task_id))
        if notice.task_ids:
            costs.record_manager("completed", (time.perf_counter() - started) / len(notice.task_ids))
        return self._outcomes()

    def workers_changed(self) -> None:
        """Workers registered or left: placement is checked only while there are several, and until
        admission has measured the capacity, it quotes the one the workers timed at warm-up."""
        self.scheduler.several_workers = len(self.workers) > 1
        timings = [worker.full_task_s for worker in self.workers.values()]
        self.admission.estimator.assume(warm_up_capacity(timings, self._max_batches))
        self.scheduler.step_costs.assume(timings)

    def worker_lost(self, worker: WorkerHandle, reason: str, draining: bool = False) -> list[Outcome]:
        """Forget a dead worker (already gone from `workers`) and replay, on the others, every request
        that had values there; one that has lost its worker more than `max_replays` times fails, and
        with no worker left they all do (UNAVAILABLE while `draining`: a stopping server's loss is not
        the request's)."""
        self.workers_changed()
        for request in self.processor.worker_lost(worker, worker.write_off()):
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
            "admission": self.admission.snapshot(self.unfinished_nodes),
            "ready_nodes": self.scheduler.ready_nodes(),
            "sessions": len(self.sessions),
            "requests_waiting_for_their_session": self.sessions.waiting,
        }

    # -- outcomes ------------------------------------------------------------------------------
    def _fail(self, requests: list[Request], error: RequestError) -> list[Outcome]:
        if not requests:  # most turns: the sessions have nothing to follow
            return []
        for request in requests:
            self.processor.fail(request, error)
        return self._outcomes()

    def _refuse(self, waiting: list[Waiting], error: RequestError) -> list[Outcome]:
        """End requests that wait for their session, unadmitted."""
        for each in waiting:
            self.sessions.take((each.client, each.request_id))
        return [Refused(each.client, each.request_id, error) for each in waiting]

    def _outcomes(self) -> list[Outcome]:
        """What the processor concluded since the last call (the request table is up to date with it), the
        sessions following it (manager.batching.session_turns)."""
        return self._turns.follow(self.processor.take_outcomes())
