"""What a worker sends the manager about its stream: completion notices and heartbeats.

A completion notice: [worker_id, key, task ids, errors, signal, rows, busy_us, kernel_busy_us], rows
being [[io_arena, io_slots, data], ...], the downloaded rows of a worker on another host (else empty),
busy_us how long each task kept the worker busy, in microseconds, as the worker timed it (or
empty: not timed), and kernel_busy_us the microseconds its cells' forward calls have taken since
it started, in all (nil: not timed, as on a GPU, whose kernels run asynchronously).
`key` is the secret the manager gave the worker when it registered: the notice socket does not
say who sent a message, and without it any peer could complete another worker's tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgpack
import numpy as np

from batchmaker.common.task import SLOT_DTYPE, slot_bytes, slot_view


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
    rows = [[io_arena, slot_bytes(io_slots), data] for io_arena, io_slots, data in notice.rows]
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
    io_rows = [IoRows(a, slot_view(s), data) for a, s, data in rows]
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
