"""Requests the manager routed to this worker whole: planned here, run in the running batch, answered from here.

An answer is `[handle, outputs, None, compute_us]` or `[handle, None, [code, message], compute_us]`, `compute_us`
the microseconds from its joining the running batch to the answer (0 if it never joined): the manager counts the
rest of its time as queueing. A request whose inputs its model refuses is answered with the model's error, as the
manager's own planning would have. A streamed request's
outputs that became final at a step go out as a partial, `[handle, outputs]` (the model's `partial_outputs` from
the rows sent so far on), its last one just before its answer.

A running batch holds at most its window of requests at once (common.window); those beyond it wait here, planned,
and join as others leave, the higher priority first: in the batch they would wait for a place in a step all the
same. The requests of a message are planned one by one, then join together (RunningBatch.admit_many), as do those
that join when others leave at a step: joining costs per message and per step, not per request.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.models.base import Planner
from batchmaker.common.plan import Unfolded
from batchmaker.common.protocol import INTERNAL, NO_ROOM, RequestError
from batchmaker.common.window import window
from batchmaker.worker.batched_task import KernelClock
from batchmaker.worker.chain_runs import DEFAULT_BOUNDS, ChainBounds
from batchmaker.worker.joining import Joining
from batchmaker.worker.running_batch import RunningBatch

Answer = list[Any]
Partial = list[Any]
TOO_LARGE = "the request needs more arena rows than the worker has: its values take rows for all its steps at once"


class Routed(NamedTuple):
    """A request the manager routed to this worker whole, as its frame of a `requests` message holds it."""

    handle: int
    model: str
    inputs: Any
    priority: int = 0
    stream: bool = False


class Replies(NamedTuple):
    """What a step or a message of routed requests gives the manager: partials, to be sent before the answers."""

    partials: list[Partial]
    answers: list[Answer]


class HeldRequests:
    """The routed requests a worker holds: those in its running batch, and those planned and waiting for rows."""

    def __init__(
        self, planners: dict[str, Planner], specs: list[CellTypeSpec], cells: list[torch.nn.Module],
        kinds: list[ValueKind], rows: int, device: str = "cpu", clock: KernelClock | None = None,
        chains: ChainBounds = DEFAULT_BOUNDS,
    ):  # fmt: skip
        self._planners = planners
        self.batch = RunningBatch(specs, cells, kinds, rows, device, clock, chains)
        self._planner_of: dict[int, Planner] = {}
        # planned, waiting to join (for rows, or for room in the window), with their priorities:
        self._waiting: collections.OrderedDict[int, tuple[Unfolded, int]] = collections.OrderedDict()
        self._waiting_prioritized = 0  # of them, those with a priority other than 0
        self._window = window(specs)
        self._streamed: dict[int, int] = {}  # per streamed request held: the rows of its outputs sent so far
        self._joined_at: dict[int, float] = {}  # per request in the running batch: when it joined

    @property
    def busy(self) -> bool:
        return bool(self._planner_of)

    def take_many(self, routed: Iterable[Routed]) -> list[Answer]:
        """Routed requests (a message of them): each planned and held, answered at once with its error if it cannot
        be planned; then those that fit join the running batch together, so that joining costs per message. With
        `stream`, a request's outputs go out in partials as they become final (its model can stream: the manager
        checked)."""
        answers = []
        for handle, model, inputs, priority, stream in routed:
            planner = self._planners.get(model)
            try:
                if planner is None:
                    raise RequestError(INTERNAL, f"this worker does not serve model {model!r}")
                unfolded = planner.plan(inputs)
            except RequestError as error:
                answers.append(self._answer(handle, None, [error.code, error.message]))
                continue
            except Exception as exc:  # a model's bug costs its request, never the worker
                answers.append(self._answer(handle, None, [INTERNAL, f"{type(exc).__name__} in {model}: {exc}"]))
                continue
            self._planner_of[handle] = planner
            self._waiting[handle] = unfolded, priority
            self._waiting_prioritized += priority != 0
            if stream:
                self._streamed[handle] = 0
        return answers + self._join()

    def add_model(self, planner: Planner, specs: list[CellTypeSpec], cells: list[torch.nn.Module],
                  kinds: list[ValueKind]) -> None:  # fmt: skip
        """A version the manager loaded while this worker runs: its requests are routed here from now on."""
        self.batch.add_cell_types(specs, cells, kinds)
        self._planners[planner.name] = planner
        self._window = max(self._window, window(specs))

    def unload(self, keys: list[str]) -> None:
        """The cell types of a version the manager unloaded (none of its requests is held): their modules go, and
        the planner of a model none of whose cell types is left."""
        self.batch.types.drop(keys)
        gone = set(keys)
        for name, planner in list(self._planners.items()):
            if set(planner.cell_types) <= gone:
                del self._planners[name]

    def drop(self, handles: list[int]) -> None:
        """Requests the manager ended (cancelled, expired, their client gone): let them go unanswered."""
        for handle in handles:
            self._streamed.pop(handle, None)
            self._joined_at.pop(handle, None)
            if self._planner_of.pop(handle, None) is not None and not self._unwait(handle):
                self.batch.remove(handle)

    def _join(self) -> list[Answer]:
        """Waiting requests join the running batch, together, while it holds fewer than its window and their rows
        fit: the higher priority first, then in the order they came. One whose rows do not fit waits for others to
        leave, and those after it with it; one too large for the empty batch is answered at once."""
        answers = []
        while self._waiting and self.batch.requests < self._window:
            turn = self._in_turn(self._window - self.batch.requests)
            joining = turn[: self.batch.fitting(self._waiting[handle][0] for handle in turn)]
            if joining or self.batch.requests:
                self._admit(joining)
                break
            self._unwait(turn[0])
            answers.append(self._failed(turn[0], TOO_LARGE, NO_ROOM))  # the manager runs its steps
        return answers

    def _admit(self, handles: list[int]) -> None:
        """The waiting requests `handles` join the running batch at once."""
        joining = []
        for handle in handles:
            unfolded, priority = self._waiting[handle]
            self._unwait(handle)
            observe = self._planner_of[handle].observe if unfolded.plan.watched else None
            joining.append(Joining(handle, unfolded, observe, priority))
        self.batch.admit_many(joining)
        self._joined_at.update(dict.fromkeys(handles, time.perf_counter()))

    def _in_turn(self, count: int) -> list[int]:
        """The first `count` waiting requests in the order they join: in the order they came, or, when any has a
        priority, by it (the first of equals first)."""
        if not self._waiting_prioritized:
            return list(itertools.islice(self._waiting, count))
        return heapq.nsmallest(count, self._waiting, key=lambda handle: -self._waiting[handle][1])

    def _unwait(self, handle: int) -> bool:
        """Take the request off the waiting ones; False if it was not waiting."""
        waited = self._waiting.pop(handle, None)
        if waited is not None:
            self._waiting_prioritized -= waited[1] != 0
        return waited is not None

    def step(self) -> Replies:
        """One step of the running batch: the partials of the streamed requests whose outputs grew, and the
        answers of the requests it finished."""
        replies = Replies([], [])
        with torch.inference_mode():
            finished = self.batch.step()
        if self._streamed:
            for handle in self.batch.updated():
                if handle in self._streamed:
                    held = self.batch.get(handle)
                    error = self._partial(handle, held.unfolded, held.results, replies.partials)
                    if error is not None:
                        self.batch.remove(handle)
                        replies.answers.append(self._failed(handle, error))
        for handle, unfolded, results, error in finished:
            if error is None and handle in self._streamed:
                error = self._partial(handle, unfolded, results, replies.partials)  # its last rows, before the answer
            if error is not None:
                replies.answers.append(self._failed(handle, error))
                continue
            planner = self._planner_of.pop(handle)
            self._streamed.pop(handle, None)
            try:
                replies.answers.append(self._answer(handle, planner.outputs(unfolded, results), None))
            except Exception as exc:  # a model's bug costs its request, never the worker
                error = f"{type(exc).__name__} in {planner.name}: {exc}"
                replies.answers.append(self._answer(handle, None, [INTERNAL, error]))
        if finished:
            replies.answers.extend(self._join())
        return replies

    def _partial(self, handle: int, unfolded: Unfolded, results: dict, partials: list[Partial]) -> str | None:
        """The streamed request's outputs final since its last partial, added to `partials` if any; the model's
        error if it fails."""
        planner = self._planner_of[handle]
        try:
            outputs = planner.partial_outputs(unfolded, results, self._streamed[handle])
        except Exception as exc:  # a model's bug costs its request, never the worker
            return f"{type(exc).__name__} in {planner.name}: {exc}"
        if outputs:
            partials.append([handle, outputs])
            self._streamed[handle] += len(next(iter(outputs.values())))
        return None

    def _failed(self, handle: int, error: str, code: str = INTERNAL) -> Answer:
        del self._planner_of[handle]
        self._streamed.pop(handle, None)
        return self._answer(handle, None, [code, error])

    def _answer(self, handle: int, outputs: dict[str, Any] | None, error: list[str] | None) -> Answer:
        """The answer of a request that leaves, with the microseconds since it joined the running batch."""
        joined = self._joined_at.pop(handle, None)
        return [handle, outputs, error, 0 if joined is None else int((time.perf_counter() - joined) * 1e6)]
