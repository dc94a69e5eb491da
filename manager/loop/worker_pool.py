"""The manager's side of its workers: registration, tasks out, completion notices in, and the watchdog.

Workers register on a ROUTER socket (which also carries pings, peer announcements and the
supervisor's readiness checks) and push completion notices to a PULL socket beside it. Both
sockets take only workers with an allowed CURVE key when `[server.worker_curve]` is set. Each
worker says which host it runs on: workers of one host are told of each other's arenas (they
read values there when a request moves between them); a worker on another host than the
manager sends its result rows inside its notices. The pool says which workers it has lost,
and which readiness checks wait for an answer; what happens to their requests, and what the
answer says, is the manager's business (the pool never calls into it).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import zmq

from batchmaker.common.addresses import completion_address
from batchmaker.common.auth import CurveServer
from batchmaker.common.config import ConfigError
from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.hosts import default_host_id
from batchmaker.common.notice import CompletionNotice, decode_notice, is_kernel_time
from batchmaker.common.protocol import BAD_REQUEST, RequestError, decode, echo, encode
from batchmaker.common.server_config import ServerConfig, check_worker_address
from batchmaker.common.sockets import NOW, send, server_context
from batchmaker.common.task import encode_task
from batchmaker.manager.batching.records import Task
from batchmaker.manager.batching.worker_handle import WorkerHandle, check_registration

log = logging.getLogger("batchmaker.manager")

MANAGER_SILENCE_S = 10.0  # a worker that hears nothing from the manager this long exits


class WorkerAnswers(NamedTuple):
    """A worker's message about the requests routed to it: those it ended ([handle, outputs, error] each), the
    outputs its streamed ones gained ([handle, outputs] each, before those answers), and the steps its running batch
    ran (per cell type, by batch size)."""

    worker: WorkerHandle
    answers: list[Any]
    partials: list[Any]
    ran: dict[str, dict[int, int]]


class ControlMessages(NamedTuple):
    """What the control socket brought, for the event loop to act on."""

    restarted: list[WorkerHandle]  # registered as restarts of earlier workers
    exited: list[tuple[WorkerHandle, str]]  # seen to exit by the supervisor (with why)
    health_checks: list[bytes]  # identities that asked for the manager's health: answer with `answer_health`
    registered: list[WorkerHandle]  # every worker that registered (restarts included): it lacks later versions
    loads: list[tuple[WorkerHandle, str, str | None]]  # a worker loaded a version (its internal name), or why not
    answers: list[WorkerAnswers]  # a worker's messages about the requests routed to it


class WorkerPool:
    def __init__(
        self,
        address: str,
        specs: list[CellTypeSpec],
        kinds: list[ValueKind],
        server: ServerConfig,
        supervisor_token: bytes = b"",
        layout: list[dict[str, Any]] | None = None,
        running_batch: dict[str, int] | None = None,
    ):
        """`supervisor_token` is the secret the supervisor that started this process signs its
        messages with; without one, no message is taken as the supervisor's. `layout`: the tables of the
        models the manager started with (`model_to_wire`), sent to a worker that registers with other cells (its
        config file was edited since), which builds them and registers again. `running_batch`: requests are routed
        to the workers whole, which they are told at registration (whatever their own config files say), with these
        bounds of their chain runs (`max_steps`, `max_join_delay_us`); None: the manager decides every step."""
        check_worker_address(address, server, "the worker address")
        self._supervisor_token = supervisor_token
        self._max_rows = {"device": server.arena_rows, "io": server.io_rows}
        self.dropped_messages = 0  # malformed or unproven messages on the worker sockets
        self.workers: dict[int, WorkerHandle] = {}
        self.host = default_host_id()
        self._hosts: dict[str, int] = {self.host: 0}  # host identity -> host number
        self.start_cells = [spec.key for spec in specs]  # a worker registers with these, then loads what came later
        self._layout = layout or []
        self._running_batch = running_batch
        self._kinds = kinds
        self._heartbeat_timeout = server.heartbeat_timeout_ms / 1e3
        self._hang_timeout = server.hang_timeout_ms / 1e3
        self._next_worker_id = 0
        self.seen: set[Any] = set()  # (host, index) of workers that registered before (restarts)
        # A context of their own: its CURVE handler (which workers may register) is not the clients'.
        self._context = server_context()
        self._curve: CurveServer | None = None
        if server.worker_curve is not None:
            keys = server.worker_curve
            try:
                self._curve = CurveServer(self._context, keys.secret_key, keys.allowed_workers, peers="worker")
            except (OSError, ValueError) as exc:
                self._context.term()
                raise ConfigError(f"[server.worker_curve]: {exc}") from None
        self.control = self._socket(zmq.ROUTER, address)
        self.completions = self._socket(zmq.PULL, completion_address(address))

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(socket)
        socket.bind(address)
        return socket

    # -- tasks and completions -------------------------------------------------------------------
    def send(self, worker: WorkerHandle, tasks: list[Task]) -> None:
        if worker.in_flight == len(tasks):
            worker.progress_at = time.monotonic()  # the hang watchdog counts from when work arrives
            if worker.first_task_delay is None:
                worker.first_task_delay = worker.progress_at - worker.registered_at
        # One message for the whole batch: a send wakes both sides' ZeroMQ threads, whatever it carries.
        send(self.control, [worker.identity, b"tasks", *(encode_task(task.message) for task in tasks)])

    def notices(self) -> Iterator[tuple[WorkerHandle, CompletionNotice]]:
        """Completion notices waiting on the socket, from workers still registered."""
        while True:
            try:
                frame = self.completions.recv(NOW)
            except zmq.Again:
                return
            try:
                notice = decode_notice(frame)
            except ValueError as exc:
                self._drop(f"a malformed completion notice ({exc})")
                continue
            worker = self.workers.get(notice.worker_id)
            if worker is None:
                continue  # from a worker already written off
            if not hmac.compare_digest(notice.key, worker.notice_key):
                self._drop(f"a completion notice for worker {notice.worker_id} without its key")
                continue
            worker.heard_from(notice.signal, time.monotonic(), notice.kernel_busy_us)
            if notice.rows:
                try:
                    worker.store_rows(notice.rows)
                except ValueError as exc:
                    error = f"the worker's result rows were unusable: {exc}"
                    log.error("worker %d: %s; its tasks in that notice fail", worker.worker_id, error)
                    notice = dataclasses.replace(notice, errors={task_id: error for task_id in notice.task_ids})
            yield worker, notice

    # -- control: registration, health checks, exits ------------------------------------------------
    def control_messages(self) -> ControlMessages:
        """Serve registrations; return the workers that registered as restarts of earlier ones, those
        the supervisor saw exit (with why), and who asked for a readiness check."""
        restarted: list[WorkerHandle] = []
        exited: list[tuple[WorkerHandle, str]] = []
        health_checks: list[bytes] = []
        registered: list[WorkerHandle] = []
        loads: list[tuple[WorkerHandle, str, str | None]] = []
        answers: list[WorkerAnswers] = []
        while True:
            try:
                identity, frame = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return ControlMessages(restarted, exited, health_checks, registered, loads, answers)
            except ValueError:  # not a two-frame message: not one of our workers
                self._drop("a message of more than one frame on the worker control socket")
                continue
            try:
                message = decode(frame)
            except RequestError:
                message = None
            if not isinstance(message, dict):
                self._drop("a malformed message on the worker control socket")
                continue
            op = message.get("op")
            if op == "answers":
                worker = self._worker_of(identity)
                batch, partials, ran = message.get("answers"), message.get("partials", []), message.get("ran", {})
                kernels = message.get("kernel_busy_us")
                well_formed = isinstance(batch, list) and isinstance(partials, list) and _steps_by_size(ran)
                if worker is None or not well_formed or not is_kernel_time(kernels):
                    self._drop("a malformed answers message on the worker control socket")
                    continue
                worker.kernels_timed(kernels)
                worker.running_batch_ran(ran)
                answers.append(WorkerAnswers(worker, batch, partials, ran))
            elif op == "health":  # the supervisor's readiness check, on the private socket
                health_checks.append(identity)
            elif op == "worker_exited":  # from the supervisor, which saw a process of this host end
                if not self._from_supervisor(message):
                    self._drop("a worker_exited message not signed by the supervisor")
                    continue
                exited += [
                    (worker, f"process exited with status {echo(message.get('status'))}")
                    for worker in self.workers.values()
                    if worker.local and worker.pid == message.get("pid")
                ]
            elif op == "peers":  # which of the announced arenas a registered worker could open
                self._peers_read(identity, message)
            elif op == "loaded":  # a worker loaded a version at run time, or says why it could not
                worker = self._worker_of(identity)
                model, error = message.get("model"), message.get("error")
                if worker is None or not isinstance(model, str) or not isinstance(error, (str, type(None))):
                    self._drop("a malformed load report on the worker control socket")
                    continue
                worker.loads_pending -= 1
                worker.progress_at = time.monotonic()  # its tasks waited for the load: the hang watchdog counts anew
                loads.append((worker, model, error))
            else:
                worker = self._register(identity, message)
                if worker is not None and (worker.host, worker.index) in self.seen:
                    restarted.append(worker)
                if worker is not None:
                    self.seen.add((worker.host, worker.index))
                    registered.append(worker)

    def load(self, worker: WorkerHandle, model: dict[str, Any], first_cell: int, cells: list[str]) -> None:
        """Tell a worker to build a version's model (its table) and add its cell types from index `first_cell`;
        it answers `loaded`. It runs the tasks sent after this message only once it has done so."""
        message = {"model": model, "first_cell": first_cell, "cells": cells}
        worker.loads_pending += 1
        self.control.send_multipart([worker.identity, b"load", encode(message)])

    def unload(self, worker: WorkerHandle, cells: list[int]) -> None:
        """Tell a worker to drop the weights of these cell types: nothing will run them again."""
        self.control.send_multipart([worker.identity, b"unload", encode({"cells": cells})])

    def stop(self, worker: WorkerHandle) -> None:
        self.control.send_multipart([worker.identity, b"stop", b""])

    def _worker_of(self, identity: bytes) -> WorkerHandle | None:
        return next((w for w in self.workers.values() if w.identity == identity), None)

    def route(self, worker: WorkerHandle, frames: list[bytes]) -> None:
        """Requests routed whole to `worker`'s running batch, a frame each: [handle, model, inputs]."""
        send(self.control, [worker.identity, b"requests", *frames])

    def drop(self, worker: WorkerHandle, handles: list[int]) -> None:
        """Routed requests `worker` should let go unanswered (they ended at the manager)."""
        self.control.send_multipart([worker.identity, b"drop", encode(handles)])

    def answer_health(self, identity: bytes, health: dict[str, Any]) -> None:
        """Answer a readiness check `control_messages` returned."""
        self.control.send_multipart([identity, b"health", encode(health)])

    def _from_supervisor(self, message: dict[str, Any]) -> bool:
        token = message.get("token")
        expected = self._supervisor_token
        return bool(expected) and isinstance(token, bytes) and hmac.compare_digest(token, expected)

    def _peers_read(self, identity: bytes, message: dict[str, Any]) -> None:
        """A worker says which peers' arenas it opened and which it could not (an IPC open that failed, GPUs
        without peer access, server.cross_gpu_reads): placement moves a request to it only from the former."""
        worker = self._worker_of(identity)
        readable, unreadable = message.get("readable"), message.get("unreadable")
        if worker is None or not isinstance(readable, list) or not isinstance(unreadable, dict):
            self._drop("a malformed peers report on the worker control socket")
            return
        worker.unread.difference_update(readable)
        for peer, reason in unreadable.items():
            log.warning("worker %d cannot read the arenas of worker %s: %s", worker.worker_id, echo(peer), echo(reason))
            if isinstance(peer, str) and peer.isdigit() and int(peer) in worker.unread:
                worker.unreadable[int(peer)] = str(reason)

    def _drop(self, what: str) -> None:
        """A message on the worker sockets that no worker of ours sent as it is: counted, logged, ignored."""
        self.dropped_messages += 1
        log.warning("dropped %s (%d dropped so far)", what, self.dropped_messages)

    def _register(self, identity: bytes, message: dict[str, Any]) -> WorkerHandle | None:
        try:
            if message.get("op") != "register":
                raise RequestError(BAD_REQUEST, f"unknown worker op {echo(message.get('op'))}")
            if message.get("cells") != self.start_cells and not self._layout:
                raise RequestError(
                    BAD_REQUEST, f"worker serves cells {echo(message.get('cells'))}, the manager {self.start_cells}"
                )
            if message.get("cells") != self.start_cells:
                index = echo(message.get("index"))
                log.info("worker %s built other models than the manager started with: it builds those", index)
                self.control.send_multipart([identity, b"registered", encode({"ok": False, "models": self._layout})])
                return None
            host = message.get("host")
            if not isinstance(host, str) or not host:
                raise RequestError(BAD_REQUEST, "worker did not say which host it runs on")
            check_registration(message, self._max_rows)
            number = self._hosts.get(host, len(self._hosts))
            try:
                worker = WorkerHandle(self._next_worker_id, identity, message, self._kinds, number, host == self.host)
            except (KeyError, TypeError, ValueError) as exc:
                raise RequestError(BAD_REQUEST, f"malformed arenas in the registration: {echo(exc)}") from None
            self._hosts[host] = number
        except RequestError as exc:
            log.error("worker registration refused: %s", exc.message)
            self.control.send_multipart([identity, b"registered", encode({"ok": False, "error": exc.message})])
            return None
        self._next_worker_id += 1
        neighbours = self._neighbours(worker)
        self.workers[worker.worker_id] = worker
        worker.unread = {other.worker_id for other in neighbours}  # until it says it opened their arenas
        for other in neighbours:
            other.unread.add(worker.worker_id)
        log.info(
            "worker %s (pid %s, %s) on %s host %s registered as %d",
            worker.index, worker.pid, worker.device, "this" if worker.local else "another", host, worker.worker_id,
        )  # fmt: skip
        reply = {
            "ok": True,
            "worker_id": worker.worker_id,
            "local": worker.local,
            "peers": {str(w.worker_id): w.arenas for w in neighbours},
            "manager_timeout_s": MANAGER_SILENCE_S,
            "notice_key": worker.notice_key,
            "running_batch": self._running_batch,
            "hang_timeout_s": self._hang_timeout,  # a running batch's step that outlasts it ends its worker
        }
        self.control.send_multipart([identity, b"registered", encode(reply)])
        announcement = encode({str(worker.worker_id): worker.arenas})
        for other in neighbours:
            self.control.send_multipart([other.identity, b"peers", announcement])
        return worker

    def _neighbours(self, worker: WorkerHandle) -> list[WorkerHandle]:
        """The other registered workers of its host: the only ones whose arenas it may read, and that may read its."""
        return [w for w in self.workers.values() if w.host_number == worker.host_number and w is not worker]

    # -- the watchdog --------------------------------------------------------------------------------
    def watch(self, stalled: dict[int, float]) -> list[tuple[WorkerHandle, str]]:
        """Ping every worker; return the silent ones and the hung ones (tasks in flight, counter stuck; or a
        running batch `stalled`, by worker id, holding requests with no step for that many seconds): killed on
        this host, told to stop on another."""
        now = time.monotonic()
        lost = []
        for worker in self.workers.values():
            hung = None
            if worker.tasks and not worker.loads_pending and now - worker.progress_at > self._hang_timeout:
                hung = f"hung: its stream did not advance for {now - worker.progress_at:.1f} s"
            elif worker.worker_id in stalled:
                hung = f"hung: its running batch ran no step for {stalled[worker.worker_id]:.1f} s"
            if now - worker.last_seen > self._heartbeat_timeout:
                lost.append((worker, f"silent for {now - worker.last_seen:.1f} s"))
            elif hung is not None:
                if worker.local:
                    _kill(worker.pid)
                else:  # its pid means nothing here; it also exits once the manager falls silent to it
                    self.control.send_multipart([worker.identity, b"stop", b""])
                lost.append((worker, hung))
            else:
                self.control.send_multipart([worker.identity, b"ping", b""])
        return lost

    def remove(self, worker: WorkerHandle) -> None:
        """Forget a dead worker; the others of its host stop reading its arenas."""
        del self.workers[worker.worker_id]
        for other in self._neighbours(worker):
            other.unread.discard(worker.worker_id)
            other.unreadable.pop(worker.worker_id, None)
            self.control.send_multipart([other.identity, b"forget-peer", encode({"worker_id": worker.worker_id})])
        worker.close()

    def close(self) -> None:
        for worker in self.workers.values():
            self.control.send_multipart([worker.identity, b"stop", b""])
            worker.close()
        self.control.close()
        self.completions.close()
        if self._curve is not None:
            self._curve.stop()
        self._context.term()


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _steps_by_size(ran: Any) -> bool:
    """Whether `ran` is steps per cell type by batch size: {str: {int: int}}."""
    return isinstance(ran, dict) and all(
        isinstance(key, str) and isinstance(sizes, dict) and all(type(n) is int for pair in sizes.items() for n in pair)
        for key, sizes in ran.items()
    )
