"""CUDA backend: one stream per worker, device arenas, page-locked io arenas and counter, peers through CUDA IPC.

Every kernel of a task is enqueued on the worker's stream without waiting; the stream
copies the task's downloads straight into the io arenas (shared memory registered as
page-locked) and then its sequence number into a pinned host counter, so the poller
learns of completion by reading host memory, with no synchronize and no host callback
on the stream. The tensor work itself is in worker/device_tasks.py, and every call to
the CUDA runtime goes through worker/cuda_runtime.py. Only imported when a worker is
started on a GPU.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch import nn

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.server_config import CROSS_GPU_READS
from batchmaker.common.shm import SharedArray
from batchmaker.common.task import LaneTaskMessage, TaskMessage
from batchmaker.worker.backend import TORCH_DTYPES, ArenaInfo, Backend, arena_ids
from batchmaker.worker.cuda_graphs import capture_on
from batchmaker.worker.cuda_runtime import CudaRuntime
from batchmaker.worker.device_tasks import DeviceCalls, DeviceTasks, Staging, device_faults
from batchmaker.worker.staging_ring import StagingRing

log = logging.getLogger(__name__)

FIRST_POLL_S = 0.00002  # the poller's first sleep after the counter did not move; it doubles from there
MAX_POLL_S = 0.0005
WARM_UP_TIMEOUT_S = 300.0  # the first run of every cell compiles and loads kernels
CLOSE_TIMEOUT_S = 5.0
STAGING_RING_BYTES = 4 << 20  # tasks in flight stage from here; a task that does not fit allocates its own


class PeerUnreadable(RuntimeError):
    """A peer's arenas cannot be read from this worker (its GPU is not visible here, or has no peer access)."""


class StreamCalls(DeviceCalls):
    """The device calls of `DeviceTasks` on a GPU: its stream, pinned staging, the pinned counter."""

    def __init__(self, device: torch.device, runtime: CudaRuntime | None = None):
        self.device = device
        self.runtime = runtime or CudaRuntime()
        self.stream = self.runtime.stream(device)
        self._peer_streams: dict[torch.device, Any] = {}
        self._counter, counter = self.runtime.pinned(8)  # the tensor is kept: the view does not own the memory
        self.counter = counter.view(np.int64)  # read by the poller without a torch call
        self.counter[0] = 0
        self._sequence = torch.zeros(1, dtype=torch.int64, device=device)
        self.issued = 0
        with torch.inference_mode():  # as the tasks that view it run
            ring = torch.empty(STAGING_RING_BYTES, dtype=torch.uint8, device=device)
        self._ring = StagingRing(*self.runtime.pinned(STAGING_RING_BYTES), ring)

    def on_stream(self) -> AbstractContextManager:
        return self.runtime.use(self.stream)

    def on_peer_stream(self, device: torch.device) -> AbstractContextManager:
        if device not in self._peer_streams:
            self._peer_streams[device] = self.runtime.stream(device)
        return self.runtime.use(self._peer_streams[device])

    def staging(self, nbytes: int) -> Staging:
        """A region of the staging ring for the task about to be issued (its counter value is the next), or,
        when the ring's free space cannot hold it, buffers of its own from torch's caching allocators."""
        region = self._ring.take(nbytes, self.issued + 1, int(self.counter[0]))
        if region is None:
            start, (host, array) = 0, self.runtime.pinned(nbytes)
            device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            host, (start, array, device) = self._ring.pinned, region
        return Staging(array, device, lambda: self.runtime.upload(device, host, start))

    def signal(self) -> None:
        self.issued += 1
        self.runtime.write_counter(self.counter, self._sequence, self.issued)

    def download(self, host: np.ndarray, rows: torch.Tensor) -> None:
        self.runtime.download(host, rows)

    def wait(self, timeout: float) -> bool:
        """Whether everything enqueued so far finished within `timeout` seconds; never blocks longer."""
        done = self.runtime.event()
        done.record(self.stream)
        deadline = time.monotonic() + timeout
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


