"""The tasks the manager sends a worker's stream: batched tasks and lane tasks (completion notices, what the
worker sends back: common.notice).

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

Slot lists travel as little-endian int64 bytes so both sides can view them without copying.
External values travel inline rather than through arena rows: they are small (a token per
row), and inline they need no slots to allocate and free.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def slot_bytes(values: list[int] | np.ndarray) -> bytes:
    """A slot list as it travels: little-endian int64 bytes."""
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
    return [
        [arena, slot_bytes(slots), io_arena, slot_bytes(io_slots)] for arena, slots, io_arena, io_slots in downloads
    ]


def _encode_step(batch_size: int, inputs: list[TaskInput], outputs: list[SlotList], downloads: list[SlotCopy]) -> list:
    return [
        batch_size,
        [_encode_input(*entry) for entry in inputs],
        [[arena, slot_bytes(slots)] for arena, slots in outputs],
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
        slot_bytes(slots),
        None if segments is None else slot_bytes(segments),
        None if remote is None else [[peer, a, slot_bytes(s), slot_bytes(p)] for peer, a, s, p in remote],
        None if values is None else [slot_bytes(values[0]), values[1]],
    ]


def slot_view(data: bytes) -> np.ndarray:
    """A slot list that travelled, viewed without a copy."""
    return np.frombuffer(data, dtype=SLOT_DTYPE)


def _decode_input(
    arena: int, slots: bytes, segments: bytes | None, remote: list | None, values: list | None
) -> TaskInput:
    return TaskInput(
        arena,
        slot_view(slots),
        None if segments is None else slot_view(segments),
        None if remote is None else [RemoteRows(w, a, slot_view(s), slot_view(p)) for w, a, s, p in remote],
        None if values is None else InlineValues(slot_view(values[0]), values[1]),
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
        [SlotList(a, slot_view(s)) for a, s in outputs],
        _decode_downloads(downloads),
    )


def _decode_downloads(downloads: list) -> list[SlotCopy]:
    return [SlotCopy(a, slot_view(s), b, slot_view(t)) for a, s, b, t in downloads]


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
        slot_bytes(message.steps),
        inputs,
        [[arena, slot_bytes(slots)] for arena, slots in message.outputs],
        [[port, slot_bytes(entries)] for port, entries in message.every_step],
        [[port, slot_bytes(entries), io, slot_bytes(io_slots)] for port, entries, io, io_slots in message.downloads],
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
        slot_view(steps),
        [LaneInput(m, s, a, _decode_input(*f), _decode_later(later)) for m, s, a, f, later in inputs],
        [SlotList(a, slot_view(s)) for a, s in outputs],
        [(port, slot_view(entries)) for port, entries in every_step],
        [StepDownload(p, slot_view(e), io, slot_view(s)) for p, e, io, s in downloads],
    )
