"""The GPU backend's tensor work, kept apart from its streams, events, IPC and pinned memory.

Everything here creates tensors on the backend's device and enqueues operations on them,
and reaches the device itself only through `DeviceCalls`. The CUDA backend implements
those calls with a stream, pinned memory and a counter; tests implement them with torch's
fake tensors, so this code runs on a machine without a GPU with every arena on "cuda",
where any tensor left on the host (an index, an inline value, a peer's rows) raises a
device mismatch, as it would on a GPU.

Per task on the device's stream: one host-to-device copy of all the task's slot lists and
inline values (packed into one buffer), the gathers, the cell, the scatters, one
device-to-host copy per download, and the counter write.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch import nn

from common.graph import CellTypeSpec, ValueKind
from common.task import InlineValues, RemoteRows, TaskMessage
from worker.backend import warm_up_tasks
from worker.batched_task import Inline, InputRows, IssuedTask, PeerArenas, RemoteInput, run_task
from worker.cuda_graphs import Capture, CapturedCell, capture_cells

log = logging.getLogger(__name__)

ALIGN = 8  # bytes: every staged array starts where a view of any arena dtype may begin

# Rows bound for the host: (pinned host rows, the io arena the manager maps, the io slots to write).
Download = tuple[torch.Tensor, np.ndarray, np.ndarray]


class Staging:
    """A task's host arrays packed into one buffer, so that the device receives them in one copy.

    `put` hands out device views at once; their contents arrive when `send` enqueues the copy,
    which comes before any operation that reads them on the stream.
    """

    def __init__(self, host: np.ndarray, device: torch.Tensor, send: Callable[[], Any]):
        self._host = host
        self._device = device
        self._used = 0
        self.send = send

    def put(self, data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...] = (-1,)) -> torch.Tensor:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        start, end = self._used, self._used + raw.size
        if end > self._host.size:
            raise RuntimeError(f"staging buffer of {self._host.size} bytes is too small for this task")
        self._host[start:end] = raw
        self._used = _aligned(end)
        return self._device.narrow(0, start, raw.size).view(dtype).view(shape)


class DeviceCalls(ABC):
    """What the tensor work needs from the device beyond tensor operations."""

    device: torch.device

    @abstractmethod
    def on_stream(self) -> AbstractContextManager:
        """Make the worker's stream current: everything enqueued inside runs in its order."""

    @abstractmethod
    def on_peer_stream(self, device: torch.device) -> AbstractContextManager:
        """Make this worker's stream on another device current (reads of a peer without peer access)."""

    @abstractmethod
    def staging(self, nbytes: int) -> Staging:
        """A host buffer of `nbytes` and the device buffer it will be copied to."""

    @abstractmethod
    def signal(self) -> None:
        """Enqueue the write that tells the host this task (and every one before it) is done."""

    @abstractmethod
    def deliver(self, rows: torch.Tensor, io: np.ndarray, slots: np.ndarray) -> None:
        """Write downloaded rows, now complete on the host, into the io arena."""


