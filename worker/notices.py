"""Completion notices: the in-progress FIFO of tasks issued to the stream, and the poller thread
that turns the stream's signal counter into notices and heartbeats for the manager."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import zmq

from batchmaker.common.auth import CurveClient, connect_socket
from batchmaker.common.notice import CompletionNotice, IoRows, encode_notice
from batchmaker.worker.backend import Backend, DeviceFault

IDLE_WAIT_S = 0.05
HEARTBEAT_S = 0.5  # the poller reports the signal counter at least this often

IoSlots = list[tuple[int, np.ndarray]]  # (io arena, io slots) of a task's downloads


class FinishedTask(NamedTuple):
    task_id: int
    sent_rows: IoSlots
    busy_us: int  # how long it kept this worker busy


class InProgressFIFO:
    """Tasks issued to the stream and not yet reported complete, in stream order, each with the
    io rows its notice must carry (none on the manager's host) and the time it was received.

    A task keeps the worker busy from its receipt, or from the end of the task before it if that came
    later (the stream runs its tasks one after another), to its own end: resolving it counts, waiting
    idle for it does not. Tasks found finished together (a device's poller coalesces them) share the
    span evenly; on the CPU each task's end is taken as it finishes."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._tasks: collections.deque[tuple[int, IoSlots, float]] = collections.deque()
        self._issued = threading.Event()
        self._last_end = 0.0

    def push(self, task_id: int, sent_rows: IoSlots) -> None:
        self._tasks.append((task_id, sent_rows, self._clock()))
        self._issued.set()

    def pop_finished(self, count: int) -> list[FinishedTask]:
        """The next `count` tasks, which the stream has just finished."""
        popped = [self._tasks.popleft() for _ in range(count)]
        end = self._clock()
        began = max(self._last_end, popped[0][2])
        self._last_end = end
        busy_us = round(max(0.0, end - began) * 1e6 / count)
        return [FinishedTask(task_id, sent_rows, busy_us) for task_id, sent_rows, _ in popped]

    def __len__(self) -> int:
        return len(self._tasks)

    def wait_for_work(self, timeout: float) -> None:
        self._issued.clear()
        if not self._tasks:
            self._issued.wait(timeout)


class Poller(threading.Thread):
    """Turns signal-counter increments into completion notices for the manager.

    Every message carries the counter, and one is sent at least every HEARTBEAT_S, so the
    manager sees both that this process is alive and whether its stream makes progress.
    Where the stream is a thread of this process (CPU), the stream sends the completion
    notices itself and this thread only sends heartbeats.
    """

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        worker_id: int,
        key: bytes,
        backend: Backend,
        fifo: InProgressFIFO,
        curve: CurveClient | None,
    ):
        super().__init__(name="poller", daemon=True)
        self._context = context
        self._address = address
        self._curve = curve
        self._socket = self._connect()
        self._stream_socket: zmq.Socket | None = None  # created on the stream thread, used only there
        self._worker_id = worker_id
        self._key = key  # given at registration: proves to the manager that the notices are ours
        self._backend = backend
        self._fifo = fifo
        self.stopping = threading.Event()
        self.fault: DeviceFault | None = None  # the device failed: the worker must exit

    def _connect(self) -> zmq.Socket:
        return connect_socket(self._context, zmq.PUSH, self._address, self._curve, linger_ms=1000)

    def run(self) -> None:
        if self._backend.report_from_stream(self._report_completion):
            self._heartbeats()
        else:
            try:
                self._watch_signal()
            except DeviceFault as exc:
                self.fault = exc
        self._socket.close()

    def _report_completion(self, finished: int) -> None:
        """Called on the stream thread after each task (CPU): one notice per task, on its own socket."""
        if self._stream_socket is None:
            self._stream_socket = self._connect()
        self._stream_socket.send(self._notice(1, finished))

    def _notice(self, count: int, signal: int) -> bytes:
        """The completion notice for the next `count` tasks of the in-progress FIFO."""
        finished = self._fifo.pop_finished(count)
        errors, rows = {}, []
        for task_id, sent_rows, _ in finished:
            error = self._backend.finish(task_id)
            if error is not None:
                errors[task_id] = error
            else:
                rows += [IoRows(arena, slots, self._backend.read_io(arena, slots)) for arena, slots in sent_rows]
        task_ids, busy_us = [task.task_id for task in finished], [task.busy_us for task in finished]
        kernels = self._backend.kernel_busy_us()
        notice = CompletionNotice(self._worker_id, task_ids, errors, signal, rows, self._key, busy_us, kernels)
        return encode_notice(notice)

    def _heartbeat(self, signal: int) -> bytes:
        kernels = self._backend.kernel_busy_us()
        return encode_notice(CompletionNotice(self._worker_id, [], {}, signal, key=self._key, kernel_busy_us=kernels))

    def close_stream_socket(self) -> None:
        if self._stream_socket is not None:
            self._stream_socket.close()

    def _heartbeats(self) -> None:
        while not self.stopping.wait(HEARTBEAT_S):
            self._socket.send(self._heartbeat(self._backend.signal()))

    def _watch_signal(self) -> None:
        done = self._backend.signal()  # warm-up ran tasks through the stream, none of them in the FIFO
        last_sent = 0.0
        while not self.stopping.is_set():
            finished = self._backend.signal()
            if finished > done:
                self._socket.send(self._notice(finished - done, finished))
                done = finished
                last_sent = time.monotonic()
                continue
            if time.monotonic() - last_sent >= HEARTBEAT_S:
                self._socket.send(self._heartbeat(done))
                last_sent = time.monotonic()
            if not self._fifo:
                self._fifo.wait_for_work(IDLE_WAIT_S)
            else:
                self._backend.wait_for_signal(done, IDLE_WAIT_S)
