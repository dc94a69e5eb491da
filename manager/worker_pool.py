"""The manager's side of its workers: registration, tasks out, completion notices in, and the watchdog.

Workers register on a ROUTER socket (which also carries pings, peer announcements and the
supervisor's readiness checks) and push completion notices to a PULL socket beside it. The
pool says which workers it has lost; what happens to their requests is the manager's business.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from common.graph import CellTypeSpec, ValueKind
from common.protocol import BAD_REQUEST, RequestError, decode, encode
from common.task import CompletionNotice, decode_notice
from manager.state import Task
from manager.workers import WorkerHandle

log = logging.getLogger("batchmaker.manager")

MANAGER_SILENCE_S = 10.0  # a worker that hears nothing from the manager this long exits


def completion_address(worker_address: str) -> str:
    """Where workers push completion notices: beside the worker address."""
    if worker_address.startswith("tcp://"):
        host, _, port = worker_address.rpartition(":")
        return f"{host}:{int(port) + 1}"
    return worker_address + "-completions"


class WorkerPool:
    def __init__(
        self,
        context: zmq.Context,
        address: str,
        specs: list[CellTypeSpec],
        kinds: list[ValueKind],
        heartbeat_timeout_s: float,
        hang_timeout_s: float,
        health: Callable[[], dict[str, Any]],
    ):
        self.workers: dict[int, WorkerHandle] = {}
        self._cells = [spec.key for spec in specs]
        self._kinds = kinds
        self._heartbeat_timeout = heartbeat_timeout_s
        self._hang_timeout = hang_timeout_s
        self._health = health
        self._next_worker_id = 0
        self.seen_indices: set[Any] = set()  # worker indices that registered before (restarts)
        self.control = context.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(address)
        self.completions_address = completion_address(address)
        self.completions = context.socket(zmq.PULL)
        self.completions.setsockopt(zmq.LINGER, 0)
        self.completions.bind(self.completions_address)

    # -- tasks and completions -------------------------------------------------------------------
    def send(self, worker: WorkerHandle, tasks: list[Task]) -> None:
        if worker.in_flight == len(tasks):
            worker.progress_at = time.monotonic()  # the hang watchdog counts from when work arrives
            if worker.first_task_delay is None:
                worker.first_task_delay = worker.progress_at - worker.registered_at
        for task in tasks:
            self.control.send_multipart([worker.identity, b"task", task.message])

    def notices(self) -> Iterator[tuple[WorkerHandle, CompletionNotice]]:
        """Completion notices waiting on the socket, from workers still registered."""
        while True:
            try:
                frame = self.completions.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            notice = decode_notice(frame)
            worker = self.workers.get(notice.worker_id)
            if worker is None:
                continue  # from a worker already written off
            worker.heard_from(notice.signal, time.monotonic())
            yield worker, notice

    # -- control: registration, health checks, exits ------------------------------------------------
    def control_messages(self) -> tuple[list[WorkerHandle], list[tuple[WorkerHandle, str]]]:
        """Serve registrations and readiness checks; return the workers that registered as restarts
        of earlier ones, and those the supervisor saw exit (with why)."""
        restarted: list[WorkerHandle] = []
        exited: list[tuple[WorkerHandle, str]] = []
        while True:
            try:
                identity, frame = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return restarted, exited
            except ValueError:
                continue  # not a two-frame message: not one of our workers
            try:
                message = decode(frame)
            except RequestError:
                continue
            op = message.get("op")
            if op == "health":  # the supervisor's readiness check, on the private socket
                self.control.send_multipart([identity, b"health", encode(self._health())])
            elif op == "worker_exited":  # from the supervisor, which saw the process end
                exited += [
                    (worker, f"process exited with status {message.get('status')}")
                    for worker in self.workers.values()
                    if worker.pid == message.get("pid")
                ]
            else:
                worker = self._register(identity, message)
                if worker is not None and worker.index in self.seen_indices:
                    restarted.append(worker)
                if worker is not None:
                    self.seen_indices.add(worker.index)

    def _register(self, identity: bytes, message: dict[str, Any]) -> WorkerHandle | None:
        try:
            if message.get("op") != "register":
                raise RequestError(BAD_REQUEST, f"unknown worker op {message.get('op')!r}")
            if message.get("cells") != self._cells:
                raise RequestError(BAD_REQUEST, f"worker serves cells {message.get('cells')}, the manager {self._cells}")
            peers = {str(w.worker_id): w.arenas for w in self.workers.values()}
            worker = WorkerHandle(self._next_worker_id, identity, message, self._kinds)
        except RequestError as exc:
            log.error("worker registration refused: %s", exc.message)
            self.control.send_multipart([identity, b"registered", encode({"ok": False, "error": exc.message})])
            return None
        self._next_worker_id += 1
        self.workers[worker.worker_id] = worker
        log.info("worker %s (pid %s, %s) registered as %d", worker.index, worker.pid, worker.device, worker.worker_id)
        reply = {
            "ok": True,
            "worker_id": worker.worker_id,
            "completions": self.completions_address,
            "peers": peers,
            "manager_timeout_s": MANAGER_SILENCE_S,
        }
        self.control.send_multipart([identity, b"registered", encode(reply)])
        announcement = encode({str(worker.worker_id): worker.arenas})
        for other in self.workers.values():
            if other is not worker:
                self.control.send_multipart([other.identity, b"peers", announcement])
        return worker

    # -- the watchdog --------------------------------------------------------------------------------
    def watch(self) -> list[tuple[WorkerHandle, str]]:
        """Ping every worker; return the silent ones and the hung ones (killed: tasks in flight, counter stuck)."""
        now = time.monotonic()
        lost = []
        for worker in self.workers.values():
            if now - worker.last_seen > self._heartbeat_timeout:
                lost.append((worker, f"silent for {now - worker.last_seen:.1f} s"))
            elif worker.tasks and now - worker.progress_at > self._hang_timeout:
                _kill(worker.pid)
                lost.append((worker, f"hung: its stream did not advance for {now - worker.progress_at:.1f} s"))
            else:
                self.control.send_multipart([worker.identity, b"ping", b""])
        return lost

    def remove(self, worker: WorkerHandle) -> None:
        """Forget a dead worker; the others stop reading its arenas."""
        del self.workers[worker.worker_id]
        for other in self.workers.values():
            self.control.send_multipart([other.identity, b"forget-peer", encode({"worker_id": worker.worker_id})])
        worker.close()

    def close(self) -> None:
        for worker in self.workers.values():
            self.control.send_multipart([worker.identity, b"stop", b""])
            worker.close()
        self.control.close()
        self.completions.close()


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