class DeviceTasks:
    """Turns task messages into work on one device, reporting a failing task instead of dying of it."""

    def __init__(
        self,
        calls: DeviceCalls,
        cells: list[nn.Module],
        specs: list[CellTypeSpec],
        ids: dict[ValueKind, tuple[int, int]],
        arenas: dict[int, torch.Tensor],
        io: dict[int, np.ndarray],
    ):
        self._calls = calls
        self._cells = cells
        self._specs = specs
        self._ids = ids
        self._arenas = arenas  # device arenas by id
        self._io = io  # io arenas by id, in host memory the manager maps
        self.peers: PeerArenas = {}
        self._downloads: dict[int, list[Download]] = {}
        self._errors: dict[int, str] = {}
        self.graphs: dict[tuple[int, int], CapturedCell] = {}  # by (cell index, batch size)

    def warm_up(self, capture: Capture | None = None) -> None:
        """Run every (cell type, batch size) once; a failure here is a start-up failure and propagates.

        With `capture`, then capture every capturable (cell type, batch size) and run each
        warm-up task again, through its graph, so that serving replays what was already run.
        """
        with self._calls.on_stream(), torch.inference_mode():
            tasks = list(warm_up_tasks(self._specs, self._ids))
            for task in tasks:
                self._run(task)
            if capture is not None:
                self.graphs = capture_cells(self._cells, self._specs, self._calls.device, capture)
                for task in tasks:
                    self._run(task)

    def issue(self, task: TaskMessage) -> None:
        """Enqueue the task and then its signal: a task that cannot be issued still completes, with its error."""
        with self._calls.on_stream(), torch.inference_mode():
            try:
                self._downloads[task.task_id] = self._run(task)
            except Exception as exc:  # shape errors, bad slots, out of memory: this task fails, the worker lives
                log.exception("task %d failed", task.task_id)
                self._errors[task.task_id] = f"{type(exc).__name__}: {exc}"
            self._calls.signal()

    def finish(self, task_id: int) -> str | None:
        """After the task's signal: hand its downloads to the io arenas; return its error, if it failed."""
        for rows, io, slots in self._downloads.pop(task_id, ()):
            self._calls.deliver(rows, io, slots)
        return self._errors.pop(task_id, None)

    def read_io(self, arena_id: int, slots: np.ndarray) -> bytes:
        """Rows of an io arena, after `finish` has delivered a task's downloads there."""
        return self._io_arena(arena_id)[slots].tobytes()

    def _run(self, task: TaskMessage) -> list[Download]:
        staging = self._calls.staging(staged_bytes(task))
        inputs = [self._input(staging, task.batch_size, *entry) for entry in task.inputs]
        outputs = [
            (self._arena(a), self._slots(staging, s, self._arena(a).shape[0], "output")) for a, s in task.outputs
        ]
        sources = [
            (self._arena(a), self._slots(staging, s, self._arena(a).shape[0], "download"), self._io_arena(b), t)
            for a, s, b, t in task.downloads
        ]
        staging.send()
        inputs = [entry._replace(remote=self._local(entry.remote)) for entry in inputs]
        issued = IssuedTask(task.task_id, self._cells[task.cell_index], inputs, outputs, [])
        graph = self.graphs.get((task.cell_index, task.batch_size))
        if graph is None:
            run_task(issued)
        else:
            graph.run(issued)
        downloads = []
        for arena, slots, io, io_slots in sources:
            _check(io_slots, io.shape[0], "io slot")
            # A non-blocking copy to the host lands in pinned memory: it is complete once the signal is.
            downloads.append((arena.index_select(0, slots).to(torch.device("cpu"), non_blocking=True), io, io_slots))
        return downloads

    def _input(
        self,
        staging: Staging,
        batch: int,
        arena_id: int,
        slots: np.ndarray,
        segments: np.ndarray | None,
        remote_rows: list[RemoteRows] | None,
        values: InlineValues | None,
    ) -> InputRows:
        """A TaskInput's fields resolved to tensors on the device (slot lists staged, checked on the host)."""
        arena = self._arena(arena_id)
        width = len(slots)  # a ragged input has any number of rows; a plain one has the batch's
        slots = self._slots(staging, slots, arena.shape[0], "input")
        segments = None if segments is None else self._slots(staging, segments, batch, "segment")
        remote: list[RemoteInput] = []
        for worker_id, peer_arena, peer_slots, positions in remote_rows or ():
            peer = self.peers.get((worker_id, peer_arena))
            if peer is None:
                raise KeyError(f"arena {peer_arena} of worker {worker_id} is not open here")
            peer_rows = self._slots(staging, peer_slots, peer.shape[0], "peer slot")
            remote.append(RemoteInput(peer, peer_rows, self._slots(staging, positions, width, "position")))
        inline = None
        if values is not None:
            positions, data = values
            rows = staging.put(np.frombuffer(data, dtype=np.uint8), arena.dtype, (-1, *arena.shape[1:]))
            inline = Inline(self._slots(staging, positions, width, "position"), rows)
        return InputRows(arena, slots, segments, remote, inline)

    def _local(self, remote: list[RemoteInput]) -> list[RemoteInput]:
        """Rows of peers mapped on another device, gathered there and copied here, in stream order.

        Called after the staging copy is enqueued: the gather reads the peer slots it carried.
        A peer mapped on this device (peer access) is read directly by the gather in `run_task`.
        """
        local = []
        for peer, slots, positions in remote:
            if peer.device != self._calls.device:
                with self._calls.on_peer_stream(peer.device):
                    rows = peer.index_select(0, slots.to(peer.device, non_blocking=True))
                    peer, slots = rows.to(self._calls.device, non_blocking=True), None
            local.append(RemoteInput(peer, slots, positions))
        return local

    def _slots(self, staging: Staging, values: np.ndarray, limit: int, what: str) -> torch.Tensor:
        # Checked on the host: on the device an index out of range is an assertion that ends the process.
        return staging.put(_check(values, limit, what), torch.int64)

    def _arena(self, arena_id: int) -> torch.Tensor:
        arena = self._arenas.get(arena_id)
        if arena is None:
            raise KeyError(f"no device arena {arena_id} on this worker")
        return arena

    def _io_arena(self, arena_id: int) -> np.ndarray:
        io = self._io.get(arena_id)
        if io is None:
            raise KeyError(f"no io arena {arena_id} on this worker")
        return io


def staged_bytes(task: TaskMessage) -> int:
    """Bytes `DeviceTasks._run` stages for a task: every slot list and inline value it sends to the device."""
    arrays: list[np.ndarray] = []
    inline = 0
    for _, slots, segments, remote, values in task.inputs:
        arrays.append(slots)
        if segments is not None:
            arrays.append(segments)
        for _, _, peer_slots, positions in remote or ():
            arrays += [peer_slots, positions]
        if values is not None:
            arrays.append(values[0])
            inline += _aligned(len(values[1]))
    arrays += [slots for _, slots in task.outputs] + [slots for _, slots, _, _ in task.downloads]
    return max(ALIGN, inline + sum(_aligned(array.nbytes) for array in arrays))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _check(values: np.ndarray, limit: int, what: str) -> np.ndarray:
    if values.size and (values.min() < 0 or values.max() >= limit):
        bad = values[(values < 0) | (values >= limit)][0]
        raise IndexError(f"{what} index {int(bad)} out of range 0..{limit - 1}")
    return values
