"""CUDA backend: one stream per worker, device arenas, page-locked io arenas, pinned signal counter.

Every kernel of a task is enqueued on the worker's stream without waiting; the
stream then copies the task's sequence number into a pinned host counter, so the
poller learns of completion by reading host memory, with no synchronize and no
host callback on the stream. Only imported when a worker is started on a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from common.graph import CellTypeSpec, ValueKind
from common.shm import SharedArray
from common.task import TaskMessage
from worker.backend import ArenaInfo, Backend, arena_ids
from worker.cpu import IssuedTask, PeerArenas, inline_rows, run_task, warm_up_cells

SPIN_ROUNDS = 50  # polls without sleeping before backing off
MAX_BACKOFF_S = 0.0005

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}


class CudaBackend(Backend):
    def __init__(
        self,
        device: str,
        cells: list[nn.Module],
        specs: list[CellTypeSpec],
        kinds: list[ValueKind],
        arena_rows: int,
        io_rows: int,
    ):
        self.device = device
        self._dev = torch.device(device)
        torch.cuda.set_device(self._dev)
        self._stream = torch.cuda.Stream(self._dev)
        self._cells = [cell.to(self._dev) for cell in cells]
        self._specs = specs
        self._ids = arena_ids(kinds)
        self._arena_info: list[ArenaInfo] = []
        self._shared: list[SharedArray] = []
        self._tensors: list[torch.Tensor] = [torch.empty(0)] * (2 * len(kinds))
        for kind in kinds:
            device_id, io_id = self._ids[kind]
            arena = torch.zeros((arena_rows, *kind.shape), dtype=_TORCH_DTYPES[kind.dtype], device=self._dev)
            self._tensors[device_id] = arena
            self._arena_info.append(ArenaInfo(device_id, kind, "device", arena_rows, None, export_ipc_handle(arena)))
            shared = SharedArray(kind.dtype, (io_rows, *kind.shape))
            io = torch.from_numpy(shared.array)
            _page_lock(io)
            self._shared.append(shared)
            self._tensors[io_id] = io
            self._arena_info.append(ArenaInfo(io_id, kind, "io", io_rows, shared.name))
        self._counter = torch.zeros(1, dtype=torch.int64).pin_memory()
        self._sequence = torch.zeros(1, dtype=torch.int64, device=self._dev)
        self._issued = 0
        self._staged: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._peers: PeerArenas = {}

    @property
    def arenas(self) -> list[ArenaInfo]:
        return self._arena_info

    @property
    def signal_name(self) -> None:
        return None  # the counter is pinned memory private to this process

    def warm_up(self) -> None:
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            warm_up_cells(self._cells, self._specs, self._tensors, self._ids)
        self._stream.synchronize()

    def attach_peer(self, worker_id: int, arenas: list[dict[str, Any]]) -> None:
        for arena in arenas:
            if arena["space"] == "device" and arena.get("handle"):
                shape = (arena["rows"], *arena["shape"])
                self._peers[(worker_id, arena["id"])] = open_ipc_handle(arena["handle"], _TORCH_DTYPES[arena["dtype"]], shape)

    def detach_peer(self, worker_id: int) -> None:
        for key in [key for key in self._peers if key[0] == worker_id]:
            del self._peers[key]

    def _remote(self, rows) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Peer arenas are read on their own device (their tasks have completed), then copied here."""
        remote = []
        for worker_id, arena_id, slots, positions in rows or ():
            peer = self._peers[(worker_id, arena_id)]
            remote.append((peer, torch.from_numpy(slots.copy()).to(peer.device), self._device_index(positions)))
        return remote

    def _device_index(self, slots) -> torch.Tensor:
        return torch.from_numpy(slots.copy()).pin_memory().to(self._dev, non_blocking=True)

    def issue(self, task: TaskMessage) -> None:
        tensors, index = self._tensors, self._device_index
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            run_task(
                IssuedTask(
                    task.task_id,
                    self._cells[task.cell_index],
                    [
                        (
                            tensors[a],
                            index(s),
                            None if g is None else index(g),
                            self._remote(r),
                            None if v is None else (index(v[0]), inline_rows(v[1], tensors[a]).pin_memory()),
                        )
                        for a, s, g, r, v in task.inputs
                    ],
                    [(tensors[a], index(s)) for a, s in task.outputs],
                    [],
                )
            )
            staged = []
            for a, s, b, t in task.downloads:
                rows = tensors[a].index_select(0, index(s))
                host = torch.empty(rows.shape, dtype=rows.dtype).pin_memory()
                host.copy_(rows, non_blocking=True)
                staged.append((host, tensors[b], torch.from_numpy(t.copy())))
            self._staged[task.task_id] = staged
            self._issued += 1
            self._sequence.fill_(self._issued)
            self._counter.copy_(self._sequence, non_blocking=True)

    def signal(self) -> int:
        return int(self._counter[0])

    def wait_for_signal(self, seen: int, timeout: float) -> None:
        """Spin briefly on the pinned counter, then back off: the device gives no wake-up without a callback."""
        deadline = time.monotonic() + timeout
        spins = 0
        while int(self._counter[0]) <= seen and time.monotonic() < deadline:
            spins += 1
            time.sleep(0 if spins < SPIN_ROUNDS else min(MAX_BACKOFF_S, 1e-5 * (spins - SPIN_ROUNDS + 1)))

    def finish(self, task_id: int) -> str | None:
        for host, io, slots in self._staged.pop(task_id, []):
            io.index_copy_(0, slots, host)
        return None

    def stall(self) -> None:
        with torch.cuda.stream(self._stream):
            torch.cuda._sleep(2**62)

    def close(self) -> None:
        self._stream.synchronize()
        for shared in self._shared:
            shared.close()


def export_ipc_handle(tensor: torch.Tensor) -> list[Any]:
    """The CUDA IPC handle of a tensor's storage, as plain values another process can open.

    The same handle torch.multiprocessing sends when a CUDA tensor is shared (opened once per peer).
    """
    return list(tensor.untyped_storage()._share_cuda_())


def open_ipc_handle(handle: list[Any], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(*handle)
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, shape)


def _page_lock(tensor: torch.Tensor) -> None:
    """Page-lock memory we did not allocate (the shared io arena) so device copies are asynchronous."""
    result = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(result)}")
