"""The manager's view of one registered worker: its arenas, slot allocators and tasks in flight."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from common.graph import ValueKind
from common.protocol import INTERNAL, RequestError
from common.shm import SharedArray
from manager.slots import SlotAllocator
from manager.state import Task


class WorkerHandle:
    def __init__(self, worker_id: int, identity: bytes, registration: dict[str, Any], kinds: list[ValueKind]):
        self.worker_id = worker_id
        self.identity = identity
        self.index = registration.get("index")
        self.pid = registration.get("pid")
        self.device = registration.get("device", "?")
        self.arena_id: dict[ValueKind, int] = {}
        self.io_arena_id: dict[ValueKind, int] = {}
        self.slots: dict[ValueKind, SlotAllocator] = {}
        self.io_slots: dict[ValueKind, SlotAllocator] = {}
        self.io: dict[ValueKind, np.ndarray] = {}
        self._shared: list[SharedArray] = []
        announced = {(arena["kind"], arena["space"]): arena for arena in registration.get("arenas", [])}
        for kind in kinds:
            device, io = announced.get((kind.key, "device")), announced.get((kind.key, "io"))
            if device is None or io is None or not io.get("shm"):
                raise RequestError(INTERNAL, f"worker did not announce arenas for {kind.key}")
            self.arena_id[kind] = device["id"]
            self.io_arena_id[kind] = io["id"]
            self.slots[kind] = SlotAllocator(device["rows"])
            self.io_slots[kind] = SlotAllocator(io["rows"])
            shared = SharedArray(kind.dtype, (io["rows"], *kind.shape), name=io["shm"])
            self._shared.append(shared)
            self.io[kind] = shared.array
        self.tasks: dict[int, Task] = {}
        self.tasks_completed = 0
        self.arenas = registration.get("arenas", [])  # as announced, for peers to open
        now = time.monotonic()
        self.registered_at = now
        self.first_task_delay: float | None = None  # seconds from registration to its first task
        self.last_seen = now  # any message from the worker
        self.signal = 0  # its stream's counter, as last reported
        self.progress_at = now  # when the counter last advanced, or work arrived while it was idle

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    def heard_from(self, signal: int, now: float) -> None:
        self.last_seen = now
        if signal != self.signal:
            self.signal = signal
            self.progress_at = now

    def occupancy(self) -> dict[str, dict[str, int]]:
        """Rows in use per arena (excluding the reserved zero and scratch rows)."""
        usage = {}
        for kind in self.slots:
            usage[f"device:{kind.key}"] = {"in_use": self.slots[kind].in_use, "capacity": self.slots[kind].capacity}
            usage[f"io:{kind.key}"] = {"in_use": self.io_slots[kind].in_use, "capacity": self.io_slots[kind].capacity}
        return usage

    def slots_in_use(self) -> int:
        return sum(a.in_use for a in self.slots.values()) + sum(a.in_use for a in self.io_slots.values())

    def close(self) -> None:
        self.io = {}
        for shared in self._shared:
            shared.close()
