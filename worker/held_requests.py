"""Requests the manager routed to this worker whole: planned here, run in the running batch, answered from here.

An answer is `[handle, outputs, None]` or `[handle, None, [code, message]]`: a request whose inputs its model
refuses is answered with the model's error, as the manager's own planning would have.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.models.base import Planner
from batchmaker.common.plan import Unfolded
from batchmaker.common.protocol import INTERNAL, RequestError
from batchmaker.worker.batched_task import KernelClock
from batchmaker.worker.running_batch import RunningBatch

Answer = list[Any]


class HeldRequests:
    """The routed requests a worker holds: those in its running batch, and those planned and waiting for rows."""

    def __init__(
        self, planners: dict[str, Planner], specs: list[CellTypeSpec], cells: list[torch.nn.Module],
        kinds: list[ValueKind], rows: int, device: str = "cpu", clock: KernelClock | None = None,
    ):  # fmt: skip
        self._planners = planners
        self.batch = RunningBatch(specs, cells, kinds, rows, device, clock)
        self._planner_of: dict[int, Planner] = {}
        # planned, waiting for rows, with their priorities:
        self._waiting: collections.OrderedDict[int, tuple[Unfolded, int]] = collections.OrderedDict()

    @property
    def busy(self) -> bool:
        return bool(self._planner_of)

    def take(self, handle: int, model: str, inputs: Any, priority: int = 0) -> list[Answer]:
        """A routed request: planned and held; answered at once with its error if it cannot be planned."""
        planner = self._planners.get(model)
        try:
            if planner is None:
                raise RequestError(INTERNAL, f"this worker does not serve model {model!r}")
            unfolded = planner.plan(inputs)
        except RequestError as error:
            return [[handle, None, [error.code, error.message]]]
        except Exception as exc:  # a model's bug costs its request, never the worker
            return [[handle, None, [INTERNAL, f"{type(exc).__name__} in {model}: {exc}"]]]
        self._planner_of[handle] = planner
        self._waiting[handle] = unfolded, priority
        return self._join()

    def drop(self, handles: list[int]) -> None:
        """Requests the manager ended (cancelled, expired, their client gone): let them go unanswered."""
        for handle in handles:
            if self._planner_of.pop(handle, None) is not None and self._waiting.pop(handle, None) is None:
                self.batch.remove(handle)

    def _join(self) -> list[Answer]:
        """Waiting requests join the running batch, in order, while their rows fit."""
        answers = []
        while self._waiting:
            handle, (unfolded, priority) = next(iter(self._waiting.items()))
            if not self.batch.fits(unfolded):
                if self.batch.requests:
                    break  # it joins when others leave
                del self._waiting[handle], self._planner_of[handle]
                answers.append([handle, None, [INTERNAL, "the request needs more arena rows than the worker has"]])
                continue
            del self._waiting[handle]
            planner = self._planner_of[handle]
            self.batch.admit(handle, unfolded, planner.observe if unfolded.plan.watched else None, priority)
        return answers

    def step(self) -> list[Answer]:
        """One step of the running batch: the answers of the requests it finished."""
        answers = []
        with torch.inference_mode():
            finished = self.batch.step()
        for handle, unfolded, results, error in finished:
            planner = self._planner_of.pop(handle)
            if error is not None:
                answers.append([handle, None, [INTERNAL, error]])
                continue
            try:
                answers.append([handle, planner.outputs(unfolded, results), None])
            except Exception as exc:  # a model's bug costs its request, never the worker
                answers.append([handle, None, [INTERNAL, f"{type(exc).__name__} in {planner.name}: {exc}"]])
        if finished:
            answers += self._join()
        return answers
