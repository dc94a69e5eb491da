"""The manager's view of one registered worker: its host, arenas, slot allocators and tasks in flight."""

from __future__ import annotations

import collections
import secrets
import time
from typing import Any

import numpy as np

from batchmaker.common.graph import ValueKind
from batchmaker.common.notice import IoRows, is_kernel_time
from batchmaker.common.protocol import BAD_REQUEST, INTERNAL, RequestError, echo
from batchmaker.common.shm import SharedArray
from batchmaker.common.slots import FIRST_FREE_SLOT, SlotAllocator
from batchmaker.manager.batching.records import Task


def check_registration(message: dict[str, Any], max_rows: dict[str, int]) -> None:
    """Types and bounds of what a registering worker says of itself, before anything is allocated
    for it: `max_rows` bounds each space's announced rows (the configured arena_rows and io_rows)."""
    if not _is_int(message.get("index")) or not (message.get("pid") is None or _is_int(message.get("pid"))):
        raise RequestError(BAD_REQUEST, "the registration's index and pid must be integers")
    if not isinstance(message.get("device", ""), str):
        raise RequestError(BAD_REQUEST, "the registration's device must be a string")
    if not is_kernel_time(message.get("kernel_busy_us")):
        raise RequestError(BAD_REQUEST, "the registration's kernel_busy_us must be a non-negative integer or nil")
    arenas = message.get("arenas")
    if not isinstance(arenas, list) or len(arenas) > 2 * len(max_rows) * 1024:
        raise RequestError(BAD_REQUEST, "the registration's arenas must be a list")
    for arena in arenas:
        if not isinstance(arena, dict) or arena.get("space") not in max_rows:
            raise RequestError(BAD_REQUEST, f"malformed arenas in the registration: {echo(arena)}")
        limit, rows = max_rows[arena["space"]], arena.get("rows")
        if not _is_int(arena.get("id")) or not isinstance(arena.get("kind"), str):
            raise RequestError(BAD_REQUEST, f"malformed arenas in the registration: {echo(arena)}")
        if not _is_int(rows) or not FIRST_FREE_SLOT < rows <= limit:
            raise RequestError(
                BAD_REQUEST,
                f"an arena of {echo(rows)} rows was announced; {arena['space']} arenas have at most {limit}",
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class WorkerHandle:
    """A worker on the manager's host (`local`) has its io arenas mapped here, from shared memory; one
    on another host has plain arrays standing in for them, filled from the rows its notices carry.
    `host_number` is the same for every worker of one host: only those read each other's arenas."""

    def __init__(
        self,
        worker_id: int,
        identity: bytes,
        registration: dict[str, Any],
        kinds: list[ValueKind],
        host_number: int = 0,
        local: bool = True,
    ):
        self.worker_id = worker_id
        self.identity = identity
        self.notice_key = secrets.token_bytes(16)  # its notices must carry it (common/task.py)
        self.index = registration.get("index")
        self.pid = registration.get("pid")  # only meaningful on the manager's host
        self.device = registration.get("device", "?")
        self.host = registration.get("host", "")
        self.host_number = host_number
        self.local = local
        self.arena_id: dict[ValueKind, int] = {}
        self.io_arena_id: dict[ValueKind, int] = {}
        self.slots: dict[ValueKind, SlotAllocator] = {}
        self.io_slots: dict[ValueKind, SlotAllocator] = {}
        self.io: dict[ValueKind, np.ndarray] = {}
        self._io_kinds: dict[int, ValueKind] = {}
        self._shared: list[SharedArray] = []
        announced = {(arena["kind"], arena["space"]): arena for arena in registration.get("arenas", [])}
        try:
            for kind in kinds:
                self._add_arenas(kind, announced.get((kind.key, "device")), announced.get((kind.key, "io")))
        except Exception:
            self.close()  # unmap what was mapped before the failure
            raise
        self.tasks: dict[int, Task] = {}  # in flight, by id: the one record of them (`start`, `finish`)
        self.nodes_in_flight = 0  # their cells
        self.running: collections.Counter[str] = collections.Counter()  # of them, by cell type
        self.tasks_completed = 0
        self.requests_answered = 0  # requests routed whole to its running batch that it answered
        self.steps_run = 0  # steps its running batch ran
        self.rows_read_from: collections.Counter[int] = collections.Counter()  # rows its tasks read from each peer
        self.rows_in_notices = 0  # result rows that reached the manager inside its notices
        self.arenas = registration.get("arenas", [])  # as announced, for peers to open
        # Workers of its host whose arenas it has not said it can read (the pool keeps this): no request
        # with values on one of them moves here. `unreadable` says why, for those it said it cannot read.
        self.unread: set[int] = set()
        self.unreadable: dict[int, str] = {}
        self.full_task_s = registration.get("full_task_s")  # timed at its warm-up, for admission (unchecked)
        now = time.monotonic()
        self.registered_at = now
        self.first_task_delay: float | None = None  # seconds from registration to its first task
        self.last_seen = now  # any message from the worker
        self.signal = 0  # its stream's counter, as last reported
        self.kernel_busy_us: int | None = None  # its cells' forward calls so far, as it reports them (None: untimed)
        self.kernels_timed(registration.get("kernel_busy_us"))  # from its registration: its warm-up's
        self.progress_at = now  # when the counter last advanced, or work arrived while it was idle
        self.loads_pending = 0  # versions it was told to load and has not answered for: its tasks wait meanwhile

    def _add_arenas(self, kind: ValueKind, device: dict[str, Any] | None, io: dict[str, Any] | None) -> None:
        if device is None or io is None or (self.local and not io.get("shm")):
            raise RequestError(INTERNAL, f"worker did not announce arenas for {kind.key}")
        self.arena_id[kind] = device["id"]
        self.io_arena_id[kind] = io["id"]
        self._io_kinds[io["id"]] = kind
        self.slots[kind] = SlotAllocator(device["rows"])
        self.io_slots[kind] = SlotAllocator(io["rows"])
        if not self.local:
            self.io[kind] = np.zeros((io["rows"], *kind.shape), kind.dtype)
            return
        try:
            shared = SharedArray(kind.dtype, (io["rows"], *kind.shape), name=io["shm"])
        except (OSError, ValueError) as exc:
            raise RequestError(
                BAD_REQUEST,
                f"cannot map the io arena of {kind.key} ({exc}): the worker says it runs on this host ({self.host}), "
                "but its shared memory is not here; start it with --host-id naming its own machine",
            ) from None
        self._shared.append(shared)
        self.io[kind] = shared.array

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    def start(self, task: Task) -> None:
        """The task is sent to this worker: it is in flight until `finish` (or `write_off`)."""
        self.tasks[task.task_id] = task
        self.nodes_in_flight += task.nodes
        self.running[task.spec.key] += 1

    def finish(self, task_id: int) -> Task | None:
        """The task the worker says it finished, no longer in flight (None if it was not)."""
        task = self.tasks.pop(task_id, None)
        if task is not None:
            self.nodes_in_flight -= task.nodes
            self.running[task.spec.key] -= 1
            self.tasks_completed += 1
        return task

    def write_off(self) -> list[Task]:
        """Every task in flight, the worker being lost: none is any more."""
        tasks = list(self.tasks.values())
        self.tasks.clear()
        self.nodes_in_flight = 0
        self.running.clear()
        return tasks

    def heard_from(self, signal: int, now: float, kernel_busy_us: int | None) -> None:
        """A notice or heartbeat arrived, with the worker's counter and kernel busy time."""
        self.last_seen = now
        self.kernels_timed(kernel_busy_us)
        if signal != self.signal:
            self.signal = signal
            self.progress_at = now

    def kernels_timed(self, kernel_busy_us: int | None) -> None:
        """The worker's kernel busy time so far, from a notice, a heartbeat or its running batch's answers. They come
        on different sockets (a CPU worker's stream sends its notices, its poller the heartbeats, its main thread the
        answers), so one may arrive after one sent later: the total only grows, so the largest is the latest."""
        self.kernel_busy_us = None if kernel_busy_us is None else max(kernel_busy_us, self.kernel_busy_us or 0)

    def running_batch_ran(self, ran: dict[str, dict[int, int]]) -> None:
        """Its running batch ran these steps (per cell type, the steps at each batch size)."""
        self.steps_run += sum(sum(sizes.values()) for sizes in ran.values())

    def running_batch_answered(self, requests: int) -> None:
        """Its running batch answered `requests` (not those it handed back to the manager's steps)."""
        self.requests_answered += requests

    def store_rows(self, rows: list[IoRows]) -> None:
        """Write the result rows a worker on another host sent into the arrays standing in for its io
        arenas, where the dispatcher reads them as it reads a local worker's io arenas."""
        for arena_id, slots, data in rows:
            kind = self._io_kinds.get(arena_id)
            if self.local or kind is None:
                where = "a worker on the manager's host" if self.local else f"no io arena {arena_id}"
                raise ValueError(f"rows for io arena {arena_id} in a notice, but {where}")
            io = self.io[kind]
            if slots.size and (slots.min() < 0 or slots.max() >= len(io)):
                raise ValueError(f"io slots out of range 0..{len(io) - 1} for {kind.key}")
            if len(data) != len(slots) * io[0].nbytes:
                raise ValueError(f"{len(data)} bytes for {len(slots)} rows of {kind.key}")
            io[slots] = np.frombuffer(data, io.dtype).reshape(len(slots), *kind.shape)
            self.rows_in_notices += len(slots)

    def occupancy(self) -> dict[str, dict[str, int]]:
        """Rows in use per arena (excluding the reserved zero and scratch rows)."""
        usage = {}
        for kind in self.slots:
            usage[f"device:{kind.key}"] = {"in_use": self.slots[kind].in_use, "capacity": self.slots[kind].capacity}
            usage[f"io:{kind.key}"] = {"in_use": self.io_slots[kind].in_use, "capacity": self.io_slots[kind].capacity}
        return usage

    def slots_in_use(self) -> int:
        return sum(a.in_use for a in self.slots.values()) + sum(a.in_use for a in self.io_slots.values())

    def health(self) -> dict[str, Any]:
        """This worker's part of the `health` reply."""
        return {
            "id": self.worker_id,
            "index": self.index,
            "device": self.device,
            "pid": self.pid,
            "host": self.host,
            "local": self.local,
            "tasks_in_flight": self.in_flight,
        }

    def stats(self) -> dict[str, Any]:
        """This worker's part of the `stats` reply."""
        return {
            "tasks_in_flight": self.in_flight,
            "tasks_completed": self.tasks_completed,
            "requests_answered": self.requests_answered,
            "steps_run": self.steps_run,
            "first_task_delay_ms": None if self.first_task_delay is None else self.first_task_delay * 1e3,
            "kernel_busy_s": None if self.kernel_busy_us is None else self.kernel_busy_us / 1e6,
            "pid": self.pid,
            "host": self.host,
            "local": self.local,
            "rows_read_from_peers": {str(peer): rows for peer, rows in self.rows_read_from.items()},
            "rows_in_notices": self.rows_in_notices,
            "unreadable_peers": {str(peer): why for peer, why in self.unreadable.items()},
            "arenas": self.occupancy(),
            "slots_in_use": self.slots_in_use(),
        }

    def close(self) -> None:
        self.io = {}
        for shared in self._shared:
            shared.close()
