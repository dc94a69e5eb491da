"""What one step of a cell type costs on a worker, for the scheduler to bound multi-step tasks.

A multi-step task holds its worker for all its steps, and a request that arrives meanwhile waits
for it: the scheduler keeps a task's expected duration under `[scheduler] max_join_delay_us`. A step's cost is measured per (cell type, padded batch
size) on completed tasks, as seconds of the worker's busy time per step, as the worker timed it and
reported in its notice (common.task.CompletionNotice), smoothed over recent tasks. The worker's own
timing leaves out the round trip to the manager, which a request arriving during the task does not
wait for the task to make. The round trip is kept apart, as the time the manager saw a task hold its
worker beyond the worker's own: the work a worker already holds (Scheduler.queued_seconds) is its
tasks' steps and their round trips, which is what a request arriving there waits for. Until a
(cell type, batch size) has been measured, the workers' warm-up timing of the type's largest batch
stands in: no smaller batch costs more. With neither, there is no estimate and tasks stay single
steps: a delay that cannot be bounded is not taken.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SMOOTHING = 0.2  # weight of the newest measurement: a few tasks follow a change, one outlier barely moves it


class StepCosts:
    def __init__(self) -> None:
        self._measured: dict[tuple[str, int], float] = {}  # seconds per step, by (cell type, batch size)
        self._assumed: dict[str, float] = {}  # seconds of a largest-batch step, timed at warm-up
        self._round_trip: float | None = None  # a task's time beyond its steps: message, notice, the manager's turn

    def assume(self, timings: Iterable[Any]) -> None:
        """The workers' warm-up timings (each a map of cell type to the seconds of a largest-batch task);
        the slowest worker's counts, and a malformed timing counts nothing."""
        assumed: dict[str, float] = {}
        for timed in timings:
            if not isinstance(timed, dict):
                continue
            for key, seconds in timed.items():
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0:
                    assumed[key] = max(assumed.get(key, 0.0), float(seconds))
        self._assumed = assumed

    def completed(self, key: str, batch_size: int, steps: int, busy_s: float, held_s: float) -> None:
        """A task of `steps` steps, the first at `batch_size`, kept its worker busy `busy_s` seconds (the
        worker's timing) and held it `held_s` seconds as the manager saw it (submission to notice read)."""
        self._measured[(key, batch_size)] = _smoothed(self._measured.get((key, batch_size)), busy_s / steps)
        self._round_trip = _smoothed(self._round_trip, max(0.0, held_s - busy_s))

    def round_trip_s(self) -> float:
        """Expected seconds a task holds its worker beyond its steps (0 until a task has completed)."""
        return self._round_trip or 0.0

    def seconds(self, key: str, batch_size: int) -> float | None:
        """Expected seconds of one step of cell type `key` at `batch_size`; None without an estimate."""
        measured = self._measured.get((key, batch_size))
        return measured if measured is not None else self._assumed.get(key)


def _smoothed(previous: float | None, newest: float) -> float:
    return newest if previous is None else previous + SMOOTHING * (newest - previous)
