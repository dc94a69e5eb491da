"""The event loop's side of requests routed whole to the workers' running batches (manager.batching.routed).

With `[scheduler] running_batch = "worker"`, every `infer` request is refused from the expected wait before any
other check (refusing costs a comparison once the message is decoded), or checked and routed to the worker holding
the fewest requests, one message per worker and burst; a session's requests take their turns as in the batching
core (manager.batching.session_turns, on the core's session store), each routed with its session's state once the
one before it is answered. Workers answer on the control socket; this module turns those answers, and the ends a
request meets before its answer (cancel, deadline, client gone, shutdown, its worker lost), into the outcomes the
event loop replies with and counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batchmaker.common.config import Config, ConfigError
from batchmaker.common.graph import CellTypeSpec
from batchmaker.common.models.base import Planner
from batchmaker.common.protocol import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    NO_ROOM,
    OVERLOADED,
    UNAVAILABLE,
    WORKER_LOST,
    RequestError,
)
from batchmaker.common.window import window
from batchmaker.manager.batching.admission import check_room, deadline_of, inputs_of, stream_and_priority
from batchmaker.manager.batching.core import BatchingCore
from batchmaker.manager.batching.outcomes import Answered, Failed, Outcome, Partial, Replayed, request_timing
from batchmaker.manager.batching.routed import Routed, RoutedRequests
from batchmaker.manager.batching.session_turns import SessionTurns
from batchmaker.manager.batching.sessions import Waiting, session_fields
from batchmaker.manager.batching.worker_handle import WorkerHandle
from batchmaker.manager.loop.frontend import Incoming
from batchmaker.manager.loop.worker_pool import WorkerPool

Refusal = tuple[Incoming, RequestError, int | None]  # a request refused, why, and when to come back (ms)


class Router:
    """Routes requests to the workers' running batches and concludes them; idle unless the config asks for it."""

    def __init__(self, config: Config, core: BatchingCore, pool: WorkerPool, specs: list[CellTypeSpec]):
        """`specs`: the cell types the workers started with (their running batches' window)."""
        if config.scheduler.running_batch not in ("manager", "worker"):
            raise ConfigError(
                f"running_batch = {config.scheduler.running_batch!r} is resolved from the workers' devices by "
                "`batchmaker serve`; a manager started alone needs --running-batch manager or worker"
            )
        self.enabled = config.scheduler.running_batch == "worker"
        self._server = config.server
        self._core = core
        self._pool = pool
        self.table = RoutedRequests(config.server.max_queue_delay_ms, window(specs))
        self._turns = SessionTurns(core.sessions, self._run_in_session)  # the core's record of every session

    def admit(self, burst: list[Incoming]) -> tuple[list[Incoming], list[Incoming], list[Refusal]]:
        """Route the burst's requests (a session's in its turn: it may wait for the one before it); returns the
        others, for the batching core (all of them when the workers do not run their own batches), those routed or
        waiting for their turn, and the refused ones with their errors and, for those OVERLOADED by the expected
        wait, when to come back (ms)."""
        if not self.enabled or not self._core.workers:
            return burst, [], []
        routed, refused = [], []
        rate, workers = self.table.answer_rate(), len(self._core.workers)  # a burst brings no answers: read once
        for incoming in burst:
            message, client, request_id = incoming.message, incoming.client, incoming.request_id
            # Refused from the expected wait before any other work; a session's request is checked when its turn comes.
            overload = None if "session" in message else self.table.overload(workers, rate)
            if overload is not None:
                refused.append((incoming, overload))
                continue
            try:
                fields = session_fields(message)
                pinned = None if fields is None or fields.start else self._core.sessions.model_of(fields.name)
                planner = self._core.versions.resolve(message.get("model"), message.get("version"), pinned)
                self._core.check_id(client, request_id, self.table)
                inputs = inputs_of(message, planner)
                stream, priority = stream_and_priority(message, planner)
                deadline_ms = deadline_of(message, self._server.default_deadline_ms)
                check_room(self._core.in_flight + len(self.table), self._server.max_queued_requests)
                checked = (client, request_id, planner, inputs)
                if fields is None:
                    self.table.check_deadline(deadline_ms, rate)
                    self._route(*checked, incoming.arrival, deadline_ms, priority, stream)
                else:  # routed now, or when the session's request before it is answered
                    self._turns.arrive(Waiting(*checked, fields, incoming.arrival, deadline_ms, priority, stream))
            except RequestError as error:
                refused.append((incoming, error))
                continue
            routed.append(incoming)
        self.flush()
        overloaded = sum(error.code == OVERLOADED for _, error in refused)
        quotes = iter(self.table.retry_after_ms(overloaded) if overloaded else ())
        refusals = [(i, error, next(quotes, None) if error.code == OVERLOADED else None) for i, error in refused]
        return [], routed, refusals

    def _route(
        self, client: bytes, request_id: Any, planner: Planner, inputs: Any, arrival: float, deadline_ms: int | None,
        priority: int, stream: bool,
    ) -> None:  # fmt: skip
        """Route a checked request to the worker holding the fewest."""
        deadline = arrival + deadline_ms / 1e3 if deadline_ms is not None else None
        routed = Routed(client, request_id, planner, inputs, arrival, deadline, priority, stream)
        self.table.route(routed, list(self._core.workers))

    def _run_in_session(self, waiting: Waiting, inputs: dict[str, Any]) -> None:
        """A session's request whose turn came, on its session's state, unless the expected wait refuses it."""
        rate = self.table.answer_rate()
        overload = self.table.overload(len(self._core.workers), rate)
        if overload is not None:
            raise overload
        self.table.check_deadline(waiting.deadline_ms, rate)
        self._route(waiting.client, waiting.request_id, waiting.model, inputs, waiting.arrival, waiting.deadline_ms,
                    waiting.priority, waiting.stream)  # fmt: skip

    def flush(self) -> None:
        """Send the workers the requests routed to them and the ones they should let go."""
        sends, drops = self.table.take_sends()
        for worker_id, frames in sends.items():
            self._pool.route(self._core.workers[worker_id], frames)
        for worker_id, handles in drops.items():
            if worker_id in self._core.workers:
                self._pool.drop(self._core.workers[worker_id], handles)

    def answers(self, worker: WorkerHandle, answers: list[Any], partials: list[Any]) -> list[Outcome]:
        """A worker's answers ([handle, outputs, error, compute_us] each: compute_us since the request joined its
        running batch, the rest of its time counted as queueing) as outcomes, after its streamed requests' partials
        ([handle, outputs] each, kept to be sent once a turn); those of requests ended meanwhile dropped. A streamed
        request's news goes out in one partial just before its answer."""
        outcomes: list[Outcome] = []
        now = time.perf_counter()
        self.table.progressed(worker.worker_id)
        handed_back = 0
        for partial in partials:
            if isinstance(partial, list) and len(partial) == 2:
                self.table.partial(worker.worker_id, *partial)
        for answer in answers:
            if not isinstance(answer, list) or len(answer) != 4:
                continue
            handle, outputs, error, compute_us = answer
            request = self.table.answered(worker.worker_id, handle)
            if request is None:
                continue
            if error is None:
                news = self.table.last_partial(request) if request.stream else None
                if news is not None:
                    outcomes.append(Partial(request, *news))
                ran_s = compute_us / 1e6 if type(compute_us) is int and compute_us >= 0 else now - request.arrival
                timing = request_timing(request.arrival, max(request.arrival, now - ran_s), now)
                outcomes.append(Answered(request, outputs, timing, self.table.older_in_flight(request)))
            elif error[0] == NO_ROOM:
                handed_back += 1
                outcomes += self._take_over(request)
            else:
                outcomes.append(Failed(request, RequestError(*error)))
        worker.running_batch_answered(len(answers) - handed_back)
        return self._followed(outcomes)

    def _take_over(self, request: Routed) -> list[Outcome]:
        """A request too large for its worker's running batch goes to the batching core, whose steps hold a few
        lanes' rows at a time; refused by its limits, it fails with their error."""
        try:
            self._core.take_over(request)
        except RequestError as error:
            return [Failed(request, error)]
        except Exception as exc:  # a model's bug costs its request, never the server
            return [Failed(request, RequestError(INTERNAL, f"{type(exc).__name__} in {request.model.name}: {exc}"))]
        return []

    def partials(self, client_waiting: Callable[[bytes], bool]) -> list[Outcome]:
        """One partial for each streamed request whose outputs grew since its last one and whose client reads its
        replies."""
        return [Partial(*partial) for partial in self.table.partials(client_waiting)]

    def stalled(self) -> dict[int, float]:
        """Workers holding routed requests whose running batch has not advanced for `hang_timeout_ms`."""
        return self.table.stalled(self._server.hang_timeout_ms / 1e3)

    def cancel(self, client: bytes, request_id: Any) -> list[Outcome] | None:
        request = self.table.get(client, request_id)
        if request is None:
            return None
        return self._fail([request], RequestError(CANCELLED, "cancelled by the client"))

    def clients_gone(self, clients: set[bytes]) -> list[Outcome]:
        return self._fail(self.table.of_clients(clients), RequestError(CANCELLED, "the client disconnected"))

    def expire(self) -> list[Outcome]:
        return self._fail(self.table.expired(), RequestError(DEADLINE_EXCEEDED, "the request's deadline passed"))

    def shutdown(self) -> list[Outcome]:
        error = RequestError(UNAVAILABLE, "the server stopped before finishing the request; send it elsewhere")
        return self._fail(self.table.all(), error)

    def _fail(self, requests: list[Routed], error: RequestError) -> list[Outcome]:
        if not requests:  # most turns: the sessions have nothing to follow, nothing to send
            return []
        return self._followed([Failed(request, error) for request in self.table.end(requests)])

    def _followed(self, outcomes: list[Outcome]) -> list[Outcome]:
        """The outcomes, the sessions following them (their next requests routed), and what they route sent."""
        outcomes = self._turns.follow(outcomes)
        self.flush()
        return outcomes

    def worker_lost(self, worker: WorkerHandle, reason: str, draining: bool) -> list[Outcome]:
        """Send the lost worker's requests to the others, from their inputs (a request that lost more than
        `max_replays` workers fails, and all fail when none is left)."""
        outcomes: list[Outcome] = []
        for request in self.table.lost(worker.worker_id):
            request.failures += 1
            if request.failures > self._server.max_replays:
                why = f"it lost its worker {request.failures} times (last: {reason}); it is not replayed again"
                error = RequestError(INTERNAL, why)
            elif not self._core.workers:
                why = f"its worker was lost ({reason}) and none remains"
                error = RequestError(UNAVAILABLE if draining else WORKER_LOST, why)
            else:
                self.table.route(request, list(self._core.workers))
                outcomes.append(Replayed(request))
                continue
            self.table.forget_lost(request)
            outcomes.append(Failed(request, error))
        return self._followed(outcomes)
