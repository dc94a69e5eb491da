"""The manager process: one thread, one zmq.Poller event loop, no locks on the hot path.

Each turn of the loop takes completion notices first (they free workers and rows) and
schedules right away, then worker control messages, client messages and departed clients,
then deadlines and the watchdog, and finally runs Schedule for every worker with few tasks in
flight, so that newly arrived requests join the very next batched tasks. The loop is I/O
around the batching core (manager.batching.core), which owns every live request and returns what
happened: the loop sends tasks to workers (manager.loop.worker_pool), turns outcomes into replies
to clients (manager.loop.frontend) and records each event once (manager.observability.stats); see
docs/architecture.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from batchmaker.common.config import Config, load_config, model_to_wire
from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.models.base import Planner, build_planner, cell_layout
from batchmaker.common.protocol import INTERNAL, OVERLOADED, RequestError, partial_reply
from batchmaker.common.sockets import server_context
from batchmaker.manager.batching.core import BatchingCore
from batchmaker.manager.batching.outcomes import Answered, Failed, Outcome, Partial, Refused
from batchmaker.manager.batching.versions import served_name
from batchmaker.manager.batching.worker_handle import WorkerHandle
from batchmaker.manager.loop.control_calls import answer, handle
from batchmaker.manager.loop.frontend import ClientFrontend, Incoming
from batchmaker.manager.loop.introspection import health
from batchmaker.manager.loop.model_control import ModelControl
from batchmaker.manager.loop.routing import Router
from batchmaker.manager.loop.worker_pool import WorkerPool
from batchmaker.manager.observability.metrics import Metrics
from batchmaker.manager.observability.stats import Stats

if TYPE_CHECKING:
    from batchmaker.manager.observability.tracing import RequestTracing

log = logging.getLogger("batchmaker.manager")

WATCH_INTERVAL_S = 0.1  # how often workers are pinged and checked
IDLE_POLL_MS = 100
SHUTDOWN_LINGER_MS = 2000  # how long the messages sent on stopping may take to leave
BACKLOG_POLL_MS = 5  # while replies wait for slow clients, how often they are retried


def load_models(config: Config) -> tuple[dict[str, Planner], list[CellTypeSpec], list[ValueKind]]:
    """The models' planners by name, every cell type sorted by key (the order workers use) and every value kind."""
    models = {name: build_planner(model_config) for name, model_config in config.models.items()}
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
        tracing: RequestTracing | None = None,
        reread: Callable[[], Config] | None = None,
    ):
        """`tracing`: the spans of requests (manager.observability.trace_export.open_tracing), or None for none.
        `reread` reads the config again for a reload (`reload`, SIGHUP), with the command line's overrides."""
        self.config = config
        models, self.specs, self.kinds = load_models(config)
        self.expected_workers = expected_workers
        server = config.server
        self.idle_tasks = config.scheduler.idle_tasks
        self._stopping = False
        self._draining_until: float | None = None
        self._drain_timeout = server.drain_timeout_ms / 1e3
        self._parent_pid = parent_pid
        self._next_watch = 0.0
        self._reload_asked = False

        metrics = None
        if server.metrics_address:
            metrics = Metrics(list(models), [spec.key for spec in self.specs])
            host, _, port = server.metrics_address.rpartition(":")
            bound = metrics.serve(host, int(port))
            log.info("metrics on http://%s:%d/metrics", host, bound)
        self.stats = Stats(metrics)
        self.tracing = tracing
        self._context = server_context()
        layout = [model_to_wire(model) for model in config.models.values()]
        scheduler = config.scheduler
        chains = {"max_steps": scheduler.max_steps_per_task, "max_join_delay_us": scheduler.max_join_delay_us}
        routes = chains if scheduler.running_batch == "worker" else None
        self.pool = WorkerPool(worker_address, self.specs, self.kinds, server, supervisor_token, layout, routes)
        self.workers = self.pool.workers
        self.frontend = ClientFrontend(self._context, client_address, server)

        self.core = BatchingCore(config, models, self.specs, self.kinds, self.workers)
        self.router = Router(config, self.core, self.pool, self.specs)
        self.versions = self.core.versions
        self.control = ModelControl(
            config, self.core, self.router.table, self.pool, self._control_reply,
            reread or (lambda: load_config(config.path)), self.stats.model_served,
        )  # fmt: skip
        log.info("serving %s on %s", ", ".join(models), client_address)

    # -- event loop ----------------------------------------------------------------------------
    def stop(self, *_: object) -> None:
        """First call: drain (refuse new requests, finish the accepted ones). Second call: stop at once,
        unless the supervisor is gone: its death signals once (PDEATHSIG) and is seen by the parent check too."""
        if self._draining_until is None:
            self._draining_until = time.monotonic() + self._drain_timeout
            log.info("draining: %d requests in flight", len(self.core.requests) + len(self.router.table))
        elif not self._orphaned():
            self._stopping = True

    def request_reload(self, *_: object) -> None:
        """SIGHUP: reload the config at the end of the loop turn."""
        self._reload_asked = True

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
                longest = BACKLOG_POLL_MS if self.frontend.backlogged else IDLE_POLL_MS
                events = dict(poller.poll(self.router.table.wait_ms(self.core.wait_ms(longest))))
                if self.frontend.backlogged:
                    self.frontend.flush()
                if completions in events:
                    with self.frontend.replies_held():
                        self._read_notices()
                    self._schedule_idle_workers()  # keep the workers fed before admitting new requests
                if control in events:
                    with self.frontend.replies_held():
                        self._worker_control()
                if self.frontend.socket in events:
                    self._clients()
                if departures in events or self.frontend.departures_known:  # after clients: they may read the monitor
                    departed = set(self.frontend.departed())
                    self._conclude(self.core.clients_gone(departed) + self.router.clients_gone(departed))
                self._conclude(self.core.expire() + self.router.expire())
                self._watch_workers()
                waiting = self.frontend.has_backlog
                self._conclude(self.core.partials(waiting) + self.router.partials(waiting))  # one a stream and turn
                self._reload_if_asked()
                self._schedule_idle_workers()
                idle = not self.core.requests and not self.router.table
                if self.draining and (idle or time.monotonic() > self._draining_until):
                    self._clients()  # refuse what came during the last turn rather than leave it unanswered
                    break
        finally:
            self._shutdown()

    def _reload_if_asked(self) -> None:
        if self._reload_asked:
            self._reload_asked = False
            try:
                self.control.reload(None)
            except RequestError as exc:
                log.error("%s", exc.message)

    def _schedule_idle_workers(self) -> None:
        if not self.core.requests:  # nothing to run: every request is answered, or routed whole to a worker
            return
        for worker in self.workers.values():
            while worker.in_flight <= self.idle_tasks:
                started = time.perf_counter()
                tasks = self.core.schedule(worker)
                if not tasks:
                    break
                self.pool.send(worker, tasks)
                self.core.scheduler.step_costs.record_manager("sent", (time.perf_counter() - started) / len(tasks))
                for task in tasks:
                    self.stats.task_submitted(task)
                if self.tracing is not None and self.tracing.live:
                    for task in tasks:
                        self.tracing.task_submitted(task, self.core.processor.requests_of(task))

    def _read_notices(self) -> None:
        for worker, notice in self.pool.notices():
            if self.tracing is not None:
                self.tracing.tasks_finished(notice.task_ids)
            self._conclude(self.core.tasks_finished(worker, notice))

    def _check_parent(self) -> None:
        """A manager whose supervisor is gone drains like on SIGTERM: what it accepted is finished
        (its orphaned workers keep serving it meanwhile) or answered UNAVAILABLE, never dropped."""
        if not self.draining and self._orphaned():
            log.warning("parent process %d is gone; draining, then exiting", self._parent_pid)
            self.stop()

    def _shutdown(self) -> None:
        self._conclude(self.core.shutdown() + self.router.shutdown())
        for socket in (self.pool.control, self.frontend.socket):  # let the last answers and stop orders leave
            socket.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
        self.pool.close()
        self.frontend.close()
        self._context.term()
        self.stats.close()
        if self.tracing is not None:
            self.tracing.close()

    def _conclude(self, outcomes: list[Outcome]) -> None:
        """Reply to the requests the core concluded about, and record each outcome."""
        for outcome in outcomes:
            if self.tracing is not None:
                self.tracing.concluded(outcome)
            if isinstance(outcome, Refused):
                self.stats.request_refused(outcome.error.code)
                self.frontend.refuse(outcome.client, outcome.request_id, outcome.error)
                continue
            request = outcome.request
            if isinstance(outcome, Partial):
                self.stats.partial_sent(served_name(request.model.name))
                reply = partial_reply(request.request_id, outcome.outputs, outcome.restarted)
                self.frontend.reply(request.client, reply)
                continue
            self.stats.concluded(outcome)
            if isinstance(outcome, Answered):
                reply = {
                    "id": request.request_id, "ok": True, "outputs": outcome.outputs, "timing": outcome.timing,
                    "version": self.versions.number_of(request.model),
                }  # fmt: skip
                if outcome.session_step is not None:
                    reply["session_step"] = outcome.session_step
                self.frontend.reply(request.client, reply)
            elif isinstance(outcome, Failed):
                error = outcome.error
                model = served_name(request.model.name)
                log.info("request %r (%s) ended: %s %s", request.request_id, model, error.code, error.message,
                         extra={"request_id": request.request_id, "model": model, "outcome": error.code})
                self.frontend.refuse(request.client, request.request_id, error)

    # -- workers -------------------------------------------------------------------------------
    def _worker_control(self) -> None:
        restarted, exited, health_checks, registered, loads, answers = self.pool.control_messages()
        for worker, answered, partials, ran in answers:
            self.stats.steps_run(ran)
            self._conclude(self.router.answers(worker, answered, partials))
        for worker in registered:
            self.control.worker_joined(worker)
        for worker, model, error in loads:
            self.control.loaded(worker, model, error)
        if registered or loads:  # new workers' warm-up timings, or cell types a load brought or took back
            self.core.workers_changed()
        for identity in health_checks:
            self.pool.answer_health(identity, health(self))
        for _ in restarted:
            self.stats.worker_restarted()
        for worker, reason in exited:
            self._worker_lost(worker, reason)

    def _watch_workers(self) -> None:
        """Every WATCH_INTERVAL_S: the watchdog, and the metrics that are sampled rather than counted.

        Notices waiting unread are taken first: after a long turn (planning a very long request,
        say) a worker's heartbeats may sit in the socket, and that is not silence."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_INTERVAL_S
        self._check_parent()
        self._read_notices()
        for worker, reason in self.pool.watch(self.router.stalled()):
            self._worker_lost(worker, reason)
        self.control.watch()  # here, not every turn: it looks through the requests in flight
        ready, routed = self.core.scheduler.ready_nodes, self.router.table.held_by
        self.stats.sample(now, self.workers, self.expected_workers, self.draining, ready, routed)

    def _worker_lost(self, worker: WorkerHandle, reason: str) -> None:
        """Forget a dead worker; the core replays (or fails) the requests that had values there."""
        log.warning("worker %d (pid %s) lost: %s", worker.worker_id, worker.pid, reason)
        self.pool.remove(worker)
        self.control.worker_gone(worker, reason)
        self.stats.worker_lost(worker.worker_id)
        if self.tracing is not None:
            self.tracing.worker_lost(worker.worker_id, reason)
        self._conclude(self.core.worker_lost(worker, reason, self.draining))
        self._conclude(self.router.worker_lost(worker, reason, self.draining))

    # -- clients -------------------------------------------------------------------------------
    def _clients(self) -> None:
        """Handle the messages waiting: `infer` requests are admitted a burst at a time (the core makes
        their records together), every other op in its turn, after the requests before it."""
        burst: list[Incoming] = []
        for incoming in self.frontend.receive():
            op = incoming.control_op
            if op is None:
                self.stats.request_received()
            else:
                self.stats.control_call(op)
            if incoming.error is None and incoming.message.get("op", "infer") == "infer" and not self.draining:
                burst.append(incoming)
                continue
            self._infer(burst)
            burst = []
            try:
                if incoming.error is not None:
                    raise incoming.error
                self._conclude(handle(self, incoming))
            except RequestError as exc:
                self._refuse(incoming, exc)
            except Exception as exc:  # a bug must cost one request, never the server
                log.exception("request %r failed", incoming.request_id)
                self._refuse(incoming, RequestError(INTERNAL, f"{type(exc).__name__}: {exc}"))
        self._infer(burst)

    def _refuse(self, incoming: Incoming, error: RequestError, retry_after_ms: int | None = None) -> None:
        if incoming.control_op is None:  # a refused control call is counted as a control call only
            self.stats.request_refused(error.code)
        self.frontend.refuse(incoming.client, incoming.request_id, error, retry_after_ms)

    def _control_reply(self, incoming: Incoming, result: dict[str, Any] | RequestError) -> None:
        """The reply to a load or a reload, once its versions have loaded or failed."""
        if isinstance(result, RequestError):
            self._refuse(incoming, result)
        else:
            answer(self.frontend, incoming, result)

    def _infer(self, burst: list[Incoming]) -> None:
        """Admit a burst of requests; refuse those the core refuses, in their order."""
        burst, routed, routing_refused = self.router.admit(burst)
        if self.tracing is not None and (routed or routing_refused):
            self.tracing.received([*routed, *(i for i, _, _ in routing_refused)],
                                  [*(None for _ in routed), *(error for _, error, _ in routing_refused)])  # fmt: skip
        for incoming, error, retry_after_ms in routing_refused:
            self._refuse(incoming, error, retry_after_ms)
        if not burst:
            return
        messages = [(i.client, i.request_id, i.message, i.arrival) for i in burst]
        admitted = self.core.admit_burst(messages, len(self.router.table))
        if self.tracing is not None:
            self.tracing.received(burst, admitted)
        refusals = [(incoming, result) for incoming, result in zip(burst, admitted) if isinstance(result, RequestError)]
        overloaded = sum(error.code == OVERLOADED for _, error in refusals)
        quotes = iter(self.core.admission.retry_after_ms(self.core.unfinished_nodes, overloaded) if overloaded else ())
        for incoming, error in refusals:
            self._refuse(incoming, error, next(quotes, None) if error.code == OVERLOADED else None)
