"""The supervisor: starts the manager and one worker process per device, watches them, stops them all.

Children are told to die with the supervisor (PR_SET_PDEATHSIG on Linux) and also
check their parent themselves, so no process is left behind even if the
supervisor is killed outright. A worker that dies is restarted with exponential
backoff, within a restart budget; the manager replays its requests meanwhile. If
the manager dies the supervisor stops everything and exits non-zero, so a process
manager above it can restart the service.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import zmq

from batchmaker.common.auth import connect_socket
from batchmaker.common.config import (
    Config,
    resolve_running_batch,
    with_door_addresses,
    with_metrics_address,
    with_policy,
    with_running_batch,
)
from batchmaker.common.protocol import decode, encode
from batchmaker.common.shm import remove_stale_segments
from batchmaker.common.worker_keys import worker_curve
from batchmaker.manager.commands.doors import door_arguments, door_processes, doors_listening
from batchmaker.manager.commands.preflight import check_before_start
from batchmaker.manager.loop.main import SUPERVISOR_TOKEN_ENV

log = logging.getLogger("batchmaker.supervisor")

STOP_GRACE_S = 5.0
WATCH_INTERVAL_S = 0.1
RESTART_BACKOFF_S = 0.5  # first restart delay, doubled after each restart up to the maximum
MAX_RESTART_BACKOFF_S = 30.0
RESTART_WINDOW_S = 600.0  # the restart budget counts restarts within this window
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the supervisor dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the children's own parent check still applies


def resolve_devices(config: Config, workers: int | None) -> list[str]:
    """The devices to start workers on: the configured list, or every GPU, else CPU workers."""
    devices = config.server.devices
    if isinstance(devices, tuple):
        return list(devices)
    if devices == "auto" and workers is None:
        gpus = _gpu_count()
        if gpus:
            return [f"cuda:{i}" for i in range(gpus)]
    return ["cpu"] * (workers or config.server.cpu_workers)


def _gpu_count() -> int:
    """torch's count of visible GPUs, asked of a child process: the supervisor itself never loads torch."""
    probe = "import torch; print(torch.cuda.device_count())"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
        return int(done.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.SubprocessError):  # no usable CUDA runtime: serve on CPU workers
        return 0


class WorkerSlot:
    """One configured worker: its process, and the restart history that bounds how often it is restarted."""

    def __init__(self, index: int, device: str):
        self.index = index
        self.device = device
        self.process: subprocess.Popen | None = None
        self.restarts: collections.deque[float] = collections.deque()
        self.backoff = RESTART_BACKOFF_S
        self.restart_at: float | None = None
        self.given_up = False


