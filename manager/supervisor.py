"""The supervisor: starts the manager and one worker process per device, watches them, stops them all.

Children are told to die with the supervisor (PR_SET_PDEATHSIG on Linux) and also
check their parent themselves, so no process is left behind even if the
supervisor is killed outright. If any child exits unexpectedly the supervisor
stops the others and exits non-zero, so a process manager above it can restart
the service.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import zmq

from common.config import Config
from common.protocol import decode, encode

log = logging.getLogger("batchmaker.supervisor")

STOP_GRACE_S = 5.0
WATCH_INTERVAL_S = 0.2
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
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no usable CUDA runtime: serve on CPU workers
        return 0


class Supervisor:
    def __init__(self, config: Config, address: str | None = None, workers: int | None = None):
        self.config = config
        self.address = address or config.server.address
        self.devices = resolve_devices(config, workers)
        self._private_dir: str | None = None
        if config.server.worker_address == "auto":
            self._private_dir = tempfile.mkdtemp(prefix="batchmaker-")
            os.chmod(self._private_dir, 0o700)
            self.worker_address = f"ipc://{self._private_dir}/workers"
        else:
            self.worker_address = config.server.worker_address
        self.manager: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self._stopping = False

    def _spawn(self, module: str, *args: str) -> subprocess.Popen:
        command = [sys.executable, "-m", module, "--config", str(self.config.path), "--parent-pid", str(os.getpid())]
        # A process group of their own: a terminal's Ctrl-C reaches only the supervisor, which stops them in order.
        return subprocess.Popen([*command, *args], preexec_fn=_die_with_parent, process_group=0)

    def start(self) -> None:
        self.manager = self._spawn(
            "manager",
            "--address",
            self.address,
            "--worker-address",
            self.worker_address,
            "--expected-workers",
            str(len(self.devices)),
        )
        for index, device in enumerate(self.devices):
            self.workers.append(
                self._spawn("worker", "--manager", self.worker_address, "--device", device, "--index", str(index))
            )

    @property
    def children(self) -> list[subprocess.Popen]:
        return [p for p in [self.manager, *self.workers] if p is not None]

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Poll the manager's `health` op until every worker has registered."""
        context = zmq.Context.instance()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopping:
            if self._dead_child() is not None:
                return False
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.address)
            try:
                socket.send(encode({"id": "supervisor", "op": "health"}))
                if socket.poll(500) and decode(socket.recv()).get("status") == "ready":
                    return True
            finally:
                socket.close()
            time.sleep(0.2)
        return False

    def _dead_child(self) -> subprocess.Popen | None:
        return next((p for p in self.children if p.poll() is not None), None)

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    def watch(self) -> int:
        """Block until asked to stop (0) or until a child dies (1)."""
        while not self._stopping:
            dead = self._dead_child()
            if dead is not None:
                role = "manager" if dead is self.manager else f"worker {self.workers.index(dead)}"
                log.error("%s (pid %d) exited with status %s; stopping", role, dead.pid, dead.returncode)
                return 1
            time.sleep(WATCH_INTERVAL_S)
        return 0

    def stop(self) -> None:
        """SIGTERM every child (workers after the manager has stopped), then SIGKILL what remains."""
        processes = []
        for child in self.children:
            try:
                processes.append(psutil.Process(child.pid))
            except psutil.NoSuchProcess:
                pass
        descendants = [d for p in processes for d in _children_of(p)]
        for process in processes:
            _signal(process, signal.SIGTERM)
        _, alive = psutil.wait_procs(processes, timeout=STOP_GRACE_S)
        for process in [*alive, *descendants]:
            _signal(process, signal.SIGKILL)
        psutil.wait_procs([*alive, *descendants], timeout=STOP_GRACE_S)
        for child in self.children:
            child.poll()
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)


def _children_of(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal(process: psutil.Process, signum: int) -> None:
    try:
        process.send_signal(signum)
    except psutil.NoSuchProcess:
        pass


def serve(config: Config, address: str | None, workers: int | None) -> int:
    """Run the server in the foreground until SIGINT/SIGTERM."""
    supervisor = Supervisor(config, address, workers)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    supervisor.start()
    try:
        if not supervisor.wait_ready():
            if supervisor.stopping:
                return 0
            log.error("the server did not become ready; see the messages above")
            return 1
        devices = ", ".join(supervisor.devices)
        log.info("ready: serving %s on %s with workers on %s", ", ".join(config.models), supervisor.address, devices)
        print(f"batchmaker serving on {supervisor.address} (Ctrl-C to stop)", flush=True)
        return supervisor.watch()
    finally:
        supervisor.stop()
        log.info("stopped")

