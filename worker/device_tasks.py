"""The GPU backend's tensor work, kept apart from its streams, events, IPC and pinned memory.

Everything here creates tensors on the backend's device and enqueues operations on them,
and reaches the device itself only through `DeviceCalls`. The CUDA backend implements
those calls with a stream, pinned memory and a counter; tests implement them with torch's
fake tensors, so this code runs on a machine without a GPU with every arena on "cuda",
where any tensor left on the host (an index, an inline value, a peer's rows) raises a
device mismatch, as it would on a GPU.

Per task on the device's stream: one host-to-device copy of all the task's slot lists and
inline values (packed into one buffer), the gathers, the cell, the scatters, per download a
gather and one device-to-host copy per run of consecutive io rows (straight into the io
arena, page-locked), and the counter write. A multi-step task enqueues that body once per step
(its own staging copy each) and writes the counter once, after its last step. Everything a task could fail on
at the host (slots out of range, an unknown arena or peer) is checked before any of it is enqueued.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.slots import SCRATCH_SLOT, ZERO_SLOT
from batchmaker.common.task import SLOT_DTYPE, InlineValues, LaneTaskMessage, RemoteRows, TaskInput, TaskMessage
from batchmaker.worker.backend import DeviceFault, warm_up_tasks
from batchmaker.worker.batched_task import Inline, InputRows, IssuedTask, PeerArenas, RemoteInput, run_task
from batchmaker.worker.cuda_graphs import Capture, CapturedCell, capture_cells
from batchmaker.worker.lanes import LaneRows, LaneTask, StepRows, check_lane_task, check_later, run_lanes, step_batches

log = logging.getLogger(__name__)

ALIGN = 8  # bytes: every staged array starts where a view of any arena dtype may begin
WARM_UP_PEER = -1  # warm-up reads this worker's own arenas as a peer's, to run the remote-read path once

# A download, checked on the host: (device arena, staged device slots, io arena, io slots).
Source = tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]


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
    def download(self, host: np.ndarray, rows: torch.Tensor) -> None:
        """Enqueue the copy of device `rows` into `host`, consecutive rows of an io arena; complete once
        the signal after it is."""


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
        self.unreadable: dict[int, str] = {}  # peers whose arenas could not be opened here, and why
        self._errors: dict[int, str] = {}
        self.graphs: dict[tuple[int, int], CapturedCell] = {}  # by (cell index, batch size)

    def warm_up(self, capture: Capture | None = None) -> None:
        """Run every (cell type, batch size) once, with every kind of operation a serving task holds
        (inline values, a peer's rows, downloads), so that none first runs on live traffic; a failure
        here is a start-up failure and propagates.

        With `capture`, then capture every capturable (cell type, batch size) and run each
        warm-up task again, through its graph, so that serving replays what was already run.
        """
        own = {(WARM_UP_PEER, arena_id): arena for arena_id, arena in self._arenas.items()}
        self.peers.update(own)
        try:
            with self._calls.on_stream(), torch.inference_mode():
                plain = warm_up_tasks(self._specs, self._ids)
                tasks = [serving_like(task, self._specs[task.cell_index], self._ids) for task in plain]
                for task in tasks:
                    self._run(task)
                if capture is not None:
                    self.graphs = capture_cells(self._cells, self._specs, self._calls.device, capture)
                    for task in tasks:
                        self._run(task)
        finally:
            for key in own:
                del self.peers[key]

    @property
    def cells(self) -> tuple[list[CellTypeSpec | None], list[nn.Module | None]]:
        """The cell types and modules by index (run-time loads extend them, unloads empty them)."""
        return self._specs, self._cells  # type: ignore[return-value]

    def forget_graphs(self, indices: list[int]) -> None:
        """Drop the captured graphs of cell types that were unloaded, with the buffers they hold."""
        for key in [key for key in self.graphs if key[0] in set(indices)]:
            del self.graphs[key]

    def issue(self, task: TaskMessage | LaneTaskMessage) -> None:
        """Enqueue the task and then its signal: a task that cannot be issued still completes, with its error.

        A CUDA error is not the task's: it leaves the device's context unusable, so it ends the worker
        (`DeviceFault`), whose requests the manager replays elsewhere.
        """
        with self._calls.on_stream(), torch.inference_mode(), device_faults(self._calls.device):
            try:  # a multi-step or lane task: every step enqueued, no host sync between them
                if isinstance(task, LaneTaskMessage):
                    self._run_lanes(task)
                else:
                    self._run(task)
            except torch.AcceleratorError:
                raise
            except Exception as exc:  # shape errors, bad slots, out of memory: this task fails, the worker lives
                log.exception("task %d failed", task.task_id)
                self._errors[task.task_id] = f"{type(exc).__name__}: {exc}"
            self._calls.signal()

    def finish(self, task_id: int) -> str | None:
        """After the task's signal (its downloads are in the io arenas by then): its error, if it failed."""
        return self._errors.pop(task_id, None)

    def read_io(self, arena_id: int, slots: np.ndarray) -> bytes:
        """Rows of an io arena, once the signal after the task that downloaded them has passed."""
        return self._io_arena(arena_id)[slots].tobytes()

    def _run(self, task: TaskMessage) -> None:
        """Every step checked and staged on the host, all sent in one copy, then the steps back to back:
        a step that cannot be issued fails its whole task before anything is enqueued."""
        steps = task.steps()
        staging = self._calls.staging(sum(staged_bytes(step) for step in steps))
        prepared = [self._prepare(staging, step) for step in steps]
        staging.send()  # the first operation enqueued: every host-side check has passed
        for step, (issued, sources) in zip(steps, prepared):
            issued.inputs = [entry._replace(remote=self._local(entry.remote)) for entry in issued.inputs]
            graph = self.graphs.get((step.cell_index, step.batch_size))
            if graph is None:
                run_task(issued)
            else:
                graph.run(issued)
            for arena, slots, io, io_slots in sources:
                rows = arena.index_select(0, slots)
                for start, at, count in consecutive_runs(io_slots):
                    self._calls.download(io[at : at + count], rows.narrow(0, start, count))

    def _run_lanes(self, task: LaneTaskMessage) -> None:
        """A lane task's rows and inputs checked and staged on the host, sent in one copy, then every step
        enqueued (worker.lanes), and each download's rows copied to the io arena a run of io rows at a time."""
        cuts = check_lane_task(task)
        staging = self._calls.staging(staged_lane_bytes(task))
        lanes, packed = len(task.steps), int(task.steps.sum())
        inputs = []
        for (mode, source, arena_id, first, later), cut in zip(task.inputs, cuts):
            rows = self._input(staging, lanes, *first)
            later_rows: InputRows | torch.Tensor | None = None
            if isinstance(later, TaskInput):
                later_rows = self._input(staging, packed - lanes, *later)
                check_later(mode, len(later.slots), task.steps)
            elif later is not None:  # the rows themselves
                arena = self._arena(arena_id)
                later_rows = staging.put(np.frombuffer(later, dtype=np.uint8), arena.dtype, (-1, *arena.shape[1:]))
                check_later(mode, later_rows.shape[0], task.steps)
            else:
                check_later(mode, 0, task.steps)
            inputs.append(LaneRows(mode, source, rows, later_rows, cut))
        outputs = [
            (self._arena(a), self._slots(staging, s, self._arena(a).shape[0], "output")) for a, s in task.outputs
        ]
        every_step = {port: self._slots(staging, entries, packed, "entry") for port, entries in task.every_step}
        downloads = []
        for port, entries, io_id, io_slots in task.downloads:
            io = self._io_arena(io_id)
            if len(entries) != len(io_slots):
                raise ValueError(f"a download of {len(entries)} rows into {len(io_slots)} io slots")
            _check(io_slots, io.shape[0], "io slot")
            downloads.append(StepRows(port, self._slots(staging, entries, packed, "entry"), io, io_slots))
        batch, offsets = step_batches(task.steps)
        staging.send()  # the first operation enqueued: every host-side check has passed
        inputs = [
            entry._replace(
                first=self._localized(entry.first),
                later=self._localized(entry.later) if isinstance(entry.later, InputRows) else entry.later,
            )
            for entry in inputs
        ]
        cell = self._cells[task.cell_index]
        stop = self._specs[task.cell_index].stop
        lane_task = LaneTask(task.task_id, cell, batch, offsets, inputs, outputs, every_step, downloads, stop)
        for (_, _, io, io_slots), rows in zip(downloads, run_lanes(lane_task)):
            for start, at, count in consecutive_runs(io_slots):
                self._calls.download(io[at : at + count], rows.narrow(0, start, count))

    def _localized(self, rows: InputRows) -> InputRows:
        return rows._replace(remote=self._local(rows.remote))

    def _prepare(self, staging: Staging, step: TaskMessage) -> tuple[IssuedTask, list[Source]]:
        """A step's slot lists and inline values staged (their device views), its downloads' sources."""
        inputs = [self._input(staging, step.batch_size, *entry) for entry in step.inputs]
        outputs = [
            (self._arena(a), self._slots(staging, s, self._arena(a).shape[0], "output")) for a, s in step.outputs
        ]
        sources = [self._source(staging, *download) for download in step.downloads]
        return IssuedTask(step.task_id, self._cells[step.cell_index], inputs, outputs, []), sources

    def _source(self, staging: Staging, arena_id: int, slots: np.ndarray, io_id: int, io_slots: np.ndarray) -> Source:
        arena, io = self._arena(arena_id), self._io_arena(io_id)
        if len(slots) != len(io_slots):
            raise ValueError(f"a download of {len(slots)} rows into {len(io_slots)} io slots")
        _check(io_slots, io.shape[0], "io slot")
        return arena, self._slots(staging, slots, arena.shape[0], "download"), io, io_slots

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
                why = self.unreadable.get(worker_id, "not announced to this worker")
                raise KeyError(f"arena {peer_arena} of worker {worker_id} is not open here: {why}")
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


def staged_lane_bytes(task: LaneTaskMessage) -> int:
    """Bytes `DeviceTasks._run_lanes` stages for a lane task: its inputs' rows, outputs' rows and downloads."""
    entries = [entry for lane in task.inputs for entry in (lane.first, lane.later) if isinstance(entry, TaskInput)]
    staged = staged_bytes(TaskMessage(task.task_id, task.cell_index, len(task.steps), entries, task.outputs, []))
    staged += sum(_aligned(len(lane.later)) for lane in task.inputs if isinstance(lane.later, bytes))
    staged += sum(_aligned(entries.nbytes) for _, entries in task.every_step)
    return staged + sum(_aligned(entries.nbytes) for _, entries, _, _ in task.downloads)


def serving_like(task: TaskMessage, spec: CellTypeSpec, ids: dict[ValueKind, tuple[int, int]]) -> TaskMessage:
    """A warm-up task with what serving adds: each input's first row given inline (zeros) and its last read
    from a peer's zero row, and each output's scratch row downloaded to the io arena's scratch row."""
    inputs = []
    for (arena, slots, segments, _, _), kind in zip(task.inputs, spec.inputs):
        last = np.array([len(slots) - 1], dtype=SLOT_DTYPE)
        remote = [(WARM_UP_PEER, arena, np.array([ZERO_SLOT], dtype=SLOT_DTYPE), last)]
        inline = (np.array([0], dtype=SLOT_DTYPE), np.zeros(kind.shape, dtype=kind.dtype).tobytes())
        inputs.append((arena, slots, segments, remote, inline))
    scratch = np.array([SCRATCH_SLOT], dtype=SLOT_DTYPE)
    downloads = [(ids[kind][0], scratch, ids[kind][1], scratch) for kind in spec.outputs]
    return TaskMessage(task.task_id, task.cell_index, task.batch_size, inputs, task.outputs, downloads)


def consecutive_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """`slots` as runs of consecutive values: (position in `slots`, first value, length) each."""
    if not len(slots):
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(slots)])))
    return [(int(start), int(slots[start]), int(length)) for start, length in zip(starts, lengths)]


@contextmanager
def device_faults(device: torch.device) -> Iterator[None]:
    """CUDA errors surface at whichever call comes next, and every later call fails alike."""
    try:
        yield
    except torch.AcceleratorError as exc:
        raise DeviceFault(f"{device} failed: {exc}") from exc


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _check(values: np.ndarray, limit: int, what: str) -> np.ndarray:
    if values.size and (values.min() < 0 or values.max() >= limit):
        bad = values[(values < 0) | (values >= limit)][0]
        raise IndexError(f"{what} index {int(bad)} out of range 0..{limit - 1}")
    return values
