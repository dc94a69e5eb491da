"""The worker process: registers with the manager, issues tasks ahead of time, reports completions.

Threads (ZeroMQ sockets are not thread-safe, so each thread has its own):
* issuer (main thread): receives tasks, pushes each on the in-progress FIFO and
  issues all its work to the stream at once, in arrival order, without waiting;
* poller: watches the stream's signal counter and, for each increment, pops the
  FIFO head and sends a completion notice (several are coalesced into one message);
  on CPU the stream thread sends the notices itself and the poller only sends heartbeats.

A worker on another host than the manager (the manager says so at registration) puts the rows
its tasks downloaded into their completion notices, since the manager cannot map its io arenas.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import zmq

from batchmaker.common.addresses import completion_address
from batchmaker.common.auth import CurveClient
from batchmaker.common.config import (
    DEFAULT_CONFIG,
    Config,
    ConfigError,
    ModelConfig,
    load_config,
    model_from_wire,
)
from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.hosts import default_host_id
from batchmaker.common.logs import setup_logging
from batchmaker.common.protocol import decode, encode
from batchmaker.common.sockets import NOW, receive, server_context
from batchmaker.common.task import LaneTaskMessage, TaskMessage, decode_task
from batchmaker.common.worker_keys import worker_curve
from batchmaker.worker.backend import Backend, DeviceFault
from batchmaker.worker.chain_runs import ChainBounds
from batchmaker.worker.held_requests import HeldRequests, Routed
from batchmaker.worker.loading import build_cells, load_version, unload_version
from batchmaker.worker.notices import InProgressFIFO, Poller
from batchmaker.worker.startup import EXIT_CONFIG_ERROR, start
from batchmaker.worker.step_watchdog import StepWatchdog

log = logging.getLogger("batchmaker.worker")

REGISTER_TIMEOUT_S = 60.0
PROGRESS_S = 1.0  # a running batch with steps and no answers reports its steps this often: the hang watchdog's sign
EXIT_DEVICE_FAULT = 4  # the device failed while serving: its context is unusable, a fresh process is needed


def load_cells(
    config: Config, device: str = "cpu"
) -> tuple[list[CellTypeSpec], list[torch.nn.Module], list[ValueKind]]:
    """Every configured model's cell types in the manager's order, with their modules (weights loaded)."""
    return build_cells(list(config.models.values()), device)


class OtherModels(Exception):
    """The manager serves other models than this worker's config file names (it was edited, and reloaded,
    since the manager started): the worker builds the manager's and registers again."""

    def __init__(self, models: list[ModelConfig]):
        super().__init__("the manager serves other models")
        self.models = models


