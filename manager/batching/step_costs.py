"""What one step of a cell type costs on a worker, for the scheduler to bound multi-step tasks.

A multi-step task holds its worker for all its steps, and a request that arrives meanwhile waits
for it: the scheduler keeps a task's expected duration under `[scheduler] max_join_delay_us`. A
step's cost is measured per (cell type, padded batch size) on completed tasks, as seconds of busy
time per step, smoothed over recent tasks: a lane task's busy time as its worker timed it (the
completion notice says), a task of waves' as the manager timed it (the busy time admission's
expected wait measures, manager.batching.admission, which counts the manager's lag in reading notices and so
keeps a saturated worker's tasks of waves single steps). Until a
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

    def record(self, key: str, batch_size: int, steps: int, busy_s: float) -> None:
        """A task of `steps` steps, the first at `batch_size`, kept its worker busy `busy_s` seconds."""
        cost = busy_s / steps
        previous = self._measured.get((key, batch_size))
        self._measured[(key, batch_size)] = cost if previous is None else previous + SMOOTHING * (cost - previous)

    def seconds(self, key: str, batch_size: int) -> float | None:
        """Expected seconds of one step of cell type `key` at `batch_size`; None without an estimate."""
        measured = self._measured.get((key, batch_size))
        return measured if measured is not None else self._assumed.get(key)
