"""What a task costs, for the scheduler to choose how long a multi-step task runs.

A multi-step task holds its worker for all its steps, and a request that arrives meanwhile waits
for it (manager.batching.join_delay says how long it may). A step's cost is measured per (cell type,
padded batch size) on completed tasks, as seconds of busy time per step, smoothed over recent tasks:
a lane task's busy time as its worker timed it (the completion notice says), a task of waves' as the
manager timed it (the busy time admission's expected wait measures, manager.batching.admission, which
counts the manager's lag in reading notices and so keeps a saturated worker's tasks of waves single
steps). Until a (cell type, batch size) has been measured, the workers' warm-up timing of the type's
largest batch stands in: no smaller batch costs more. With neither, there is no estimate and tasks
stay single steps: a delay that cannot be bounded is not taken.

A task also has a fixed cost, paid once whatever its steps: the manager's time to form, send and
complete it (timed by the manager's loop), and the worker's time to take it up (the intercept of its
busy time over its steps, fitted on the worker's own timings of tasks of the same cell type and batch
size with different step counts). Under load the scheduler makes tasks long enough that this cost is a
small share of their compute.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SMOOTHING = 0.2  # weight of the newest measurement: a few tasks follow a change, one outlier barely moves it
FIT_SMOOTHING = 0.05  # the same for the fit of busy time over steps: it needs tasks of several lengths


class _Fit:
    """A running least-squares line of a task's busy seconds over its steps, weighted toward recent tasks."""

    __slots__ = ("steps", "busy", "steps2", "steps_busy")

    def __init__(self, steps: int, busy_s: float):
        self.steps, self.busy, self.steps2, self.steps_busy = float(steps), busy_s, float(steps * steps), steps * busy_s

    def add(self, steps: int, busy_s: float) -> None:
        w = FIT_SMOOTHING
        self.steps += w * (steps - self.steps)
        self.busy += w * (busy_s - self.busy)
        self.steps2 += w * (steps * steps - self.steps2)
        self.steps_busy += w * (steps * busy_s - self.steps_busy)

    def intercept(self) -> float:
        """Busy seconds of a task of no steps (at least 0); 0 while the tasks seen had (nearly) one length."""
        spread = self.steps2 - self.steps * self.steps
        if spread < 0.25:  # steps' standard deviation under half a step: no slope to fit
            return 0.0
        slope = (self.steps_busy - self.steps * self.busy) / spread
        return max(0.0, self.busy - slope * self.steps)


class StepCosts:
    def __init__(self) -> None:
        self._measured: dict[tuple[str, int], float] = {}  # seconds per step, by (cell type, batch size)
        self._assumed: dict[str, float] = {}  # seconds of a largest-batch step, timed at warm-up
        self._fits: dict[tuple[str, int], _Fit] = {}  # a lane task's busy seconds over steps, by the same
        self._manager_s: dict[str, float] = {}  # the manager's seconds a task, by stage: sending, completing

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

    def record(self, key: str, batch_size: int, steps: int, busy_s: float, by_worker: bool = False) -> None:
        """A task of `steps` steps, the first at `batch_size`, kept its worker busy `busy_s` seconds
        (`by_worker`: as the worker timed it, which the fit of its fixed cost goes by)."""
        cost = busy_s / steps
        previous = self._measured.get((key, batch_size))
        self._measured[(key, batch_size)] = cost if previous is None else previous + SMOOTHING * (cost - previous)
        if by_worker:
            fit = self._fits.get((key, batch_size))
            if fit is None:
                self._fits[(key, batch_size)] = _Fit(steps, busy_s)
            else:
                fit.add(steps, busy_s)

    def record_manager(self, stage: str, seconds_per_task: float) -> None:
        """The manager spent `seconds_per_task` on each task of a batch at `stage` ("sent": formed and sent,
        "completed": its notice read and its requests advanced)."""
        previous = self._manager_s.get(stage, seconds_per_task)
        self._manager_s[stage] = previous + SMOOTHING * (seconds_per_task - previous)

    def seconds(self, key: str, batch_size: int) -> float | None:
        """Expected seconds of one step of cell type `key` at `batch_size`; None without an estimate."""
        measured = self._measured.get((key, batch_size))
        return measured if measured is not None else self._assumed.get(key)

    def fixed_seconds(self, key: str, batch_size: int) -> float:
        """A task's fixed cost, whatever its steps: the manager's time for it and the worker's intercept."""
        fit = self._fits.get((key, batch_size))
        return sum(self._manager_s.values()) + (fit.intercept() if fit is not None else 0.0)