class Supervisor:
    def __init__(self, config: Config, address: str | None = None, workers: int | None = None):
        self.devices = resolve_devices(config, workers)
        self.config = resolve_running_batch(config, self.devices)
        self.address = address or config.server.address
        self._private_dir: str | None = None
        if config.server.worker_address == "auto":
            self._private_dir = tempfile.mkdtemp(prefix="batchmaker-")
            os.chmod(self._private_dir, 0o700)
            self.worker_address = f"ipc://{self._private_dir}/workers"
        else:
            self.worker_address = config.server.worker_address
        self._curve = worker_curve(config.server)  # for its own requests on the worker socket
        self.manager: subprocess.Popen | None = None
        self.doors: list[subprocess.Popen] = []  # the OIP front door's processes ([http], [grpc])
        self.slots = [WorkerSlot(index, device) for index, device in enumerate(self.devices)]
        self._stopping = False
        self._aborting = False
        self._notices: zmq.Socket | None = None
        self._token = secrets.token_bytes(16)  # signs worker_exited: only the manager, our child, knows it

    def _spawn(self, module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        command = [sys.executable, "-m", module, "--config", str(self.config.path), "--parent-pid", str(os.getpid())]
        # A process group of their own: a terminal's Ctrl-C reaches only the supervisor, which stops them in order.
        # _die_with_parent makes one system call and takes no lock, so it is safe after fork in a threaded parent.
        return subprocess.Popen(
            [*command, *args], preexec_fn=_die_with_parent, process_group=0, env=env  # noqa: PLW1509
        )

    def _spawn_worker(self, slot: WorkerSlot) -> None:
        slot.process = self._spawn(
            "batchmaker.worker", "--manager", self.worker_address, "--device", slot.device, "--index", str(slot.index)
        )

    def start(self) -> None:
        for name in remove_stale_segments():
            log.info("removed stale shared memory %s (its process is gone)", name)
        self.manager = self._spawn(
            "batchmaker.manager",
            "--address",
            self.address,
            "--worker-address",
            self.worker_address,
            "--expected-workers",
            str(len(self.devices)),
            "--policy",
            self.config.scheduler.policy,
            "--running-batch",
            self.config.scheduler.running_batch,
            "--metrics-address",
            self.config.server.metrics_address,
            env={**os.environ, SUPERVISOR_TOKEN_ENV: self._token.hex()},
        )
        for slot in self.slots:
            self._spawn_worker(slot)
        arguments = door_arguments(self.config, self.address)
        self.doors = [self._spawn("batchmaker.frontdoor", *arguments) for _ in range(door_processes(self.config))]

    @property
    def workers(self) -> list[subprocess.Popen]:
        return [slot.process for slot in self.slots if slot.process is not None]

    @property
    def children(self) -> list[subprocess.Popen]:
        return [p for p in [self.manager, *self.doors, *self.workers] if p is not None]

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Ask the manager for its health until every worker has registered: on the worker socket
        (with the workers' CURVE keys where it takes them), so client authentication does not apply;
        then wait for the front door's listeners, if any."""
        context = zmq.Context.instance()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopping:
            if self._dead_child() is not None:
                return False
            socket = connect_socket(context, zmq.DEALER, self.worker_address, self._curve)
            try:
                socket.send(encode({"op": "health"}))
                if socket.poll(500):
                    _, reply = socket.recv_multipart()
                    if decode(reply).get("status") == "ready":
                        return self._wait_doors(deadline)
            finally:
                socket.close()
            time.sleep(0.2)
        return False

    def _wait_doors(self, deadline: float) -> bool:
        while not doors_listening(self.config):
            if time.monotonic() > deadline or self._stopping or self._dead_child() is not None:
                return False
            time.sleep(0.05)
        return True

    def _dead_child(self) -> subprocess.Popen | None:
        return next((p for p in self.children if p.poll() is not None), None)

    def request_stop(self, *_: object) -> None:
        """First signal: drain and stop. Second signal: stop at once."""
        if self._stopping:
            self._aborting = True
        self._stopping = True

    def forward_reload(self, *_: object) -> None:
        """SIGHUP: the manager reads the config again and applies its models' changes (it owns the models)."""
        if self.manager is not None and self.manager.poll() is None:
            _signal_pid(self.manager.pid, signal.SIGHUP)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def watch(self) -> int:
        """Restart workers that die; return 0 when asked to stop, 1 if the manager dies."""
        while not self._stopping:
            if self.manager is not None and self.manager.poll() is not None:
                log.error(
                    "the manager (pid %d) exited with status %s; stopping", self.manager.pid, self.manager.returncode
                )
                return 1
            door = next((door for door in self.doors if door.poll() is not None), None)
            if door is not None:
                log.error("a front door process (pid %d) exited with status %s; stopping", door.pid, door.returncode)
                return 1
            for slot in self.slots:
                self._tend(slot)
            time.sleep(WATCH_INTERVAL_S)
        return 0

    def _tend(self, slot: WorkerSlot) -> None:
        now = time.monotonic()
        process = slot.process
        if process is not None and process.poll() is not None:
            log.warning("worker %d (pid %d) exited with status %s", slot.index, process.pid, process.returncode)
            self._tell_manager(
                {"op": "worker_exited", "pid": process.pid, "status": process.returncode, "token": self._token}
            )
            slot.process = None
            while slot.restarts and now - slot.restarts[0] > RESTART_WINDOW_S:
                slot.restarts.popleft()
            if len(slot.restarts) >= self.config.server.restart_budget:
                slot.given_up = True
                log.error(
                    "worker %d restarted %d times within %.0f s; not restarting it",
                    slot.index,
                    len(slot.restarts),
                    RESTART_WINDOW_S,
                )
            else:
                slot.restart_at = now + slot.backoff
                slot.backoff = min(slot.backoff * 2, MAX_RESTART_BACKOFF_S)
        if slot.process is None and not slot.given_up and slot.restart_at is not None and now >= slot.restart_at:
            slot.restarts.append(now)
            slot.restart_at = None
            self._spawn_worker(slot)
            log.info("worker %d restarted (pid %d)", slot.index, slot.process.pid)
        if slot.process is not None and slot.restarts and now - slot.restarts[-1] > RESTART_WINDOW_S:
            slot.backoff = RESTART_BACKOFF_S  # a long healthy run resets the backoff

    def _tell_manager(self, message: dict) -> None:
        """The manager also notices a dead worker by its silence; this makes it immediate."""
        if self._notices is None:
            self._notices = connect_socket(zmq.Context.instance(), zmq.DEALER, self.worker_address, self._curve)
        self._notices.send(encode(message), zmq.NOBLOCK)

    def stop(self) -> None:
        """Drain: SIGTERM the manager and let it answer what it accepted; then stop the workers.

        A second SIGINT/SIGTERM meanwhile (or a manager that does not finish in time)
        turns this into SIGKILL for everything.
        """
        draining = [p for p in [self.manager, *self.doors] if p is not None and p.poll() is None]
        if self.manager in draining and not self._aborting:
            # The front door stops taking requests and waits for the answers of those it took, which the
            # manager gives while it drains; both are waited for.
            for process in draining:
                _signal_pid(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.config.server.drain_timeout_ms / 1e3 + STOP_GRACE_S
            while any(p.poll() is None for p in draining) and not self._aborting and time.monotonic() < deadline:
                time.sleep(WATCH_INTERVAL_S)
        processes = []
        for child in self.children:
            try:
                processes.append(psutil.Process(child.pid))
            except psutil.NoSuchProcess:
                pass
        descendants = [d for p in processes for d in _children_of(p)]
        if not self._aborting:
            for process in processes:
                _signal(process, signal.SIGTERM)
            _, alive = psutil.wait_procs(processes, timeout=STOP_GRACE_S)
        else:
            alive = processes
        for process in [*alive, *descendants]:
            _signal(process, signal.SIGKILL)
        psutil.wait_procs([*alive, *descendants], timeout=STOP_GRACE_S)
        for child in self.children:
            child.poll()
        if self._notices is not None:
            self._notices.close()
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)


def _children_of(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _signal(process: psutil.Process, signum: int) -> None:
    try:
        process.send_signal(signum)
    except psutil.NoSuchProcess:
        pass


def serve(
    config: Config,
    address: str | None,
    workers: int | None,
    policy: str | None = None,
    metrics_address: str | None = None,
    doors: tuple[str | None, str | None] = (None, None),
    running_batch: str | None = None,
) -> int:
    """Run the server in the foreground until SIGINT/SIGTERM; `doors`: the front door's (HTTP, gRPC) listeners."""
    if policy is not None:
        config = with_policy(config, policy)
    if running_batch is not None:
        config = with_running_batch(config, running_batch)
    if metrics_address is not None:
        config = with_metrics_address(config, metrics_address)
    config = with_door_addresses(config, *doors)
    check_before_start(config, address or config.server.address)
    supervisor = Supervisor(config, address, workers)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGHUP, supervisor.forward_reload)
    supervisor.start()
    try:
        if not supervisor.wait_ready():
            if supervisor.stopping:
                return 0
            log.error("the server did not become ready; see the messages above")
            return 1
        devices = ", ".join(supervisor.devices)
        steps = "the workers'" if supervisor.config.scheduler.running_batch == "worker" else "the manager's"
        log.info(
            "ready: serving %s on %s with workers on %s (%s batching, %s steps)",
            ", ".join(config.models), supervisor.address, devices, config.scheduler.policy, steps,
        )
        doors = (("HTTP", config.http), ("gRPC", config.grpc))
        listeners = [f"{name} on {table.address}" for name, table in doors if table is not None]
        also = f" (OIP {', '.join(listeners)})" if listeners else ""
        print(f"batchmaker serving on {supervisor.address}{also} (Ctrl-C to stop)", flush=True)
        return supervisor.watch()
    finally:
        supervisor.stop()
        log.info("stopped")