class Worker:
    def __init__(
        self,
        backend: Backend,
        manager: str,
        index: int,
        cell_keys: list[str],
        parent_pid: int | None,
        host: str,
        curve: CurveClient | None = None,
        make_held: Callable[[ChainBounds], HeldRequests] | None = None,
    ):
        """`make_held` builds the worker's running batch when the manager says at registration that it routes
        requests whole."""
        self._backend = backend
        self._make_held = make_held
        self._held: HeldRequests | None = None
        self._watchdog: StepWatchdog | None = None  # with a running batch: ends the process when a step hangs
        self._reported_at = 0.0  # when the running batch last sent answers or steps
        self._manager = manager
        self._index = index
        self._cell_keys = cell_keys
        self._parent_pid = parent_pid
        self._host = host
        self._curve = curve
        self._local = True  # on the manager's host: the manager reads results from the io arenas
        self._notice_key = b""  # the manager's proof of who sends our notices, given at registration
        self._context = server_context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._socket)
        self._fifo = InProgressFIFO()
        self._stop = False
        self._manager_timeout = 0.0
        self._last_heard = time.monotonic()

    def request_stop(self, *_: object) -> None:
        """SIGTERM/SIGINT: stop, unless it is the supervisor's death (PDEATHSIG) reaching a registered
        worker, which keeps serving its manager's drain until the manager stops it or falls silent."""
        if self._orphaned() and self._manager_timeout:
            log.warning("parent process %d is gone; serving the manager until it stops", self._parent_pid)
            return
        self._stop = True

    def _orphaned(self) -> bool:
        return self._parent_pid is not None and os.getppid() != self._parent_pid

    def _register(self) -> int:
        """Register; returns the worker id. The manager refusing this worker's CURVE key shows only
        as a failed handshake on the socket, so its monitor is watched meanwhile."""
        refused = self._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            self._socket.connect(self._manager)
            self._socket.send(
                encode(
                    {
                        "op": "register",
                        "index": self._index,
                        "pid": os.getpid(),
                        "host": self._host,
                        "device": self._backend.device,
                        "cells": self._cell_keys,
                        "arenas": [arena.to_wire() for arena in self._backend.arenas],
                        "signal": self._backend.signal_name,
                        "full_task_s": self._backend.full_task_seconds(),
                        "kernel_busy_us": self._backend.kernel_busy_us(),  # its warm-up's, not counted as load
                    }
                )
            )
            return self._await_registration(refused)
        finally:
            self._socket.disable_monitor()
            refused.close()

    def _await_registration(self, refused: zmq.Socket) -> int:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(refused, zmq.POLLIN)
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while not self._stop and time.monotonic() < deadline:
            events = dict(poller.poll(200))
            if refused in events:
                raise RuntimeError(
                    f"the manager at {self._manager} refused this worker's CURVE key: "
                    "its public key is not in the manager's allowed_workers directory"
                )
            if self._socket in events:
                kind, payload = self._socket.recv_multipart()
                reply = decode(payload)
                if kind == b"registered" and reply.get("models") is not None:
                    raise OtherModels([model_from_wire(model) for model in reply["models"]])
                if kind != b"registered" or not reply.get("ok"):
                    raise RuntimeError(f"manager refused registration: {reply.get('error')}")
                self._attach_peers(reply.get("peers", {}))
                self._manager_timeout = reply["manager_timeout_s"]
                self._local = reply["local"]
                self._notice_key = reply["notice_key"]
                if reply.get("running_batch") and self._make_held is not None:
                    self._held = self._make_held(ChainBounds(**reply["running_batch"]))
                    self._watchdog = StepWatchdog(reply["hang_timeout_s"])
                return reply["worker_id"]
            self._check_alive()
        hint = " (check that this worker has the manager's public key)" if self._curve is not None else ""
        raise TimeoutError(f"manager at {self._manager} did not answer the registration{hint}")

    def _attach_peers(self, peers: dict[Any, list[dict[str, Any]]]) -> None:
        """Open the peers' arenas and tell the manager which ones this worker can read: it moves a request
        here only once every worker holding its values is one of them."""
        readable, unreadable = [], {}
        for worker_id, arenas in peers.items():
            reason = self._backend.attach_peer(int(worker_id), arenas)
            if reason is None:
                readable.append(int(worker_id))
            else:
                unreadable[str(worker_id)] = reason
        if peers:
            self._socket.send(encode({"op": "peers", "readable": readable, "unreadable": unreadable}))

    def _check_alive(self) -> None:
        """Exit when the supervisor that started us is gone before we registered, or the manager has
        fallen silent (an orphaned manager drains, then tells its workers to stop)."""
        if self._orphaned() and not self._manager_timeout:
            log.warning("parent process %d is gone; exiting", self._parent_pid)
            self._stop = True
        elif self._manager_timeout and time.monotonic() - self._last_heard > self._manager_timeout:
            log.warning("no word from the manager for %.0f s; exiting", self._manager_timeout)
            self._stop = True

    def run(self) -> None:
        try:
            worker_id = self._register()
        except OtherModels:
            self._backend.close()
            self._socket.close()
            self._context.term()
            raise
        where = "the manager's host" if self._local else "another host than the manager's: results travel in notices"
        log.info("worker %d registered as %d on %s, on %s", self._index, worker_id, self._backend.device, where)
        address = completion_address(self._manager)
        poller = Poller(self._context, address, worker_id, self._notice_key, self._backend, self._fifo, self._curve)
        poller.start()
        if self._watchdog is not None:
            self._watchdog.start()
        try:
            self._issue_loop(poller)
        finally:
            poller.stopping.set()
            poller.join(timeout=2)
            self._backend.close()  # the stream has stopped: its socket can be closed from here
            poller.close_stream_socket()
            self._socket.close()
            self._context.term()
        if poller.fault is not None:
            raise poller.fault

    def _issue_loop(self, poller: Poller) -> None:
        socket = self._socket
        while not self._stop and poller.fault is None:
            busy = self._held is not None and self._held.busy
            if socket.poll(0 if busy else 500):
                self._last_heard = time.monotonic()
                self._drain(socket)
            if busy:
                with self._watchdog.step():
                    replies = self._held.step()
                self._answer(*replies)
            self._check_alive()

    def _answer(self, partials: list[list[Any]], answers: list[list[Any]]) -> None:
        """Send the manager partials and answers of routed requests, with the steps the running batch ran since the
        last ones and the kernels' busy time so far (a heartbeat's would be up to HEARTBEAT_S old); with none, the
        steps alone once PROGRESS_S has passed, so that a batch that runs is not taken for hung."""
        now = time.monotonic()
        if not answers and not partials and now - self._reported_at < PROGRESS_S:
            return
        ran = self._held.batch.take_ran() if self._held is not None else {}
        if answers or partials or ran:
            self._reported_at = now
            kernels = self._backend.kernel_busy_us()
            message = {"op": "answers", "answers": answers, "ran": ran, "kernel_busy_us": kernels}
            if partials:
                message["partials"] = partials
            self._socket.send(encode(message))

    def _drain(self, socket: zmq.Socket) -> None:
        while not self._stop:
            try:
                kind, payload, *more = (frame.bytes for frame in receive(socket, NOW))
            except zmq.Again:
                return
            if kind == b"tasks":  # one frame per task, in the order they are to run
                for frame in (payload, *more):
                    self._issue(decode_task(frame))
            elif kind == b"requests" and self._held is not None:  # routed whole, a frame each; they join together
                self._answer([], self._held.take_many([Routed(*decode(frame)) for frame in (payload, *more)]))
            elif kind == b"drop" and self._held is not None:
                self._held.drop(decode(payload))
            elif kind == b"peers":
                self._attach_peers(decode(payload))
            elif kind == b"forget-peer":
                self._backend.detach_peer(decode(payload)["worker_id"])
            elif kind == b"load":  # before any task sent after it: those may run the version it loads
                message = decode(payload)
                error = load_version(self._backend, message, self._held)
                self._socket.send(encode({"op": "loaded", "model": message["model"]["name"], "error": error}))
            elif kind == b"unload":
                unload_version(self._backend, decode(payload)["cells"], self._held)
            elif kind == b"stop":
                log.info("the manager told this worker to stop")
                self._stop = True


    def _issue(self, task: TaskMessage | LaneTaskMessage) -> None:
        self._fifo.push(task.task_id, [] if self._local else task.io_rows())
        self._backend.issue(task)


