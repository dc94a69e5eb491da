"""CUDA backend: one stream per worker, device arenas, a pinned signal counter, peers through CUDA IPC.

Every kernel of a task is enqueued on the worker's stream without waiting; the
stream then copies the task's sequence number into a pinned host counter, so the
poller learns of completion by reading host memory, with no synchronize and no
host callback on the stream. The tensor work itself is in worker/device_tasks.py;
this module holds only what needs a real device. Only imported when a worker is
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

from common.graph import CellTypeSpec, ValueKind
from common.shm import SharedArray
from common.task import TaskMessage
from worker.backend import TORCH_DTYPES, ArenaInfo, Backend, arena_ids
from worker.cuda_graphs import capture_on
from worker.device_tasks import DeviceCalls, DeviceTasks, Staging

log = logging.getLogger(__name__)

SPIN_ROUNDS = 50  # polls without sleeping before backing off
MAX_BACKOFF_S = 0.0005
WARM_UP_TIMEOUT_S = 300.0  # the first run of every cell compiles and loads kernels
CLOSE_TIMEOUT_S = 5.0


class StreamCalls(DeviceCalls):
    """The device calls of `DeviceTasks` on a real GPU: its stream, pinned staging, the pinned counter."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._peer_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.counter = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._sequence = torch.zeros(1, dtype=torch.int64, device=device)
        self.issued = 0

    def on_stream(self) -> AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def on_peer_stream(self, device: torch.device) -> AbstractContextManager:
        if device not in self._peer_streams:
            self._peer_streams[device] = torch.cuda.Stream(device)
        return torch.cuda.stream(self._peer_streams[device])

    def staging(self, nbytes: int) -> Staging:
        # From torch's caching host allocator: a block is reused only after the copies that read it are done.
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return Staging(host.numpy(), device, lambda: device.copy_(host, non_blocking=True))

    def signal(self) -> None:
        self.issued += 1
        self._sequence.fill_(self.issued)
        self.counter.copy_(self._sequence, non_blocking=True)

    def deliver(self, rows: torch.Tensor, io: np.ndarray, slots: np.ndarray) -> None:
        io[slots] = rows.numpy()

    def wait(self, timeout: float) -> bool:
        """Whether everything enqueued so far finished within `timeout` seconds; never blocks longer."""
        done = torch.cuda.Event()
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
    ):
        self.device = device
        self._cuda_graphs = cuda_graphs
        self._dev = torch.device(device)
        torch.cuda.init()
        torch.cuda.set_device(self._dev)
        self._calls = StreamCalls(self._dev)
        ids = arena_ids(kinds)
        self._arena_info: list[ArenaInfo] = []
        self._shared: list[SharedArray] = []
        arenas: dict[int, torch.Tensor] = {}
        io: dict[int, np.ndarray] = {}
        with self._calls.on_stream():  # zeroed on the stream that first reads them
            for kind in kinds:
                device_id, io_id = ids[kind]
                arena = torch.zeros((arena_rows, *kind.shape), dtype=TORCH_DTYPES[kind.dtype], device=self._dev)
                arenas[device_id] = arena
                handle = export_ipc_handle(arena)
                self._arena_info.append(ArenaInfo(device_id, kind, "device", arena_rows, None, handle))
                shared = SharedArray(kind.dtype, (io_rows, *kind.shape))
                self._shared.append(shared)
                io[io_id] = shared.array
                self._arena_info.append(ArenaInfo(io_id, kind, "io", io_rows, shared.name))
            moved = [cell.to(self._dev) for cell in cells]
        self._tasks = DeviceTasks(self._calls, moved, specs, ids, arenas, io)
        self._retired: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []

    @property
    def arenas(self) -> list[ArenaInfo]:
        return self._arena_info

    @property
    def signal_name(self) -> None:
        return None  # the counter is pinned memory private to this process

    def warm_up(self) -> None:
        self._tasks.warm_up(capture_on(self._calls.stream) if self._cuda_graphs else None)
        if not self._calls.wait(WARM_UP_TIMEOUT_S):
            raise RuntimeError(f"warm-up on {self.device} did not finish within {WARM_UP_TIMEOUT_S:.0f} s")

    def attach_peer(self, worker_id: int, arenas: list[dict[str, Any]]) -> None:
        self.detach_peer(worker_id)
        for arena in arenas:
            if arena["space"] == "device" and arena.get("handle"):
                handle = arena["handle"]
                shape = (arena["rows"], *arena["shape"])
                mapped_on = self._mapping_device(handle[0])
                stream = self._calls.on_stream() if mapped_on == self._dev else self._calls.on_peer_stream(mapped_on)
                with stream:  # the producer's sharing event is waited for on the stream that reads the arena
                    tensor = open_ipc_handle(handle, TORCH_DTYPES[arena["dtype"]], shape, mapped_on.index)
                self._tasks.peers[(worker_id, arena["id"])] = tensor

    def _mapping_device(self, exporter: int) -> torch.device:
        """Map a peer's arena into this worker's own context where the GPUs allow peer access: it is then
        read by this stream's kernels, and no context is created on the peer's GPU. Otherwise it is
        mapped on the peer's GPU and read there, then copied over (`DeviceTasks._local`)."""
        own = self._dev.index
        if exporter == own or torch.cuda.can_device_access_peer(own, exporter):
            return self._dev
        return torch.device("cuda", exporter)

    def detach_peer(self, worker_id: int) -> None:
        gone = [self._tasks.peers.pop(key) for key in [key for key in self._tasks.peers if key[0] == worker_id]]
        if gone:  # issued reads of these arenas may still be queued: unmap them only after the stream passes here
            event = torch.cuda.Event()
            event.record(self._calls.stream)
            self._retired.append((event, gone))
        self._retired = [(event, tensors) for event, tensors in self._retired if not event.query()]

    def issue(self, task: TaskMessage) -> None:
        self._tasks.issue(task)

    def signal(self) -> int:
        return int(self._calls.counter[0])

    def wait_for_signal(self, seen: int, timeout: float) -> None:
        """Spin briefly on the pinned counter, then back off: the device gives no wake-up without a callback."""
        deadline = time.monotonic() + timeout
        spins = 0
        counter = self._calls.counter
        while int(counter[0]) <= seen and time.monotonic() < deadline:
            spins += 1
            time.sleep(0 if spins < SPIN_ROUNDS else min(MAX_BACKOFF_S, 1e-5 * (spins - SPIN_ROUNDS + 1)))

    def finish(self, task_id: int) -> str | None:
        return self._tasks.finish(task_id)

    def read_io(self, arena_id: int, slots: np.ndarray) -> bytes:
        return self._tasks.read_io(arena_id, slots)

    def stall(self) -> None:
        with self._calls.on_stream():
            torch.cuda._sleep(2**62)

    def close(self) -> None:
        try:
            if not self._calls.wait(CLOSE_TIMEOUT_S):
                log.warning("the stream of %s did not finish in %.0f s; closing anyway", self.device, CLOSE_TIMEOUT_S)
        except RuntimeError as exc:  # a device fault surfaces at the first query after it
            log.error("the stream of %s failed: %s", self.device, exc)
        for shared in self._shared:
            shared.close()


def export_ipc_handle(tensor: torch.Tensor) -> list[Any]:
    """The CUDA IPC handle of a tensor's storage, as plain values another process can open.

    The same handle torch.multiprocessing sends when a CUDA tensor is shared (opened once per peer).
    """
    return list(tensor.untyped_storage()._share_cuda_())


def open_ipc_handle(
    handle: list[Any], dtype: torch.dtype, shape: tuple[int, ...], device: int | None = None
) -> torch.Tensor:
    """Map another process's arena. `device` is the GPU whose context maps it (default: the exporter's).

    torch maps the memory in the context of the device it is given, with lazy peer access, and
    labels the storage with that device: mapped on the reader's own GPU, the arena is read by its
    kernels directly, and no context is created on the exporter's GPU.
    """
    torch.cuda.init()  # a fresh process has no CUDA state yet; torch's own rebuild path does the same
    exporter, *rest = handle
    storage = torch.UntypedStorage._new_shared_cuda(exporter if device is None else device, *rest)
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, shape)
