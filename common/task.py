"""The messages between the manager and a worker's stream: batched tasks, and completion notices.

A task: slot lists, plus the requests' own inputs.

    [task_id, cell_index, batch_size, inputs, outputs, downloads]

* inputs:    [[arena, slots, segments, remote, values], ...] one per cell input: `batch_size`
             slots each (padding rows read the zero slot) and segments nil; for a ragged input,
             any number of slots and, per slot, the batch row it belongs to. `remote` (or nil)
             lists values produced on other workers of the same host by tasks that have completed:
             [[peer_worker, peer_arena, peer_slots, positions], ...], read from the peer's
             arena into those positions of the gathered input. `values` (or nil) carries
             external inputs (a request's tokens, say) inline: [positions, data], the rows
             for those positions in the input's dtype and shape, written over the gathered rows
* outputs:   [[arena, slots], ...] one per cell output (padding rows write the scratch slot)
* downloads: [[arena, slots, io_arena, io_slots], ...] rows the host must see (results,
             stop decisions), copied to the io arena after compute

A multi-step task (several consecutive waves of the same lanes, run back to back) appends a
seventh field, its later steps, each with its own batch size and slot lists:

    [task_id, cell_index, batch_size, inputs, outputs, downloads, [[batch_size, inputs, outputs, downloads], ...]]

A single-step task has no seventh field, so its bytes are what they were before multi-step tasks.
The worker runs the steps in order and reports the task once, after its last step.

A lane task runs chain lanes (common.lanes) for several steps, described per lane, not per step:

    [task_id, cell_index, "lanes", steps, inputs, outputs, every_step, downloads]

* steps:     per lane, the steps it runs, in descending order: step j runs the lanes whose count
             exceeds j, a prefix of them, so lanes that end drop off the end of the batch
* inputs:    [[mode, source, arena, first, later], ...] one per cell input (common.lanes), `arena` the
             device arena of its kind: `first` is a task input as above, one row per lane, which
             every input reads at its first step (a constant at every step); a state then takes
             the rows its `source` output computed at the step before; a sequence's `later` holds
             its later steps' rows, step after step, each step's rows those of its lanes in order:
             their values, raw (the request's own inputs), or a task input of as many rows (nil
             for other inputs)
* outputs:   [[arena, slots], ...] one per cell output: per lane, where its last step's value goes,
             or for an output listed in `every_step`, where the rows its `entries` take go
* every_step: [[port, entries], ...] the outputs read outside their lane at every step: `entries`
             index the output's rows of every step, counted step after step (the first included),
             each register's last value once
* downloads: [[port, entries, io_arena, io_slots], ...] rows of output `port` the host must see:
             `entries` index its rows of every step, counted step after step

A completion notice: [worker_id, key, task ids, errors, signal, rows, busy_us, kernel_busy_us], rows
being [[io_arena, io_slots, data], ...], the downloaded rows of a worker on another host (else empty),
busy_us how long each task kept the worker busy, in microseconds, as the worker timed it (or
empty: not timed), and kernel_busy_us the microseconds its cells' forward calls have taken since
it started, in all (nil: not timed, as on a GPU, whose kernels run asynchronously).
`key` is the secret the manager gave the worker when it registered: the notice socket does not
say who sent a message, and without it any peer could complete another worker's tasks.

Slot lists travel as little-endian int64 bytes so both sides can view them without copying.
External values travel inline rather than through arena rows: they are small (a token per
row), and inline they need no slots to allocate and free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgpack
import numpy as np

SLOT_DTYPE = np.dtype("<i8")


class RemoteRows(NamedTuple):
    """Rows of an input produced on another worker of the host, read from that worker's arena."""

    peer: int  # the worker's id
    arena: int  # its arena's id
    slots: np.ndarray  # rows there
    positions: np.ndarray  # where they go in the gathered input


