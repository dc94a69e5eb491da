"""CPU backend: arenas in shared memory and an executor thread standing in for a device stream.

The "stream" drains a FIFO of issued tasks in order (a multi-step task's steps back to back,
as one task; a lane task's steps with their states carried as tensors: worker.lanes); after each
task it advances an int64 signal counter in shared memory, as a GPU stream writes its pinned
counter, and sends the task's completion notice itself (waking a poller per task would cost as
much as the task). The stream also times its cells' forward calls (KernelClock), which run on it
synchronously: the total goes to the manager in every notice and heartbeat.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.shm import SharedArray
from batchmaker.common.task import LaneTaskMessage, TaskMessage
from batchmaker.worker.backend import ArenaInfo, Backend, arena_ids, warm_up_failure, warm_up_tasks
from batchmaker.worker.batched_task import IssuedTask, KernelClock, PeerArenas, resolve, run_steps, run_task
from batchmaker.worker.lanes import LaneTask, resolve_lanes, run_lanes

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class FailedTask:
    """A task that could not be resolved: it completes in its turn, with its error."""

    task_id: int
    error: str


class CpuBackend(Backend):
    device = "cpu"

    def __init__(
        self, cells: list[nn.Module], specs: list[CellTypeSpec], kinds: list[ValueKind], arena_rows: int, io_rows: int
    ):
        self._cells = cells
        self._specs = specs
        self._ids = arena_ids(kinds)
        self._shared: list[SharedArray] = []
        self._arena_info: list[ArenaInfo] = []
        for kind in kinds:
            for arena_id, space, rows in zip(self._ids[kind], ("device", "io"), (arena_rows, io_rows)):
                shared = SharedArray(kind.dtype, (rows, *kind.shape))
                self._shared.append(shared)
                self._arena_info.append(ArenaInfo(arena_id, kind, space, rows, shared.name))
        self._tensors = [torch.from_numpy(shared.array) for shared in self._shared]
        self._peers: PeerArenas = {}
        self._peer_memory: dict[int, list[SharedArray]] = {}
        self._counter = SharedArray("int64", (1,))
        self._errors: dict[int, str] = {}
        self._kernels = KernelClock()  # the stream's cell calls (warm-up's direct runs are not the stream's)
        self._other_kernels: list[KernelClock] = []  # cells run beside the stream (the running batch's)
        self._advanced = threading.Condition()
        self._report: Callable[[int], None] | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._stream, name="cpu-stream", daemon=True)
        self._thread.start()

    @property
    def arenas(self) -> list[ArenaInfo]:
        return self._arena_info

    @property
    def cells(self) -> tuple[list[CellTypeSpec | None], list[nn.Module | None]]:
        return self._specs, self._cells  # type: ignore[return-value]

    @property
    def signal_name(self) -> str:
        return self._counter.name

    def warm_up(self) -> None:
        with torch.inference_mode():
            for task in warm_up_tasks(self._specs, self._ids):
                try:
                    run_task(*resolve(task, self._tensors, self._cells, self._peers))
                except Exception as exc:
                    raise warm_up_failure(self._specs[task.cell_index], task.batch_size, exc) from exc
        self.time_full_tasks(self._specs, self._ids)

    def attach_peer(self, worker_id: int, arenas: list[dict[str, Any]]) -> str | None:
        self.detach_peer(worker_id)
        mapped: list[SharedArray] = []
        self._peer_memory[worker_id] = mapped
        try:
            for arena in arenas:
                if arena["space"] == "device" and arena.get("shm"):
                    mapped.append(SharedArray(arena["dtype"], (arena["rows"], *arena["shape"]), name=arena["shm"]))
                    self._peers[(worker_id, arena["id"])] = torch.from_numpy(mapped[-1].array)
        except (OSError, ValueError) as exc:  # its shared memory is gone (the peer died) or is not as announced
            self.detach_peer(worker_id)
            log.warning("cannot map the arenas of worker %d (%s); it will not read from it", worker_id, exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    def detach_peer(self, worker_id: int) -> None:
        for key in [key for key in self._peers if key[0] == worker_id]:
            del self._peers[key]
        for shared in self._peer_memory.pop(worker_id, []):
            shared.close()

    def issue(self, task: TaskMessage | LaneTaskMessage) -> None:
        try:  # every step is resolved before any runs: a step that cannot be fails its whole task
            issued: list[IssuedTask] | LaneTask | FailedTask
            if isinstance(task, LaneTaskMessage):
                issued = resolve_lanes(task, self._tensors, self._cells, self._peers, self._specs[task.cell_index].stop)
            else:
                issued = resolve(task, self._tensors, self._cells, self._peers)
        except Exception as exc:  # an unknown arena or peer: the task still takes its turn on the stream, failed
            log.exception("task %d failed", task.task_id)
            issued = FailedTask(task.task_id, f"{type(exc).__name__}: {exc}")
        self._queue.put(issued)

    def signal(self) -> int:
        return int(self._counter.array[0])

    def report_from_stream(self, report: Callable[[int], None]) -> bool:
        # Waking another thread after every task costs about as much as the task itself (the GIL
        # changes hands twice), so the stream thread sends its completion notices itself.
        self._report = report
        return True

    def wait_for_signal(self, seen: int, timeout: float) -> None:
        # The stream is a thread of this process, so the poller can sleep on a condition the
        # stream notifies after each counter update instead of spinning against it for the GIL.
        with self._advanced:
            self._advanced.wait_for(lambda: self._counter.array[0] > seen, timeout)

    def finish(self, task_id: int) -> str | None:
        return self._errors.pop(task_id, None)

    def kernel_busy_us(self) -> int:
        # Read by the poller's heartbeats while the stream adds to it: a float's read and write are each atomic.
        return int((self._kernels.seconds + sum(clock.seconds for clock in self._other_kernels)) * 1e6)

    def kernel_clock(self) -> KernelClock:
        clock = KernelClock()
        self._other_kernels.append(clock)
        return clock

    def read_io(self, arena_id: int, slots: np.ndarray) -> bytes:
        return self._shared[arena_id].array[slots].tobytes()  # arena ids index the arenas in creation order

    def _stream(self) -> None:
        counter = self._counter.array
        with torch.inference_mode():
            while True:
                task = self._queue.get()
                if task is _STOP:
                    return
                if isinstance(task, FailedTask):
                    self._errors[task.task_id] = task.error
                else:
                    self._run(task)
                if self._report is not None:
                    counter[0] += 1
                    self._report(int(counter[0]))
                    continue
                with self._advanced:
                    counter[0] += 1
                    self._advanced.notify()

    def _run(self, task: list[IssuedTask] | LaneTask) -> None:
        """A task's steps back to back; a step that fails ends its task, with that step's error."""
        try:
            if isinstance(task, LaneTask):
                for (_, _, io, io_slots), rows in zip(task.downloads, run_lanes(task, self._kernels)):
                    io.index_copy_(0, io_slots, rows)
            else:
                run_steps(task, self._kernels)
        except Exception as exc:  # a failed task must still advance the counter
            task_id = task.task_id if isinstance(task, LaneTask) else task[0].task_id
            log.exception("task %d failed", task_id)
            self._errors[task_id] = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)
        self._tensors = []
        for worker_id in list(self._peer_memory):
            self.detach_peer(worker_id)
        for shared in [*self._shared, self._counter]:
            shared.close()