def _host_id(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="batchmaker worker", description="Run one worker process for a device, registering with a running manager."
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="TOML config (default: %(default)s)")
    parser.add_argument("--manager", required=True, help="the manager's worker address (server.worker_address)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: from the config)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process stops being the parent")
    parser.add_argument(
        "--host-id",
        type=_host_id,
        default=default_host_id(),
        help="this machine's identity; workers of one host read each other's memory (default: hostname/machine-id)",
    )
    parser.add_argument(
        "--curve",
        nargs=2,
        metavar=("WORKER_SECRET", "MANAGER_PUBLIC"),
        help="this worker's .key_secret file and the manager's .key file (default: from [server.worker_curve])",
    )
    args = parser.parse_args(argv)
    setup_logging(f"worker[{args.index}]")
    try:
        config = load_config(args.config)
        curve = worker_curve(config.server, args.curve)
        torch.set_num_threads(args.threads or config.server.threads_per_worker)
        if args.device.startswith("cuda"):
            from batchmaker.worker.cuda_runtime import arenas_shareable

            arenas_shareable()
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG_ERROR
    models = list(config.models.values())
    # Requests' values and indices arrive as read-only views of their messages; the cells only read the tensors
    # made from them, so torch's warning that writing to them would be undefined does not apply.
    warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
    while True:
        started = start(args.device, args.index, models, config.server)
        if isinstance(started, int):
            return started
        backend, cell_keys, make_held = started
        worker = Worker(backend, args.manager, args.index, cell_keys, args.parent_pid, args.host_id, curve, make_held)
        signal.signal(signal.SIGTERM, worker.request_stop)
        signal.signal(signal.SIGINT, worker.request_stop)
        try:
            worker.run()
        except OtherModels as exc:
            if models == exc.models:  # built from the manager's own tables, and still not what it serves
                log.error("the models the manager sent build other cell types than it serves; exiting")
                return 1
            log.info("the manager serves other models than %s names now: building those", args.config)
            models = exc.models
            continue
        except DeviceFault as exc:
            log.error("%s; exiting, to be restarted: the manager replays this worker's requests", exc)
            return EXIT_DEVICE_FAULT
        except (TimeoutError, RuntimeError) as exc:
            log.error("%s", exc)
            return 1
        return 0


if __name__ == "__main__":
    sys.exit(main())