class InlineValues(NamedTuple):
    """External values sent inside the task, in the input's dtype and shape."""

    positions: np.ndarray  # rows of the gathered input they replace
    data: bytes  # the raw rows


class TaskInput(NamedTuple):
    """One cell input: its arena rows (padding rows read the zero slot), and for a ragged input the
    batch row each belongs to (`segments`); values from peers and inline values go over them."""

    arena: int
    slots: np.ndarray
    segments: np.ndarray | None
    remote: list[RemoteRows] | None
    values: InlineValues | None


class SlotList(NamedTuple):
    """Arena rows of one cell output (padding rows write the scratch slot)."""

    arena: int
    slots: np.ndarray


class SlotCopy(NamedTuple):
    """Rows the host must see, copied from a device arena to an io arena after compute."""

    arena: int
    slots: np.ndarray
    io_arena: int
    io_slots: np.ndarray


class TaskStep(NamedTuple):
    """One wave of a task's lanes: its batch size and slot lists (a later step of a multi-step task)."""

    batch_size: int
    inputs: list[TaskInput]
    outputs: list[SlotList]
    downloads: list[SlotCopy]


@dataclass(frozen=True)
class TaskMessage:
    """A task: its first step's fields, and the steps that follow it in a multi-step task (`later`)."""

    task_id: int
    cell_index: int
    batch_size: int
    inputs: list[TaskInput]
    outputs: list[SlotList]
    downloads: list[SlotCopy]
    later: tuple[TaskStep, ...] = ()

    def steps(self) -> list[TaskMessage]:
        """Each step as a single-step task of the same id and cell type, in the order they run."""
        if not self.later:
            return [self]
        first = TaskMessage(self.task_id, self.cell_index, self.batch_size, self.inputs, self.outputs, self.downloads)
        return [first, *(TaskMessage(self.task_id, self.cell_index, *step) for step in self.later)]

    def all_downloads(self) -> list[SlotCopy]:
        """The downloads of every step, in order."""
        return [download for step in self.steps() for download in step.downloads]

    def io_rows(self) -> list[tuple[int, np.ndarray]]:
        """The io rows the task writes: (io arena, io slots) of each download."""
        return [(io_arena, io_slots) for _, _, io_arena, io_slots in self.all_downloads()]


