"""The manager process: one thread, one zmq.Poller event loop, no locks on the hot path.

Each turn of the loop takes completion notices first (they free workers and slots),
then worker registrations, then client requests, and finally runs Schedule for every
idle worker so that newly arrived requests join the very next batched tasks.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import signal
import time
from typing import Any

import msgpack
import zmq

from common.auth import CurveServer
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
    UNKNOWN_MODEL,
    WORKER_LOST,
    RequestError,
    decode,
    encode,
    error_reply,
)
from manager.connections import ClientConnections
from manager.dispatch import Dispatcher
from manager.metrics import Metrics
from manager.policies import make_policy, make_scheduler
from manager.request_processor import RequestProcessor
from manager.state import NodeState, Request, Task
from manager.stats import Stats, request_timing
from manager.workers import WorkerHandle

log = logging.getLogger("batchmaker.manager")

SOCKET_LIMIT_FACTOR = 4
WATCH_INTERVAL_S = 0.1  # how often workers are pinged and checked
MANAGER_SILENCE_S = 10.0  # a worker that hears nothing from the manager this long exits
CLIENT_BURST = 4  # client messages per loop turn: admission is interleaved with completions and scheduling
IDLE_POLL_MS = 100


def completion_address(worker_address: str) -> str:
    """Where workers push completion notices: beside the worker address."""
    if worker_address.startswith("tcp://"):
        host, _, port = worker_address.rpartition(":")
        return f"{host}:{int(port) + 1}"
    return worker_address + "-completions"


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
    ):
        self.config = config
        self.models, self.specs, self.kinds = load_models(config)
        self.expected_workers = expected_workers
        self.max_message_bytes = config.server.max_message_bytes
        self.idle_tasks = config.scheduler.idle_tasks
        self.stats = Stats()
        self.workers: dict[int, WorkerHandle] = {}
        self._next_worker_id = 0
        self._in_flight: dict[tuple[bytes, Any], Request] = {}
        self._deadlines: list[tuple[float, int, Request]] = []  # heap of (deadline, tie-breaker, request)
        self._default_deadline_ms = config.server.default_deadline_ms
        self._max_queued_requests = config.server.max_queued_requests
        self._max_queued_nodes = config.server.max_queued_nodes
        self._seen_worker_indices: set[Any] = set()
        self._stopping = False
        self._draining_until: float | None = None
        self._parent_pid = parent_pid
        server = config.server
        self._heartbeat_timeout = server.heartbeat_timeout_ms / 1e3
        self._hang_timeout = server.hang_timeout_ms / 1e3
        self._drain_timeout = server.drain_timeout_ms / 1e3
        self._next_watch = 0.0

        self.dispatcher = Dispatcher(self.specs, self._send_task)
        self.scheduler = make_scheduler(config, self.specs, self._submit, self.dispatcher.capacity)
        self.policy = make_policy(config, self.models, self.scheduler)
        self.processor = RequestProcessor(
            {spec.key: spec for spec in self.specs}, self.scheduler, self.dispatcher, self._finish, self.policy
        )

        self.metrics: Metrics | None = None
        if server.metrics_address:
            self.metrics = Metrics(list(self.models), [spec.key for spec in self.specs])
            host, _, port = server.metrics_address.rpartition(":")
            bound = self.metrics.serve(host, int(port))
            log.info("metrics on http://%s:%d/metrics", host, bound)
        self._context = zmq.Context()
        self._curve: CurveServer | None = None
        self.frontend = self._context.socket(zmq.ROUTER)
        if server.curve is not None:
            self._curve = CurveServer(self._context, server.curve.secret_key, server.curve.allowed_clients)
            self._curve.apply(self.frontend)
        elif not _is_loopback(client_address):
            log.warning("serving %s without authentication: configure [server.curve]", client_address)
        # Frames over max_message_bytes get a BAD_REQUEST from the decoder; the socket itself drops the
        # connection only past a hard ceiling well above it, to bound what a peer can make us buffer.
        self.frontend.setsockopt(zmq.MAXMSGSIZE, SOCKET_LIMIT_FACTOR * self.max_message_bytes)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.bind(client_address)
        self.connections = ClientConnections(self.frontend)
        self.worker_socket = self._context.socket(zmq.ROUTER)
        self.worker_socket.setsockopt(zmq.LINGER, 0)
        self.worker_socket.bind(worker_address)
        self.completions_address = completion_address(worker_address)
        self.completions = self._context.socket(zmq.PULL)
        self.completions.setsockopt(zmq.LINGER, 0)
        self.completions.bind(self.completions_address)
        log.info("serving %s on %s", ", ".join(self.models), client_address)

    # -- event loop ----------------------------------------------------------------------------
    def stop(self, *_: object) -> None:
        """First call: drain (refuse new requests, finish the accepted ones). Second call: stop at once."""
        if self._draining_until is None:
            self._draining_until = time.monotonic() + self._drain_timeout
            log.info("draining: %d requests in flight", len(self._in_flight))
        else:
            self._stopping = True

    @property
    def draining(self) -> bool:
        return self._draining_until is not None

    def run(self) -> None:
        poller = zmq.Poller()
        for socket in (self.completions, self.worker_socket, self.connections.monitor, self.frontend):
            poller.register(socket, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self.completions in events:
                    self._drain_completions()
                    self._schedule_idle_workers()  # keep the workers fed before admitting new requests
                if self.worker_socket in events:
                    self._drain_worker_control()
                if self.connections.monitor in events:
                    self._cancel_disconnected()
                if self.frontend in events:
                    self._drain_clients()
                self._expire_deadlines()
                self._watch_workers()
                self._schedule_idle_workers()
                if self.draining and (not self._in_flight or time.monotonic() > self._draining_until):
                    break
                if not events and self._parent_pid is not None and os.getppid() != self._parent_pid:
                    log.warning("parent process %d is gone; exiting", self._parent_pid)
                    break
        finally:
            self._shutdown()

    def _poll_timeout_ms(self) -> int:
        if not self._deadlines:
            return IDLE_POLL_MS
        wait = (self._deadlines[0][0] - time.perf_counter()) * 1e3
        return max(0, min(IDLE_POLL_MS, math.ceil(wait)))

    def _expire_deadlines(self) -> None:
        """Fail queued or running requests whose deadline has passed; their unissued nodes are dropped."""
        now = time.perf_counter()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if not request.done:
                self.processor.fail(request, RequestError(DEADLINE_EXCEEDED, "the request's deadline passed"))

    def _watch_workers(self) -> None:
        """Ping workers; take a silent one for dead and kill a hung one (tasks in flight, counter stuck)."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_INTERVAL_S
        for worker in list(self.workers.values()):
            if now - worker.last_seen > self._heartbeat_timeout:
                self._worker_lost(worker, f"silent for {now - worker.last_seen:.1f} s")
            elif worker.tasks and now - worker.progress_at > self._hang_timeout:
                _kill(worker.pid)
                self._worker_lost(worker, f"hung: its stream did not advance for {now - worker.progress_at:.1f} s")
            else:
                self.worker_socket.send_multipart([worker.identity, b"ping", b""])
        if self.metrics is not None:
            self.metrics.set_liveness(now)
            self.metrics.set_readiness(len(self.workers), self.expected_workers, self.draining)
            for key, ready in self.scheduler.ready_nodes().items():
                self.metrics.set_queue_depth(key, ready)
            for worker in self.workers.values():
                capacity = sum(a.capacity for a in worker.slots.values())
                self.metrics.set_worker(str(worker.worker_id), worker.in_flight, worker.slots_in_use(), capacity)

    def _worker_lost(self, worker: WorkerHandle, reason: str) -> None:
        """Forget a dead worker and replay, on the others, every request that had values there."""
        log.warning("worker %d (pid %s) lost: %s", worker.worker_id, worker.pid, reason)
        del self.workers[worker.worker_id]
        self.scheduler.several_workers = len(self.workers) > 1
        self.stats.worker_losses += 1
        if self.metrics is not None:
            self.metrics.remove_worker(str(worker.worker_id))
        affected = self.processor.worker_lost(worker)
        for other in self.workers.values():
            self.worker_socket.send_multipart([other.identity, b"forget-peer", encode({"worker_id": worker.worker_id})])
        worker.close()
        for request in affected:
            if not self.workers:
                self.processor.fail(request, RequestError(WORKER_LOST, f"its worker was lost ({reason}) and none remains"))
                continue
            replayed = self.processor.replay(request)
            self.stats.replayed += 1
            self._in_flight[(replayed.client, replayed.request_id)] = replayed
            if replayed.deadline is not None:
                heapq.heappush(self._deadlines, (replayed.deadline, id(replayed), replayed))

    def _schedule_idle_workers(self) -> None:
        for worker in self.workers.values():
            while worker.in_flight <= self.idle_tasks and self.policy.schedule(worker):
                pass

    def _shutdown(self) -> None:
        for request in list(self._in_flight.values()):
            self.processor.fail(request, RequestError(INTERNAL, "the server is shutting down"))
        for worker in self.workers.values():
            self.worker_socket.send_multipart([worker.identity, b"stop", b""])
            worker.close()
        self.connections.close()
        for socket in (self.frontend, self.worker_socket, self.completions):
            socket.close()
        if self._curve is not None:
            self._curve.stop()
        self._context.term()
        if self.metrics is not None:
            self.metrics.close()

    # -- workers -------------------------------------------------------------------------------
    def _send_task(self, worker: WorkerHandle, payload: bytes) -> None:
        self.worker_socket.send_multipart([worker.identity, b"task", payload])

    def _submit(self, spec: CellTypeSpec, nodes: list[NodeState], worker: WorkerHandle) -> Task:
        if not worker.tasks:
            worker.progress_at = time.monotonic()  # the hang watchdog counts from when work arrives
            if worker.first_task_delay is None:
                worker.first_task_delay = worker.progress_at - worker.registered_at
        task = self.dispatcher.submit(spec, nodes, worker)
        self.stats.task_submitted(task)
        self.processor.unsubmitted_nodes -= len(nodes)
        if self.metrics is not None:
            self.metrics.task_submitted(spec.key, len(nodes))
        return task

    def _drain_completions(self) -> None:
        while True:
            try:
                frame = self.completions.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            worker_id, task_ids, errors, counter = msgpack.unpackb(frame, raw=False, strict_map_key=False)
            worker = self.workers.get(worker_id)
            if worker is None:
                continue  # from a worker already written off
            worker.heard_from(counter, time.monotonic())
            for task_id in task_ids:
                task = worker.tasks.pop(task_id, None)
                if task is not None:
                    worker.tasks_completed += 1
                    self.processor.task_completed(task, errors.get(task_id))

    def _drain_worker_control(self) -> None:
        while True:
            try:
                identity, frame = self.worker_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # not a two-frame message: not one of our workers
            try:
                message = decode(frame)
            except RequestError:
                continue
            if message.get("op") == "health":  # the supervisor's readiness check, on the private socket
                self.worker_socket.send_multipart([identity, b"health", encode(self._health())])
                continue
            if message.get("op") == "worker_exited":  # from the supervisor, which saw the process end
                for worker in list(self.workers.values()):
                    if worker.pid == message.get("pid"):
                        self._worker_lost(worker, f"process exited with status {message.get('status')}")
                continue
            try:
                if message.get("op") != "register":
                    raise RequestError(BAD_REQUEST, f"unknown worker op {message.get('op')!r}")
                peers = {str(w.worker_id): w.arenas for w in self.workers.values()}
                worker = self._register(identity, message)
                reply = {
                    "ok": True,
                    "worker_id": worker.worker_id,
                    "completions": self.completions_address,
                    "peers": peers,
                    "manager_timeout_s": MANAGER_SILENCE_S,
                }
            except RequestError as exc:
                log.error("worker registration refused: %s", exc.message)
                self.worker_socket.send_multipart([identity, b"registered", encode({"ok": False, "error": exc.message})])
                continue
            self.worker_socket.send_multipart([identity, b"registered", encode(reply)])
            announcement = encode({str(worker.worker_id): worker.arenas})
            for other in self.workers.values():
                if other is not worker:
                    self.worker_socket.send_multipart([other.identity, b"peers", announcement])

    def _register(self, identity: bytes, message: dict[str, Any]) -> WorkerHandle:
        expected = [spec.key for spec in self.specs]
        if message.get("cells") != expected:
            raise RequestError(BAD_REQUEST, f"worker serves cells {message.get('cells')}, the manager {expected}")
        worker = WorkerHandle(self._next_worker_id, identity, message, self.kinds)
        self._next_worker_id += 1
        self.workers[worker.worker_id] = worker
        self.scheduler.several_workers = len(self.workers) > 1
        if worker.index in self._seen_worker_indices and self.metrics is not None:
            self.metrics.worker_restarted()
        self._seen_worker_indices.add(worker.index)
        log.info("worker %s (pid %s, %s) registered as %d", worker.index, worker.pid, worker.device, worker.worker_id)
        return worker

    # -- clients -------------------------------------------------------------------------------
    def _reply(self, client: bytes, message: dict[str, Any]) -> None:
        self.frontend.send_multipart([client, encode(message)])

    def _cancel_disconnected(self) -> None:
        """A client that went away will read no reply: stop its work and free its slots."""
        gone = set(self.connections.closed())
        if not gone:
            return
        for (client, _), request in list(self._in_flight.items()):
            if client in gone:
                self.processor.fail(request, RequestError(CANCELLED, "the client disconnected"))

    def _drain_clients(self) -> None:
        for _ in range(CLIENT_BURST):
            try:
                frames = self.frontend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            arrival = time.perf_counter()
            self.stats.request_received()
            self.connections.seen(frames[0].bytes, frames[-1])
            client, body = frames[0].bytes, frames[-1].bytes
            request_id = None
            try:
                if len(frames) != 2:
                    raise RequestError(BAD_REQUEST, "a request is exactly one frame holding a msgpack map")
                message = decode(body, self.max_message_bytes)
                if not isinstance(message, dict):
                    raise RequestError(BAD_REQUEST, "a request must be a msgpack map")
                request_id = message.get("id")
                self._handle(client, message, arrival)
            except RequestError as exc:
                self._refuse(client, request_id, exc)
            except Exception as exc:  # a bug must cost one request, never the server
                log.exception("request %r failed", request_id)
                self._refuse(client, request_id, RequestError(INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _refuse(self, client: bytes, request_id: Any, error: RequestError) -> None:
        self.stats.request_answered(error.code, None, False)
        if self.metrics is not None:
            self.metrics.request_refused(error.code)
        self._reply(client, error_reply(_echo_id(request_id), error.code, error.message))

    def _handle(self, client: bytes, message: dict[str, Any], arrival: float) -> None:
        if "id" not in message:
            raise RequestError(BAD_REQUEST, "request lacks 'id' (an int or a string)")
        request_id = message["id"]
        if _echo_id(request_id) is None:
            raise RequestError(BAD_REQUEST, "'id' must be an int or a string")
        op = message.get("op", "infer")
        if op not in OPS:
            raise RequestError(BAD_REQUEST, f"unknown op {op!r}; expected one of {', '.join(OPS)}")
        if op == "infer":
            self._infer(client, request_id, message, arrival)
        elif op == "models":
            self._reply(client, {"id": request_id, "ok": True, "version": PROTOCOL_VERSION, "models": self._models()})
        elif op == "health":
            self._reply(client, {"id": request_id, "ok": True, **self._health()})
        elif op == "stats":
            self._reply(client, {"id": request_id, "ok": True, **self._stats()})
        elif op == "cancel":
            self._cancel(client, request_id, message)

    def _infer(self, client: bytes, request_id: Any, message: dict[str, Any], arrival: float) -> None:
        if self.draining:
            raise RequestError(OVERLOADED, "the server is draining before it stops; send the request elsewhere")
        name = message.get("model")
        if not isinstance(name, str):
            raise RequestError(BAD_REQUEST, "request lacks 'model' (the name of a served model)")
        model = self.models.get(name)
        if model is None:
            raise RequestError(UNKNOWN_MODEL, f"no model named {name!r}; this server has {', '.join(self.models)}")
        if "inputs" not in message:
            raise RequestError(BAD_REQUEST, "request lacks 'inputs' (a map)")
        key = (client, request_id)
        if key in self._in_flight:
            raise RequestError(BAD_REQUEST, f"request id {request_id!r} is already in flight on this connection")
        deadline_ms = _optional_int(message, "deadline_ms", minimum=0)
        _optional_int(message, "priority")
        if len(self._in_flight) >= self._max_queued_requests:
            raise RequestError(
                OVERLOADED, f"{len(self._in_flight)} requests in flight (limit {self._max_queued_requests}); retry later"
            )
        graph = self.policy.unfold(model, message["inputs"])
        if self.processor.unsubmitted_nodes + len(graph.nodes) > self._max_queued_nodes:
            raise RequestError(OVERLOADED, f"{self.processor.unsubmitted_nodes} cells queued (limit {self._max_queued_nodes}); retry later")
        request = self.processor.admit(client, request_id, model, message["inputs"], graph, arrival)
        self._in_flight[key] = request
        deadline_ms = deadline_ms if deadline_ms is not None else self._default_deadline_ms or None
        if deadline_ms is not None:
            request.deadline = arrival + deadline_ms / 1e3
            heapq.heappush(self._deadlines, (request.deadline, id(request), request))

    def _cancel(self, client: bytes, request_id: Any, message: dict[str, Any]) -> None:
        if "target" not in message:
            raise RequestError(BAD_REQUEST, "cancel lacks 'target' (the id of an earlier request)")
        request = self._in_flight.get((client, message["target"]))
        if request is not None:
            self.processor.fail(request, RequestError(CANCELLED, "cancelled by the client"))
        self._reply(client, {"id": request_id, "ok": True, "cancelled": request is not None})

    def _finish(self, request: Request, error: RequestError | None) -> None:
        """Answer a request: its results, or the error that ended it."""
        self._in_flight.pop((request.client, request.request_id), None)
        end = time.perf_counter()
        earliest = self.processor.earliest_running_arrival()
        left_early = earliest is not None and earliest < request.arrival
        if error is not None:
            self.stats.request_answered(error.code, None, False)
            if self.metrics is not None:
                self.metrics.request_finished(request.model.name, error.code, None, None)
            log.info("request %r (%s) ended: %s %s", request.request_id, request.model.name, error.code, error.message,
                     extra={"request_id": request.request_id, "model": request.model.name, "outcome": error.code})
            self._reply(request.client, error_reply(request.request_id, error.code, error.message))
            return
        timing = request_timing(request, end)
        self.stats.request_answered("ok", timing, left_early)
        if self.metrics is not None:
            self.metrics.request_finished(request.model.name, "ok", timing["total_us"] / 1e6, timing["queue_us"] / 1e6)
        outputs = request.model.outputs(request.graph, request.results)
        self._reply(request.client, {"id": request.request_id, "ok": True, "outputs": outputs, "timing": timing})

    # -- introspection ---------------------------------------------------------------------------
    def _models(self) -> dict[str, Any]:
        described = {}
        for name, model in self.models.items():
            entry = model.describe()
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
                {"id": w.worker_id, "index": w.index, "device": w.device, "pid": w.pid, "tasks_in_flight": w.in_flight}
                for w in self.workers.values()
            ],
            "expected_workers": self.expected_workers,
        }

    def _stats(self) -> dict[str, Any]:
        return {
            **self.stats.snapshot(),
            "policy": self.config.scheduler.policy,
            "requests_in_flight": len(self._in_flight),
            "requests_waiting_for_a_batch": self.policy.queued_requests(),
            "ready_nodes": self.scheduler.ready_nodes(),
            "workers": {
                str(w.worker_id): {
                    "tasks_in_flight": w.in_flight,
                    "tasks_completed": w.tasks_completed,
                    "first_task_delay_ms": None if w.first_task_delay is None else w.first_task_delay * 1e3,
                    "pid": w.pid,
                    "arenas": w.occupancy(),
                    "slots_in_use": w.slots_in_use(),
                }
                for w in self.workers.values()
            },
        }


def _is_loopback(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return not address.startswith("tcp://") or host in ("localhost", "::1") or host.startswith("127.")


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _optional_int(message: dict[str, Any], field: str, minimum: int | None = None) -> int | None:
    value = message.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise RequestError(BAD_REQUEST, f"'{field}' must be an integer{bound}, got {value!r}")
    return value


def _echo_id(value: Any) -> Any:
    """A request id fit to echo back: an int or a str, else None."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    return None
