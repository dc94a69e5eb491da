"""The manager process: one thread, one zmq.Poller event loop, no locks on the hot path.

Each turn of the loop takes completion notices first (they free workers and rows) and
schedules right away, then worker control messages, client messages and departed clients,
then deadlines and the watchdog, and finally runs Schedule for every worker with few tasks in
flight, so that newly arrived requests join the very next batched tasks. The parts live in
their own modules: the client frontend (manager.frontend), the workers (manager.worker_pool),
the live requests (manager.registry) and the core that admits, schedules and finishes them
(manager.request_processor, manager.scheduler, manager.dispatch); see docs/architecture.md.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from common.config import Config
from common.graph import CellTypeSpec, ValueKind
from common.models.base import Model, build_model, cell_layout
from common.protocol import (
    BAD_REQUEST,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    OPS,
    OVERLOADED,
    PROTOCOL_VERSION,
    UNAVAILABLE,
    UNKNOWN_MODEL,
    WORKER_LOST,
    RequestError,
    echo,
    error_reply,
)
from common.sockets import server_context
from manager.admission import Admission, warm_up_capacity
from manager.dispatch import Dispatcher
from manager.frontend import ClientFrontend, Incoming
from manager.metrics import Metrics
from manager.policies import make_policy, make_scheduler
from manager.registry import RequestRegistry
from manager.request_processor import RequestProcessor
from manager.state import Request
from manager.stats import Stats, request_timing
from manager.store import make_tables
from manager.worker_pool import WorkerPool
from manager.workers import WorkerHandle

log = logging.getLogger("batchmaker.manager")

WATCH_INTERVAL_S = 0.1  # how often workers are pinged and checked
IDLE_POLL_MS = 100
SHUTDOWN_LINGER_MS = 2000  # how long the messages sent on stopping may take to leave
BACKLOG_POLL_MS = 5  # while replies wait for slow clients, how often they are retried


def load_models(config: Config) -> tuple[dict[str, Model], list[CellTypeSpec], list[ValueKind]]:
    """Models by name, every cell type sorted by key (the order workers use) and every value kind."""
    models = {name: build_model(model_config) for name, model_config in config.models.items()}
    specs, kinds = cell_layout(list(models.values()))
    return models, specs, kinds


class Manager:
    def __init__(
        self,
        config: Config,
        client_address: str,
        worker_address: str,
        expected_workers: int,
        parent_pid: int | None = None,
        supervisor_token: bytes = b"",
    ):
        self.config = config
        self.models, self.specs, self.kinds = load_models(config)
        self.expected_workers = expected_workers
        server = config.server
        self.idle_tasks = config.scheduler.idle_tasks
        self.stats = Stats()
        self.requests = RequestRegistry()
        self.admission = Admission(server.max_queue_delay_ms)
        self._stopping = False
        self._draining_until: float | None = None
        self._drain_timeout = server.drain_timeout_ms / 1e3
        self._parent_pid = parent_pid
        self._next_watch = 0.0

        self.metrics: Metrics | None = None
        if server.metrics_address:
            self.metrics = Metrics(list(self.models), [spec.key for spec in self.specs])
            host, _, port = server.metrics_address.rpartition(":")
            bound = self.metrics.serve(host, int(port))
            log.info("metrics on http://%s:%d/metrics", host, bound)
        self._context = server_context()
        self.pool = WorkerPool(worker_address, self.specs, self.kinds, server, self._health, supervisor_token)
        self.workers = self.pool.workers
        self.frontend = ClientFrontend(self._context, client_address, server)

        self.table, self.store = make_tables(self.specs, self.kinds)
        self.dispatcher = Dispatcher(self.table, self.store, self.workers)
        self.scheduler = make_scheduler(config, self.specs, self.table, self.store, self.dispatcher)
        self.policy = make_policy(config, self.models, self.scheduler, self.table)
        self.processor = RequestProcessor(self.table, self.store, self.scheduler, self.dispatcher, self._finish, self.policy)
        log.info("serving %s on %s", ", ".join(self.models), client_address)

    # -- event loop ----------------------------------------------------------------------------
    def stop(self, *_: object) -> None:
        """First call: drain (refuse new requests, finish the accepted ones). Second call: stop at once,
        unless the supervisor is gone: its death signals once (PDEATHSIG) and is seen by the parent check too."""
        if self._draining_until is None:
            self._draining_until = time.monotonic() + self._drain_timeout
            log.info("draining: %d requests in flight", len(self.requests))
        elif not self._orphaned():
            self._stopping = True

    def _orphaned(self) -> bool:
        return self._parent_pid is not None and os.getppid() != self._parent_pid

    @property
    def draining(self) -> bool:
        return self._draining_until is not None

    def run(self) -> None:
        poller = zmq.Poller()
        completions, control, departures = self.pool.completions, self.pool.control, self.frontend.connections.monitor
        for socket in (completions, control, departures, self.frontend.socket):
            poller.register(socket, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self.requests.wait_ms(BACKLOG_POLL_MS if self.frontend.backlogged else IDLE_POLL_MS)))
                if self.frontend.backlogged:
                    self.frontend.flush()
                if completions in events:
                    with self.frontend.replies_held():
                        self._completions()
                    self._schedule_idle_workers()  # keep the workers fed before admitting new requests
                if control in events:
                    self._worker_control()
                if self.frontend.socket in events:
                    self._clients()
                if departures in events or self.frontend.departures_known:  # after clients: they may read the monitor
                    for request in self.requests.of_clients(self.frontend.departed()):
                        self.processor.fail(request, RequestError(CANCELLED, "the client disconnected"))
                for request in self.requests.expired():
                    self.processor.fail(request, RequestError(DEADLINE_EXCEEDED, "the request's deadline passed"))
                self._watch_workers()
                self._schedule_idle_workers()
                if self.draining and (not self.requests or time.monotonic() > self._draining_until):
                    break
        finally:
            self._shutdown()

    def _schedule_idle_workers(self) -> None:
        for worker in self.workers.values():
            while worker.in_flight <= self.idle_tasks:
                tasks = self.policy.schedule(worker)
                if not tasks:
                    break
                self.pool.send(worker, tasks)
                for task in tasks:
                    self.stats.task_submitted(task)
                    self.processor.task_submitted(task)
                    if self.metrics is not None:
                        self.metrics.task_submitted(task.spec.key, task.nodes)

    def _completions(self) -> None:
        for worker, notice in self.pool.notices():
            for task_id in notice.task_ids:
                task = worker.tasks.pop(task_id, None)
                if task is not None:
                    worker.tasks_completed += 1
                    self.admission.completed(task.nodes, task.spec.max_batch, worker.worker_id, task.submitted)
                    self.processor.task_completed(task, notice.errors.get(task_id))

    def _check_parent(self) -> None:
        """A manager whose supervisor is gone drains like on SIGTERM: what it accepted is finished
        (its orphaned workers keep serving it meanwhile) or answered UNAVAILABLE, never dropped."""
        if not self.draining and self._orphaned():
            log.warning("parent process %d is gone; draining, then exiting", self._parent_pid)
            self.stop()

    def _shutdown(self) -> None:
        for request in self.requests.all():
            self.processor.fail(request, RequestError(UNAVAILABLE, "the server stopped before finishing the request; send it elsewhere"))
        for socket in (self.pool.control, self.frontend.socket):  # let the last answers and stop orders leave
            socket.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
        self.pool.close()
        self.frontend.close()
        self._context.term()
        if self.metrics is not None:
            self.metrics.close()

    # -- workers -------------------------------------------------------------------------------
    def _worker_control(self) -> None:
        restarted, exited = self.pool.control_messages()
        self.scheduler.several_workers = len(self.workers) > 1
        self._assume_capacity()
        if self.metrics is not None:
            for _ in restarted:
                self.metrics.worker_restarted()
        for worker, reason in exited:
            self._worker_lost(worker, reason)

    def _assume_capacity(self) -> None:
        """Until admission has measured the capacity, it quotes the one the workers timed at warm-up."""
        timings = [worker.full_task_s for worker in self.workers.values()]
        self.admission.estimator.assume(warm_up_capacity(timings, {spec.key: spec.max_batch for spec in self.specs}))

    def _watch_workers(self) -> None:
        """Every WATCH_INTERVAL_S: the watchdog, and the metrics that are sampled rather than counted.

        Notices waiting unread are taken first: after a long turn (planning a very long request,
        say) a worker's heartbeats may sit in the socket, and that is not silence."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_INTERVAL_S
        self._check_parent()
        self._completions()
        for worker, reason in self.pool.watch():
            self._worker_lost(worker, reason)
        if self.metrics is not None:
            self.metrics.set_liveness(now)
            self.metrics.set_readiness(len(self.workers), self.expected_workers, self.draining)
            for key, ready in self.scheduler.ready_nodes().items():
                self.metrics.set_queue_depth(key, ready)
            for worker in self.workers.values():
                capacity = sum(a.capacity for a in worker.slots.values())
                self.metrics.set_worker(str(worker.worker_id), worker.in_flight, worker.slots_in_use(), capacity)

    def _worker_lost(self, worker: WorkerHandle, reason: str) -> None:
        """Forget a dead worker and replay, on the others, every request that had values there;
        a request that has lost its worker more than `max_replays` times fails instead."""
        log.warning("worker %d (pid %s) lost: %s", worker.worker_id, worker.pid, reason)
        self.pool.remove(worker)
        self.scheduler.several_workers = len(self.workers) > 1
        self._assume_capacity()
        self.stats.worker_losses += 1
        if self.metrics is not None:
            self.metrics.remove_worker(str(worker.worker_id))
        for request in self.processor.worker_lost(worker):
            request.failures += 1
            if request.failures > self.config.server.max_replays:
                message = f"it lost its worker {request.failures} times (last: {reason}); it is not replayed again"
                self.processor.fail(request, RequestError(INTERNAL, message))
            elif not self.workers:
                code = UNAVAILABLE if self.draining else WORKER_LOST  # a stopping server's loss is not the request's
                self.processor.fail(request, RequestError(code, f"its worker was lost ({reason}) and none remains"))
            else:
                self.requests.add(self.processor.replay(request))
                self.stats.replayed += 1

    # -- clients -------------------------------------------------------------------------------
    def _clients(self) -> None:
        for incoming in self.frontend.receive():
            self.stats.request_received()
            try:
                if incoming.error is not None:
                    raise incoming.error
                self._handle(incoming)
            except RequestError as exc:
                self._refuse(incoming, exc)
            except Exception as exc:  # a bug must cost one request, never the server
                log.exception("request %r failed", incoming.request_id)
                self._refuse(incoming, RequestError(INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _refuse(self, incoming: Incoming, error: RequestError) -> None:
        self.stats.request_answered(error.code, None, False)
        if self.metrics is not None:
            self.metrics.request_refused(error.code)
        self.frontend.reply(incoming.client, error_reply(incoming.request_id, error.code, error.message))

    def _handle(self, incoming: Incoming) -> None:
        message = incoming.message
        op = message.get("op", "infer")
        if op not in OPS:
            raise RequestError(BAD_REQUEST, f"unknown op {echo(op)}; expected one of {', '.join(OPS)}")
        if op == "infer":
            self._infer(incoming)
        elif op == "models":
            self._answer(incoming, {"version": PROTOCOL_VERSION, "models": self._models()})
        elif op == "health":
            self._answer(incoming, self._health())
        elif op == "stats":
            self._answer(incoming, self._stats())
        elif op == "cancel":
            if "target" not in message:
                raise RequestError(BAD_REQUEST, "cancel lacks 'target' (the id of an earlier request)")
            request = self.requests.get(incoming.client, message["target"])
            if request is not None:
                self.processor.fail(request, RequestError(CANCELLED, "cancelled by the client"))
            self._answer(incoming, {"cancelled": request is not None})

    def _answer(self, incoming: Incoming, fields: dict[str, Any]) -> None:
        self.frontend.reply(incoming.client, {"id": incoming.request_id, "ok": True, **fields})

    def _infer(self, incoming: Incoming) -> None:
        message, client, request_id = incoming.message, incoming.client, incoming.request_id
        server = self.config.server
        if self.draining:
            raise RequestError(OVERLOADED, "the server is draining before it stops; send the request elsewhere")
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
        if len(self.requests) >= server.max_queued_requests:
            raise RequestError(
                OVERLOADED, f"{len(self.requests)} requests in flight (limit {server.max_queued_requests}); retry later"
            )
        deadline_ms = deadline_ms if deadline_ms is not None else server.default_deadline_ms or None
        self.admission.check(self.processor.unsubmitted_nodes, deadline_ms)  # before the plan: refusals stay cheap
        unfolded = self.policy.unfold(model, message["inputs"])
        queued = self.processor.unsubmitted_nodes
        if queued + unfolded.plan.nodes > server.max_queued_nodes:
            raise RequestError(OVERLOADED, f"{queued} cells queued (limit {server.max_queued_nodes}); retry later")
        request = self.processor.admit(client, request_id, model, message["inputs"], unfolded, incoming.arrival)
        if deadline_ms is not None:
            request.deadline = incoming.arrival + deadline_ms / 1e3
        self.requests.add(request)

    def _finish(self, request: Request, error: RequestError | None) -> None:
        """Answer a request: its results, or the error that ended it."""
        self.requests.remove(request)
        if error is not None:
            self.stats.request_answered(error.code, None, False)
            if self.metrics is not None:
                self.metrics.request_finished(request.model.name, error.code, None, None)
            log.info("request %r (%s) ended: %s %s", request.request_id, request.model.name, error.code, error.message,
                     extra={"request_id": request.request_id, "model": request.model.name, "outcome": error.code})
            self.frontend.reply(request.client, error_reply(request.request_id, error.code, error.message))
            return
        earliest = self.processor.earliest_running_arrival()
        timing = request_timing(request.arrival, float(self.table.started[request.row]), time.perf_counter())
        self.stats.request_answered("ok", timing, earliest is not None and earliest < request.arrival)
        if self.metrics is not None:
            self.metrics.request_finished(request.model.name, "ok", timing["total_us"] / 1e6, timing["queue_us"] / 1e6)
        outputs = request.model.outputs(request.unfolded, request.results)
        self.frontend.reply(request.client, {"id": request.request_id, "ok": True, "outputs": outputs, "timing": timing})

    # -- introspection ---------------------------------------------------------------------------
    def _models(self) -> dict[str, Any]:
        described = {}
        for name, model in self.models.items():
            entry = model.describe()
            if model.random_weights:
                entry["random_weights"] = True
            entry["cell_types"] = {
                spec.key: {"batch_sizes": list(spec.batch_sizes), "priority": spec.priority}
                for spec in model.cell_types.values()
            }
            described[name] = entry
        return described

    def _health(self) -> dict[str, Any]:
        up = len(self.workers)
        if self.draining:
            status = "draining"
        else:
            status = "ready" if up >= self.expected_workers and up > 0 else "degraded"
        return {
            "status": status,
            "workers": [
                {
                    "id": w.worker_id,
                    "index": w.index,
                    "device": w.device,
                    "pid": w.pid,
                    "host": w.host,
                    "local": w.local,
                    "tasks_in_flight": w.in_flight,
                }
                for w in self.workers.values()
            ],
            "expected_workers": self.expected_workers,
        }

    def _stats(self) -> dict[str, Any]:
        return {
            **self.stats.snapshot(),
            "policy": self.config.scheduler.policy,
            "host": self.pool.host,
            "requests_in_flight": len(self.requests),
            "requests_waiting_for_a_batch": self.policy.queued_requests(),
            "unreachable_clients": self.frontend.unreachable_clients,
            "client_connections": self.frontend.connections.live,
            "refused_connections": self.frontend.connections.refused,
            "admission": self.admission.snapshot(self.processor.unsubmitted_nodes),
            "ready_nodes": self.scheduler.ready_nodes(),
            "plan_caches": {name: m.plan_cache.snapshot() for name, m in self.models.items() if m.plan_cache},
            "workers": {
                str(w.worker_id): {
                    "tasks_in_flight": w.in_flight,
                    "tasks_completed": w.tasks_completed,
                    "first_task_delay_ms": None if w.first_task_delay is None else w.first_task_delay * 1e3,
                    "pid": w.pid,
                    "host": w.host,
                    "local": w.local,
                    "rows_read_from_peers": {str(peer): rows for peer, rows in w.rows_read_from.items()},
                    "rows_in_notices": w.rows_in_notices,
                    "arenas": w.occupancy(),
                    "slots_in_use": w.slots_in_use(),
                }
                for w in self.workers.values()
            },
        }


def _optional_int(message: dict[str, Any], field: str, minimum: int | None = None) -> int | None:
    value = message.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise RequestError(BAD_REQUEST, f"'{field}' must be an integer{bound}, got {echo(value)}")
    return value
