"""The request processor: admits requests, follows their progress and finishes them.

Admitting a request gives it a row in the request table and copies its plan into the plan
store (no Python object per cell); its policy then releases its lanes to the scheduler. At a
task's completion the processor reads the host copies, lets the model observe watched values,
concludes the requests whose results are all in, and forgets requests that are concluded and
have nothing left in flight, freeing their arena rows. What it concludes (answers, errors,
replays, and the partial replies of streamed requests) it keeps as outcomes until the batching
core takes them (manager.batching.core).

A streamed request (`stream: true`) whose values arrived is noted; `stream_partials`, once per
event loop turn, asks its model which outputs became final (`Planner.partial_outputs`) and makes
one partial reply of them, so that a request gets at most one partial per turn however many
tasks completed. Its answer is preceded by a last partial with what the turn added.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from batchmaker.common.protocol import INTERNAL, RequestError
from batchmaker.manager.batching.dispatch import Dispatcher
from batchmaker.manager.batching.outcomes import Answered, Failed, Outcome, Partial, Replayed, request_timing
from batchmaker.manager.batching.plan_store import PlanStore
from batchmaker.manager.batching.policies import Policy
from batchmaker.manager.batching.records import Lifecycle, Request, Task
from batchmaker.manager.batching.request_table import RequestTable
from batchmaker.manager.batching.worker_handle import WorkerHandle


class RequestProcessor:
    def __init__(self, table: RequestTable, store: PlanStore, dispatcher: Dispatcher, policy: Policy):
        self._table = table
        self._store = store
        self._dispatcher = dispatcher
        self._policy = policy
        self._outcomes: list[Outcome] = []
        self._streams_changed: dict[Request, None] = {}  # streamed requests with values read since their last partial
        self.unsubmitted_nodes = 0  # admitted and not yet issued to a worker (admission control)

    def admit(self, requests: list[Request]) -> None:
        """Track validated requests, in order (their `deadline` a perf_counter time); their policy decides
        when their cells run."""
        rows = self._table.add(requests)
        self._store.add(requests, rows, lambda: self._table.others(requests))
        self.unsubmitted_nodes += sum(request.unfolded.plan.nodes for request in requests)
        self._policy.admit(requests)

    def take_outcomes(self) -> list[Outcome]:
        """What was concluded since the last call, in order."""
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def task_submitted(self, task: Task) -> None:
        self.unsubmitted_nodes -= task.nodes

    def task_finished(self, task: Task, error: str | None) -> None:
        """A worker finished the task: its host copies (read by the dispatcher) become results and observed
        values, and requests progress, finish and are forgotten."""
        copies = self._dispatcher.read_copies(task)
        table, rows = self._table, task.rows
        table.task_ended(rows, task.counts)
        if error is not None:
            for request in [table.requests[row] for row in rows]:
                self.fail(request, RequestError(INTERNAL, f"a worker failed to run {task.spec.key}: {error}"))
        else:
            finished: dict[Request, None] = {}  # answers this task completed, made together
            watched = []
            for copy in copies:
                if type(copy[1]) is str:
                    copy[0].results[copy[1]] = copy[2]
                else:
                    watched.append(copy)
            for request, watch_index, value in watched:
                if request.lifecycle is not Lifecycle.RUNNING or request in finished:
                    continue
                try:
                    done = request.model.observe(request.unfolded, watch_index, value)
                except Exception as exc:  # a model bug fails its request, never the manager
                    self._model_failed(request, exc)
                    continue
                if request.stream:
                    self._streams_changed[request] = None
                if done:
                    finished[request] = None
            for request, key, _ in copies:
                if request.stream and not request.done:
                    self._streams_changed[request] = None
                if (
                    type(key) is str
                    and request.lifecycle is Lifecycle.RUNNING
                    and not request.unfolded.plan.watched
                    and len(request.results) == request.results_pending
                ):
                    finished[request] = None
            if self._policy.holds_answers:
                for request in finished:
                    request.lifecycle = Lifecycle.HELD
            answered, stopped = self._policy.answers(list(finished))
            self._stop(stopped)
            self._answer(answered)
            self._answer(self._policy.task_ended(rows))
        drained = rows[(table.inflight[rows] == 0) & ~table.runnable[rows]]
        self._forget(
            [request for request in map(table.requests.__getitem__, drained.tolist()) if request and request.done]
        )

    def _answer(self, requests: list[Request]) -> None:
        """Answer requests together: one pass over the table for them all, then an outcome each."""
        for request in requests:
            if request.stream:
                self._send_partial(request)  # what the last turn added comes before the answer
        requests = [request for request in requests if not request.done]
        if not requests:
            return
        self._end(requests)
        earliest = self._table.unanswered.earliest_arrival()
        now = time.perf_counter()
        started = self._table.started[[request.row for request in requests]].tolist()
        for request, began in zip(requests, started):
            outputs = request.model.outputs(request.unfolded, request.results)
            early = earliest is not None and earliest < request.arrival
            self._outcomes.append(Answered(request, outputs, request_timing(request.arrival, began, now), early))
        self._forget_if_drained(requests)

    def stream_partials(self, client_waiting: Callable[[bytes], bool]) -> None:
        """One partial reply for each streamed request whose outputs grew since its last one; a request
        whose client has replies waiting unread keeps its news for a later turn, one partial then."""
        for request in list(self._streams_changed):
            if request.done:
                del self._streams_changed[request]
            elif not client_waiting(request.client):
                self._send_partial(request)

    def _send_partial(self, request: Request) -> None:
        self._streams_changed.pop(request, None)
        try:
            outputs = request.model.partial_outputs(request.unfolded, request.results, request.streamed_rows)
        except Exception as exc:  # a model bug fails its request, never the manager
            self._model_failed(request, exc)
            return
        if outputs is None and not request.restarted:
            return
        self._outcomes.append(Partial(request, outputs or {}, request.restarted))
        request.streamed_rows += len(next(iter(outputs.values()))) if outputs else 0
        request.restarted = False

    def _model_failed(self, request: Request, exc: Exception) -> None:
        self.fail(request, RequestError(INTERNAL, f"{type(exc).__name__} in {request.model.name}: {exc}"))

    def fail(self, request: Request, error: RequestError) -> None:
        if request.done:
            return
        held = request.lifecycle is Lifecycle.HELD
        self._end([request])
        self._outcomes.append(Failed(request, error))
        self._forget_if_drained([request])
        self._answer(self._policy.left(request, held))

    def _end(self, requests: list[Request]) -> None:
        """The requests will run no more cells: they are answered (or failed, or replaced)."""
        self._stop(requests)
        for request in requests:
            request.lifecycle = Lifecycle.DONE
        self._table.conclude(requests)

    def _stop(self, requests: list[Request]) -> None:
        """Their lanes leave the scheduler's queues; nodes not yet issued never will be."""
        if not requests:  # most tasks stop none: a task's answers stop their requests in `_end`
            return
        table = self._table
        rows = np.array([request.row for request in requests], np.int64)
        waiting = np.array([self._policy.waits_for_group(request) for request in requests], bool)
        queued = table.runnable[rows] | waiting
        nodes = np.array([request.unfolded.plan.nodes for request in requests], np.int64)
        self.unsubmitted_nodes -= int((nodes - table.issued[rows])[queued].sum())
        table.stop_lanes(rows[queued])
        table.set_runnable(rows[~queued], False)

    def _forget_if_drained(self, requests: list[Request]) -> None:
        self._forget([request for request in requests if self._table.inflight[request.row] == 0])

    def _forget(self, requests: list[Request]) -> None:
        """Nothing of them is in flight any more: their arena rows and plans go."""
        gone = self._table.remove(requests)
        if gone:
            self._dispatcher.release_rows(gone)
            self._store.release(gone)

    def worker_lost(self, worker: WorkerHandle, tasks: list[Task]) -> list[Request]:
        """Write off a dead worker's tasks in flight; return the unanswered requests that had values there."""
        table = self._table
        for task in tasks:
            table.task_ended(task.rows, None)
        affected = []
        for request in list(table.live.values()):
            if worker.worker_id in request.rows:
                del request.rows[worker.worker_id]  # its rows went with it
                if request.done:
                    self._forget_if_drained([request])
                else:
                    affected.append(request)
        return affected

    def replay(self, request: Request) -> Request:
        """Start a request over from its inputs; the old record is dropped without a reply, and the
        new one takes its place in the request table (the outcome Replayed says so)."""
        held = request.lifecycle is Lifecycle.HELD
        self._end([request])
        self._forget_if_drained([request])
        self._answer(self._policy.left(request, held))
        unfolded = self._policy.unfold(request.model, request.inputs)
        replayed = Request(
            request.client, request.request_id, request.model, request.inputs, unfolded, request.arrival,
            request.deadline, request.priority, request.stream,
        )  # fmt: skip
        self.admit([replayed])
        replayed.failures = request.failures
        replayed.restarted = request.streamed_rows > 0 or request.restarted  # its client must drop what was streamed
        self._outcomes.append(Replayed(replayed))
        return replayed

    def requests_of(self, task: Task) -> list[Request]:
        """The requests a task holds nodes of, in the order of its rows (tracing, tests and introspection)."""
        return [self._table.requests[row] for row in task.rows]

