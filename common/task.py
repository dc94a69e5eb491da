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

A completion notice: [worker_id, task ids, errors, signal, rows], rows being
[[io_arena, io_slots, data], ...], the downloaded rows of a worker on another host (else empty).

Slot lists travel as little-endian int64 bytes so both sides can view them without copying.
External values travel inline rather than through arena rows: they are small (a token per
row), and inline they need no slots to allocate and free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np

SLOT_DTYPE = np.dtype("<i8")

SlotCopy = tuple[int, np.ndarray, int, np.ndarray]
RemoteRows = tuple[int, int, np.ndarray, np.ndarray]  # (peer worker, peer arena, peer slots, positions)
SlotList = tuple[int, np.ndarray]
InlineValues = tuple[np.ndarray, bytes]  # (positions in the batch, raw rows)
InputSlots = tuple[int, np.ndarray, np.ndarray | None, list[RemoteRows] | None, InlineValues | None]


@dataclass(frozen=True)
class TaskMessage:
    task_id: int
    cell_index: int
    batch_size: int
    inputs: list[InputSlots]
    outputs: list[SlotList]
    downloads: list[SlotCopy]


def _slots(values: list[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=SLOT_DTYPE).tobytes()


def encode_task(message: TaskMessage) -> bytes:
    return msgpack.packb(
        [
            message.task_id,
            message.cell_index,
            message.batch_size,
            [[a, _slots(s), _optional(g), _remote(r), _inline(v)] for a, s, g, r, v in message.inputs],
            [[a, _slots(s)] for a, s in message.outputs],
            [[a, _slots(s), b, _slots(t)] for a, s, b, t in message.downloads],
        ],
        use_bin_type=True,
    )


def _optional(values: list[int] | np.ndarray | None) -> bytes | None:
    return None if values is None else _slots(values)


def _inline(values: InlineValues | None) -> list | None:
    return None if values is None else [_slots(values[0]), values[1]]


def _remote(rows: list[RemoteRows] | None) -> list | None:
    return None if rows is None else [[w, a, _slots(s), _slots(p)] for w, a, s, p in rows]


def _view(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=SLOT_DTYPE)


def decode_task(frame: bytes) -> TaskMessage:
    task_id, cell_index, batch_size, inputs, outputs, downloads = msgpack.unpackb(frame, raw=False)
    return TaskMessage(
        task_id,
        cell_index,
        batch_size,
        [
            (
                a,
                _view(s),
                None if g is None else _view(g),
                None if r is None else [(w, b, _view(t), _view(p)) for w, b, t, p in r],
                None if v is None else (_view(v[0]), v[1]),
            )
            for a, s, g, r, v in inputs
        ],
        [(a, _view(s)) for a, s in outputs],
        [(a, _view(s), b, _view(t)) for a, s, b, t in downloads],
    )


IoRows = tuple[int, np.ndarray, bytes]  # (io arena, io slots, the rows' raw bytes, in the arena's dtype)


@dataclass(frozen=True)
class CompletionNotice:
    """What a worker reports: tasks its stream finished (in stream order), the errors of those that
    failed, and its signal counter; a notice without tasks is a heartbeat. A worker on another host
    than the manager, which cannot map its io arenas, also sends the rows its finished tasks copied
    there (`rows`); a worker on the manager's host sends none."""

    worker_id: int
    task_ids: list[int]
    errors: dict[int, str]
    signal: int
    rows: list[IoRows] = field(default_factory=list)


def encode_notice(notice: CompletionNotice) -> bytes:
    rows = [[a, _slots(s), data] for a, s, data in notice.rows]
    return msgpack.packb([notice.worker_id, notice.task_ids, notice.errors, notice.signal, rows], use_bin_type=True)


def decode_notice(frame: bytes) -> CompletionNotice:
    worker_id, task_ids, errors, signal, rows = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    return CompletionNotice(worker_id, task_ids, errors, signal, [(a, _view(s), data) for a, s, data in rows])
