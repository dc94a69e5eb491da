"""A session's requests in turn, whichever path runs them: the batching core's tasks, or a worker's running batch
(manager.loop.routing). One runs at a time, in arrival order; the later ones wait, unadmitted, in the session store
(manager.batching.sessions), and each is admitted once the one before it is answered, with the state that one left
as its initial state. Each path gives its own way to run a request whose turn came; the store is the core's, one
record of every session whichever path its requests take."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batchmaker.common.protocol import RequestError
from batchmaker.manager.batching.outcomes import Answered, Outcome, Partial, Refused, Replayed
from batchmaker.manager.batching.sessions import SessionStore, Waiting

Run = Callable[[Waiting, dict[str, Any]], Any]  # run a request whose turn came, on these inputs; RequestError refuses


class SessionTurns:
    """A path's session requests: admitted in turn through `run`, and the sessions following their outcomes."""

    def __init__(self, store: SessionStore, run: Run):
        self.store = store
        self._run = run

    def arrive(self, waiting: Waiting) -> Any:
        """A checked session request: what `run` returned if its session is idle and it runs now, else None (it
        waits for its turn). What it asks of its session is checked at its turn; RequestError refuses it."""
        self.store.check(waiting.model, waiting.inputs)
        if self.store.busy(waiting.fields.name):
            self.store.wait(waiting)
            return None
        return self._start(waiting)

    def _start(self, waiting: Waiting) -> Any:
        session = self.store.turn(waiting.model, waiting.fields)
        ran = self._run(waiting, self.store.inputs(session, waiting.inputs))
        self.store.started(session, waiting.fields, waiting.model.name, (waiting.client, waiting.request_id))
        return ran

    def resume(self, name: str) -> list[Outcome]:
        """Admit the requests waiting for session `name` in turn, until one runs or none is left; returns the
        refusals of those that cannot be admitted now."""
        refused: list[Outcome] = []
        while (waiting := self.store.next_waiting(name)) is not None:
            try:
                self._start(waiting)
                break
            except RequestError as error:
                refused.append(Refused(waiting.client, waiting.request_id, error))
        return refused

    def follow(self, outcomes: list[Outcome]) -> list[Outcome]:
        """The outcomes, with the sessions following them: a session's answered request leaves its final state to
        the session (its reply says the session's step), a failed one leaves the state as it was, and the session's
        next request is admitted."""
        followed: list[Outcome] = []
        now = time.perf_counter()
        for outcome in outcomes:
            if isinstance(outcome, (Replayed, Partial, Refused)):
                followed.append(outcome)
                continue
            key = (outcome.request.client, outcome.request.request_id)
            if not self.store.is_running(key):
                followed.append(outcome)
            elif isinstance(outcome, Answered):
                name, step = self.store.answered(key, outcome.outputs, now)
                followed += [outcome._replace(session_step=step), *self.resume(name)]
            else:
                followed += [outcome, *self.resume(self.store.failed(key, now))]
        return followed