class CudaBackend(Backend):
    def __init__(
        self,
        device: str,
        cells: list[nn.Module],
        specs: list[CellTypeSpec],
        kinds: list[ValueKind],
        arena_rows: int,
        io_rows: int,
        cuda_graphs: bool = False,
        cross_gpu_reads: str = "always",
        runtime: CudaRuntime | None = None,
    ):
        if cross_gpu_reads not in CROSS_GPU_READS:
            raise ValueError(f"cross_gpu_reads must be one of {CROSS_GPU_READS}, not {cross_gpu_reads!r}")
        self.device = device
        self._cuda_graphs = cuda_graphs
        self._cross_gpu_reads = cross_gpu_reads
        self._dev = torch.device(device)
        self._runtime = runtime or CudaRuntime()
        self._runtime.prepare(self._dev)
        self._calls = StreamCalls(self._dev, self._runtime)
        # Peers name their GPU by UUID: its index depends on each process's CUDA_VISIBLE_DEVICES.
        self._gpus = {self._runtime.uuid(index): index for index in range(self._runtime.device_count())}
        own = self._runtime.uuid(self._dev.index)
        ids = arena_ids(kinds)
        self._specs, self._ids = specs, ids
        self._arena_info: list[ArenaInfo] = []
        self._shared: list[SharedArray] = []
        arenas: dict[int, torch.Tensor] = {}
        io: dict[int, np.ndarray] = {}
        with self._calls.on_stream():  # zeroed on the stream that first reads them
            for kind in kinds:
                device_id, io_id = ids[kind]
                arena = torch.zeros((arena_rows, *kind.shape), dtype=TORCH_DTYPES[kind.dtype], device=self._dev)
                arenas[device_id] = arena
                handle = [own, *self._runtime.export(arena)]
                self._arena_info.append(ArenaInfo(device_id, kind, "device", arena_rows, None, handle))
                shared = SharedArray(kind.dtype, (io_rows, *kind.shape))
                self._runtime.pin(shared.array)
                self._shared.append(shared)
                io[io_id] = shared.array
                self._arena_info.append(ArenaInfo(io_id, kind, "io", io_rows, shared.name))
            moved = [cell.to(self._dev) for cell in cells]
        # The weights and the tables folded from them were made on the default stream (worker.main.load_cells),
        # which the worker's stream does not wait for: wait for the device once, before anything reads them.
        self._runtime.synchronize(self._dev)
        self._tasks = DeviceTasks(self._calls, moved, specs, ids, arenas, io)
        self._retired: list[tuple[Any, list[torch.Tensor]]] = []

    @property
    def arenas(self) -> list[ArenaInfo]:
        return self._arena_info

    @property
    def cells(self) -> tuple[list[CellTypeSpec | None], list[nn.Module | None]]:
        return self._tasks.cells

    def _place(self, cells: list[nn.Module]) -> list[nn.Module]:
        """Modules loaded at run time go to the device, which is waited for as after start-up; they run eagerly,
        uncaptured (`cuda_graphs` captures the cells a worker starts with)."""
        with self._calls.on_stream():
            moved = [cell.to(self._dev) for cell in cells]
        self._runtime.synchronize(self._dev)
        return moved

    def drop_cells(self, indices: list[int]) -> None:
        super().drop_cells(indices)
        self._tasks.forget_graphs(indices)

    @property
    def signal_name(self) -> None:
        return None  # the counter is pinned memory private to this process

    def warm_up(self) -> None:
        self._tasks.warm_up(capture_on(self._calls.stream) if self._cuda_graphs else None)
        if not self._calls.wait(WARM_UP_TIMEOUT_S):
            raise RuntimeError(f"warm-up on {self.device} did not finish within {WARM_UP_TIMEOUT_S:.0f} s")
        self.time_full_tasks(self._specs, self._ids)

    def attach_peer(self, worker_id: int, arenas: list[dict[str, Any]]) -> str | None:
        """Open a peer's device arenas; a peer that cannot be opened (it has died, its GPU is not visible
        here or has no peer access) is logged and not read from: the manager, told why, places no request
        with values there on this worker, and a task that needs them anyway fails alone."""
        self.detach_peer(worker_id)
        try:
            opened = {
                (worker_id, arena["id"]): self._open(arena)
                for arena in arenas
                if arena["space"] == "device" and arena.get("handle")
            }
        except Exception as exc:  # torch raises AcceleratorError for a failed cudaIpcOpenMemHandle
            reason = f"{type(exc).__name__}: {exc}"
            log.warning(
                "%s cannot read the arenas of worker %d (%s); it will not read from it", self.device, worker_id, reason
            )
            self._tasks.unreadable[worker_id] = reason
            return reason
        self._tasks.peers.update(opened)
        return None

    def _open(self, arena: dict[str, Any]) -> torch.Tensor:
        uuid, *ipc = arena["handle"]
        index = self._gpus.get(uuid)
        if index is None:
            raise PeerUnreadable(f"its GPU {uuid} is not visible to this process")
        mapped_on = self._mapping_device(index)
        return self._runtime.open(ipc, mapped_on.index, TORCH_DTYPES[arena["dtype"]], (arena["rows"], *arena["shape"]))

    def _mapping_device(self, exporter: int) -> torch.device:
        """Map a peer's arena into this worker's own context where the GPUs allow peer access: it is then
        read by this stream's kernels, and no context is created on the peer's GPU. Without peer access it
        is mapped on the peer's GPU (a CUDA context there, hundreds of MB) and read through staged copies
        (`DeviceTasks._local`), unless server.cross_gpu_reads refuses it."""
        own = self._dev.index
        if exporter == own:
            return self._dev
        if self._cross_gpu_reads == "never":
            raise PeerUnreadable("reads from other GPUs are off (server.cross_gpu_reads)")
        if self._runtime.can_access_peer(own, exporter):
            return self._dev
        if self._cross_gpu_reads == "always":
            log.warning(
                "GPU %d has no peer access from GPU %d: reading its arenas costs a CUDA context there and staged "
                "copies (server.cross_gpu_reads = \"peer-access\" refuses it)", exporter, own,
            )  # fmt: skip
            return torch.device("cuda", exporter)
        raise PeerUnreadable(f"GPU {exporter} has no peer access from GPU {own} (server.cross_gpu_reads)")

    def detach_peer(self, worker_id: int) -> None:
        self._tasks.unreadable.pop(worker_id, None)
        gone = [self._tasks.peers.pop(key) for key in [key for key in self._tasks.peers if key[0] == worker_id]]
        if gone:  # issued reads of these arenas may still be queued: unmap them only after the stream passes here
            event = self._runtime.event()
            event.record(self._calls.stream)
            self._retired.append((event, gone))
        self._unmap_retired()

    def _unmap_retired(self) -> None:
        """Drop the mappings of detached peers whose last reads the stream has passed."""
        self._retired = [(event, tensors) for event, tensors in self._retired if not event.query()]

    def issue(self, task: TaskMessage | LaneTaskMessage) -> None:
        if self._retired:
            self._unmap_retired()
        self._tasks.issue(task)

    def signal(self) -> int:
        return int(self._calls.counter[0])

    def wait_for_signal(self, seen: int, timeout: float) -> None:
        """Sleep until the pinned counter passes `seen`, reading it through numpy: a torch call would hand the
        GIL to the issuer and back at every poll. Each sleep is one hand-off, and sleeps double up to
        MAX_POLL_S. On timeout, ask the stream, so that a device fault is raised (`DeviceFault`) even when no
        task comes to raise it."""
        counter = self._calls.counter
        deadline = time.monotonic() + timeout
        pause = FIRST_POLL_S
        while counter[0] <= seen:
            left = deadline - time.monotonic()
            if left <= 0:
                with device_faults(self._dev):
                    self._calls.stream.query()
                return
            time.sleep(min(pause, left))
            pause = min(2 * pause, MAX_POLL_S)

    def finish(self, task_id: int) -> str | None:
        return self._tasks.finish(task_id)

    def read_io(self, arena_id: int, slots: np.ndarray) -> bytes:
        return self._tasks.read_io(arena_id, slots)

    def close(self) -> None:
        """Unpin and unmap the io arenas once the stream has finished. A stream that has not (stuck, or
        failed) may still copy into them: they stay pinned and mapped until the process exits, and only
        their names go, so that no copy lands in memory handed back."""
        try:
            finished = self._calls.wait(CLOSE_TIMEOUT_S)
            if not finished:
                log.warning(
                    "the stream of %s did not finish in %.0f s; its io arenas stay mapped", self.device, CLOSE_TIMEOUT_S
                )
        except RuntimeError as exc:  # a device fault surfaces at the first query after it
            log.error("the stream of %s failed: %s", self.device, exc)
            finished = False
        for shared in self._shared:
            if finished:
                self._runtime.unpin(shared.array)
                shared.close()
            else:
                shared.unlink()
