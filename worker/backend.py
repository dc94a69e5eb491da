"""What a device backend offers the worker's issuer and poller.

A backend owns the device arenas (one per value kind), the host io arenas the manager
reads results from, the stream tasks are issued to, and the signal counter that the
stream advances after each task, in stream order; the worker turns the counter's
increments into completion notices (docs/architecture.md, "The worker").
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from batchmaker.common.config import ConfigError
from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.slots import SCRATCH_SLOT, ZERO_SLOT
from batchmaker.common.task import SLOT_DTYPE, LaneTaskMessage, TaskMessage
from batchmaker.worker.batched_task import KernelClock


class DeviceFault(RuntimeError):
    """The device failed (a device-side assert, an illegal address): its context is unusable, so the worker
    exits and is restarted, and the manager replays its requests elsewhere."""


TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}


@dataclass(frozen=True)
class ArenaInfo:
    """One arena as announced to the manager at registration."""

    arena_id: int
    kind: ValueKind
    space: str  # "device" or "io"
    rows: int
    shm_name: str | None  # set where another process can map it

    handle: list[Any] | None = None  # CUDA IPC handle of a device arena, for peers to open

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.arena_id,
            "kind": self.kind.key,
            "dtype": self.kind.dtype,
            "shape": list(self.kind.shape),
            "space": self.space,
            "rows": self.rows,
            "shm": self.shm_name,
            "handle": self.handle,
        }


def arena_ids(kinds: list[ValueKind]) -> dict[ValueKind, tuple[int, int]]:
    """Arena ids of each kind: (device arena, io arena)."""
    return {kind: (2 * i, 2 * i + 1) for i, kind in enumerate(kinds)}


def warm_up_tasks(specs: list[CellTypeSpec], ids: dict[ValueKind, tuple[int, int]]) -> Iterator[TaskMessage]:
    """One task per (cell type, batch size) on zero rows, writing only the scratch slot.

    Warm-up goes through each backend's own task path, so it runs exactly what serving will.
    """
    for cell_index, spec in enumerate(specs):
        for size in spec.batch_sizes:
            inputs = [
                (
                    ids[kind][0],
                    np.full(size, ZERO_SLOT, dtype=SLOT_DTYPE),
                    np.arange(size, dtype=SLOT_DTYPE) if port in spec.ragged_inputs else None,  # one zero child each
                    None,
                    None,
                )
                for port, kind in enumerate(spec.inputs)
            ]
            outputs = [(ids[kind][0], np.full(size, SCRATCH_SLOT, dtype=SLOT_DTYPE)) for kind in spec.outputs]
            yield TaskMessage(-1, cell_index, size, inputs, outputs, [])


FULL_TASK_RUNS = 5  # timings of each cell type's full task at warm-up: the median is kept
FULL_TASK_TIMEOUT_S = 60.0  # a full task timed at warm-up that takes longer has a stream that is stuck


def time_full_tasks(
    specs: list[CellTypeSpec], ids: dict[ValueKind, tuple[int, int]], run: Callable[[TaskMessage], None]
) -> dict[str, float]:
    """Seconds one task of each cell type takes at its largest batch (the median of FULL_TASK_RUNS), run by
    `run` as serving runs it: the step cost the manager's admission by expected wait assumes until it has
    timed full tasks of its own, so that a cold server bounds its queue from the first request."""
    timed = {}
    for task in warm_up_tasks(specs, ids):
        spec = specs[task.cell_index]
        if task.batch_size != spec.max_batch:
            continue
        runs = []
        for _ in range(FULL_TASK_RUNS):
            began = time.perf_counter()
            run(task)
            runs.append(time.perf_counter() - began)
        timed[spec.key] = statistics.median(runs)
    return timed


def warm_up_failure(spec: CellTypeSpec, batch_size: int, exc: Exception) -> ConfigError:
    """A cell that fails on zero rows is the model's fault: say which cell type and what it must return."""
    def kinds(values: tuple[ValueKind, ...]) -> str:
        return ", ".join(
            f"{kind.dtype}[batch, {', '.join(map(str, kind.shape))}]".replace(", ]", "]") for kind in values
        )

    return ConfigError(
        f"cell type {spec.key!r} failed its warm-up run at batch size {batch_size} "
        f"({type(exc).__name__}: {str(exc)[:300]}); its cell must take ({kinds(spec.inputs)}) and return "
        f"({kinds(spec.outputs)}), each with the batch first (docs/models.md, \"Rules a cell must follow\")"
    )