def _slots(values: list[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=SLOT_DTYPE).tobytes()


def encode_task(message: TaskMessage | LaneTaskMessage) -> bytes:
    """A task's frame, either kind (`decode_task` tells them apart)."""
    return _encode_lanes(message) if isinstance(message, LaneTaskMessage) else _encode_waves(message)


def _encode_waves(message: TaskMessage) -> bytes:
    first = TaskStep(message.batch_size, message.inputs, message.outputs, message.downloads)
    fields = [message.task_id, message.cell_index, *_encode_step(*first)]
    if message.later:
        fields.append([_encode_step(*step) for step in message.later])
    return msgpack.packb(fields, use_bin_type=True)


def _encode_downloads(downloads: list[SlotCopy]) -> list:
    return [[arena, _slots(slots), io_arena, _slots(io_slots)] for arena, slots, io_arena, io_slots in downloads]


def _encode_step(batch_size: int, inputs: list[TaskInput], outputs: list[SlotList], downloads: list[SlotCopy]) -> list:
    return [
        batch_size,
        [_encode_input(*entry) for entry in inputs],
        [[arena, _slots(slots)] for arena, slots in outputs],
        _encode_downloads(downloads),
    ]


def _encode_input(
    arena: int,
    slots: np.ndarray,
    segments: np.ndarray | None,
    remote: list[RemoteRows] | None,
    values: InlineValues | None,
) -> list:
    """A TaskInput's fields in order (a plain tuple of them is accepted too)."""
    return [
        arena,
        _slots(slots),
        None if segments is None else _slots(segments),
        None if remote is None else [[peer, a, _slots(s), _slots(p)] for peer, a, s, p in remote],
        None if values is None else [_slots(values[0]), values[1]],
    ]


def _view(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=SLOT_DTYPE)


def _decode_input(
    arena: int, slots: bytes, segments: bytes | None, remote: list | None, values: list | None
) -> TaskInput:
    return TaskInput(
        arena,
        _view(slots),
        None if segments is None else _view(segments),
        None if remote is None else [RemoteRows(w, a, _view(s), _view(p)) for w, a, s, p in remote],
        None if values is None else InlineValues(_view(values[0]), values[1]),
    )


def decode_task(frame: bytes) -> TaskMessage | LaneTaskMessage:
    task_id, cell_index, *fields = msgpack.unpackb(frame, raw=False)
    if fields[0] == LANES:
        return _decode_lane_task(task_id, cell_index, *fields[1:])
    first = _decode_step(*fields[:4])
    later = tuple(_decode_step(*entry) for entry in fields[4]) if len(fields) == 5 else ()
    return TaskMessage(task_id, cell_index, *first, later)


def _decode_step(batch_size: int, inputs: list, outputs: list, downloads: list) -> TaskStep:
    return TaskStep(
        batch_size,
        [_decode_input(*entry) for entry in inputs],
        [SlotList(a, _view(s)) for a, s in outputs],
        _decode_downloads(downloads),
    )


def _decode_downloads(downloads: list) -> list[SlotCopy]:
    return [SlotCopy(a, _view(s), b, _view(t)) for a, s, b, t in downloads]


class LaneInput(NamedTuple):
    """One cell input of a lane task: how its steps read (common.lanes) and what they read."""

    mode: int
    source: int
    arena: int  # the device arena of the input's kind
    first: TaskInput  # the rows of the first step (a constant's of every step): one per lane
    later: TaskInput | bytes | None  # a sequence's later steps' rows (or their raw values), packed step after step


class StepDownload(NamedTuple):
    """Rows of one output of a lane task's steps that the host must see, copied to an io arena."""

    port: int
    entries: np.ndarray  # positions among the output's rows of every step, packed step after step
    io_arena: int
    io_slots: np.ndarray


@dataclass(frozen=True)
class LaneTaskMessage:
    """A lane task: chain lanes of one cell type, each running `steps[i]` steps (descending)."""

    task_id: int
    cell_index: int
    steps: np.ndarray
    inputs: list[LaneInput]
    outputs: list[SlotList]
    every_step: list[tuple[int, np.ndarray]]  # outputs written at every step: (port, entries among their rows)
    downloads: list[StepDownload]

    def io_rows(self) -> list[tuple[int, np.ndarray]]:
        return [(download.io_arena, download.io_slots) for download in self.downloads]


LANES = "lanes"  # the third field of a lane task, where a task of waves has its batch size


def _encode_lanes(message: LaneTaskMessage) -> bytes:
    inputs = [
        [mode, source, arena, _encode_input(*first), _encode_later(later)]
        for mode, source, arena, first, later in message.inputs
    ]
    fields = [
        message.task_id,
        message.cell_index,
        LANES,
        _slots(message.steps),
        inputs,
        [[arena, _slots(slots)] for arena, slots in message.outputs],
        [[port, _slots(entries)] for port, entries in message.every_step],
        [[port, _slots(entries), io, _slots(io_slots)] for port, entries, io, io_slots in message.downloads],
    ]
    return msgpack.packb(fields, use_bin_type=True)


def _encode_later(later: TaskInput | bytes | None) -> list | bytes | None:
    return later if later is None or isinstance(later, bytes) else _encode_input(*later)


def _decode_later(later: list | bytes | None) -> TaskInput | bytes | None:
    return later if later is None or isinstance(later, bytes) else _decode_input(*later)


def _decode_lane_task(
    task_id: int, cell_index: int, steps: bytes, inputs: list, outputs: list, every_step: list, downloads: list
) -> LaneTaskMessage:
    return LaneTaskMessage(
        task_id,
        cell_index,
        _view(steps),
        [LaneInput(m, s, a, _decode_input(*f), _decode_later(later)) for m, s, a, f, later in inputs],
        [SlotList(a, _view(s)) for a, s in outputs],
        [(port, _view(entries)) for port, entries in every_step],
        [StepDownload(p, _view(e), io, _view(s)) for p, e, io, s in downloads],
    )


class IoRows(NamedTuple):
    """Downloaded rows a worker on another host sends in its notice."""

    io_arena: int
    io_slots: np.ndarray
    data: bytes  # the rows' raw bytes, in the arena's dtype


@dataclass(frozen=True)
class CompletionNotice:
    """What a worker reports: tasks its stream finished (in stream order), the errors of those that
    failed, and its signal counter; a notice without tasks is a heartbeat. A worker on another host
    than the manager, which cannot map its io arenas, also sends the rows its finished tasks copied
    there (`rows`); a worker on the manager's host sends none. `key` proves who sent it. Every notice,
    heartbeats too, carries the worker's kernel busy time so far, for the manager's `stats`."""

    worker_id: int
    task_ids: list[int]
    errors: dict[int, str]
    signal: int
    rows: list[IoRows] = field(default_factory=list)
    key: bytes = b""
    busy_us: list[int] = field(default_factory=list)  # per task: how long it kept the worker busy (or none)
    kernel_busy_us: int | None = 0  # its cells' forward calls in all since it started (None: not timed)


def encode_notice(notice: CompletionNotice) -> bytes:
    rows = [[io_arena, _slots(io_slots), data] for io_arena, io_slots, data in notice.rows]
    fields = [
        notice.worker_id,
        notice.key,
        notice.task_ids,
        notice.errors,
        notice.signal,
        rows,
        notice.busy_us,
        notice.kernel_busy_us,
    ]
    return msgpack.packb(fields, use_bin_type=True)


def decode_notice(frame: bytes) -> CompletionNotice:
    """Decode a notice, checking every field's type: raises ValueError for anything else."""
    try:
        fields = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ValueError(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(fields, list) or len(fields) != 8:
        raise ValueError("not a list of eight fields")
    worker_id, key, task_ids, errors, signal, rows, busy_us, kernel_busy_us = fields
    if not (_is_int(worker_id) and _is_int(signal) and isinstance(key, bytes)):
        raise ValueError("ill-typed worker id, key or signal")
    if not isinstance(task_ids, list) or not all(map(_is_int, task_ids)):
        raise ValueError("task ids are not a list of integers")
    if not isinstance(errors, dict) or not all(_is_int(k) and isinstance(v, str) for k, v in errors.items()):
        raise ValueError("errors are not a map of task ids to text")
    if not isinstance(rows, list) or not all(_is_io_rows(entry) for entry in rows):
        raise ValueError("rows are not [io arena, slots, data] entries")
    if not isinstance(busy_us, list) or len(busy_us) not in (0, len(task_ids)) or not all(map(_is_int, busy_us)):
        raise ValueError("busy times are not an integer per task (or none)")
    if not is_kernel_time(kernel_busy_us):
        raise ValueError("the kernel busy time is not an integer >= 0 (or nil)")
    io_rows = [IoRows(a, _view(s), data) for a, s, data in rows]
    return CompletionNotice(worker_id, task_ids, errors, signal, io_rows, key, busy_us, kernel_busy_us)


def is_kernel_time(value: object) -> bool:
    """Whether a worker's reported kernel busy time (in a notice, a heartbeat, its registration or its running
    batch's answers) is well formed: microseconds, an integer >= 0, or nil where its kernels are not timed."""
    return value is None or (_is_int(value) and value >= 0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_io_rows(entry: object) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 3
        and _is_int(entry[0])
        and isinstance(entry[1], bytes)
        and len(entry[1]) % SLOT_DTYPE.itemsize == 0
        and isinstance(entry[2], bytes)
    )