class Backend(ABC):
    device: str
    _full_task_s: Mapping[str, float] = MappingProxyType({})  # until time_full_tasks

    @property
    @abstractmethod
    def arenas(self) -> list[ArenaInfo]: ...

    @property
    @abstractmethod
    def signal_name(self) -> str | None:
        """Shared-memory name of the signal counter, announced at registration.

        The manager does not map it: completions reach the manager as notices.
        """

    @abstractmethod
    def warm_up(self) -> None:
        """Materialize every (cell type, batch size) once before serving."""

    def time_full_tasks(self, specs: list[CellTypeSpec], ids: dict[ValueKind, tuple[int, int]]) -> None:
        """Time each cell type's full task through the stream, as serving runs it; the last step of warm-up."""
        self._full_task_s = time_full_tasks(specs, ids, self._through_stream)

    def _through_stream(self, task: TaskMessage) -> None:
        """Run one task the way serving does (issued, run on the stream, its completion awaited), before
        serving starts: the poller starts from the signal counter's value at registration, so a task that
        does not finish in time fails start-up."""
        seen = self.signal()
        self.issue(task)
        self.wait_for_signal(seen, FULL_TASK_TIMEOUT_S)
        if self.signal() <= seen:  # a late signal would later be taken for a served task's
            raise RuntimeError(f"a warm-up task did not finish within {FULL_TASK_TIMEOUT_S:.0f} s on {self.device}")
        error = self.finish(task.task_id)
        if error is not None:
            raise RuntimeError(f"a warm-up task failed on {self.device}: {error}")

    def full_task_seconds(self) -> dict[str, float]:
        """Seconds per task of each cell type at its largest batch, timed at warm-up (time_full_tasks)."""
        return dict(self._full_task_s)

    @property
    @abstractmethod
    def cells(self) -> tuple[list[CellTypeSpec | None], list[torch.nn.Module | None]]:
        """The cell types by index and their modules, which run-time loads extend and unloads empty."""

    def _place(self, cells: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """Modules loaded at run time, made ready to run on this backend's stream."""
        return cells

    def add_cells(self, first: int, specs: list[CellTypeSpec], cells: list[torch.nn.Module]) -> None:
        """A version loaded at run time: its cell types take the indices from `first` on. Indices before it that
        this worker never loaded (versions gone before it joined) stay empty: the manager sends them no task."""
        own_specs, own_cells = self.cells
        if first < len(own_cells):
            raise ValueError(f"cell types from index {first} on are already loaded here (up to {len(own_cells) - 1})")
        placed = self._place(cells)
        gap = first - len(own_cells)
        own_specs.extend([None] * gap + list(specs))
        own_cells.extend([None] * gap + placed)

    def drop_cells(self, indices: list[int]) -> None:
        """Forget the modules of cell types nothing will run again (a version unloaded): their weights go."""
        _, own_cells = self.cells
        for index in indices:
            if 0 <= index < len(own_cells):
                own_cells[index] = None

    @abstractmethod
    def attach_peer(self, worker_id: int, arenas: list[dict[str, Any]]) -> str | None:
        """Open another worker's device arenas (as announced at its registration) to read values produced there;
        returns why they cannot be read from here (None once they can), for the manager to place requests by."""

    @abstractmethod
    def detach_peer(self, worker_id: int) -> None:
        """Forget a peer that has gone away."""

    @abstractmethod
    def issue(self, task: TaskMessage | LaneTaskMessage) -> None:
        """Enqueue all of a task's work on the stream, ending with the signal write. Never blocks on the device."""

    @abstractmethod
    def signal(self) -> int:
        """How many issued tasks the stream has finished."""

    @abstractmethod
    def wait_for_signal(self, seen: int, timeout: float) -> None:
        """Return once the signal exceeds `seen` or after `timeout` seconds, without burning a core."""

    def report_from_stream(self, report: Callable[[int], None]) -> bool:
        """Have the stream itself call `report(signal)` after each task, in place of a poller
        watching the signal; returns False where the stream cannot run host code (a device)."""
        return False

    @abstractmethod
    def finish(self, task_id: int) -> str | None:
        """Host-side completion of a finished task; returns its error message, if it failed."""

    def kernel_busy_us(self) -> int | None:
        """Microseconds the stream's cell calls have taken so far, sent in every notice and heartbeat; None
        where they are not timed (a device runs them asynchronously: the host never sees one end)."""
        return None

    def kernel_clock(self) -> KernelClock | None:
        """A clock for cells this device runs outside the stream (the running batch's), counted in
        `kernel_busy_us`; None where cells are not timed."""
        return None

    @abstractmethod
    def read_io(self, arena_id: int, slots: np.ndarray) -> bytes:
        """Rows of an io arena, for a finished task's notice (the manager on another host cannot map them)."""

    @abstractmethod
    def close(self) -> None: ...
