"""Server-held sessions: a chain model's final state kept in the manager from one request to the next.

A request naming a `session` continues from the final state (`h_n`, and `c_n` for an LSTM) of
that session's previous request: the manager keeps host copies of them from the reply and gives
them to the next request as its `h0` (`c0`). The state lives in the manager, never only on a
worker, so a worker lost mid-request costs nothing: the request replays from the same initial
state. Requests of one session run one at a time, in arrival order; the later ones wait here,
not yet admitted, until their turn (manager.batching.core admits them then). What a request asks
of its session's state (the step it continues, a start from zeros) is checked when its turn comes,
once the requests before it have been answered: a pipelined continuation is judged by the state
its predecessors leave, not by the state at its arrival.

A session idle for `session_ttl_ms` is dropped and leaves a tombstone (the last `max_sessions`
are remembered) so that its next request gets SESSION_LOST rather than a silent start from zero;
so does a request that says it continues from step n > 0 of a session this server does not know
(it restarted, or the session lives on another server). A request with `session_start` starts
the session from zeros when its turn comes, whatever the name held: a live session of that name,
or its tombstone, is forgotten at that moment. See docs/protocol.md, "Sessions".
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchmaker.common.protocol import (
    BAD_REQUEST,
    INVALID_INPUT,
    OVERLOADED,
    SESSION_LOST,
    RequestError,
    echo,
    is_tensor_map,
    map_to_tensor,
    optional_int,
)
from batchmaker.manager.batching.deadlines import Deadlines

MAX_SESSION_CHARS = 256  # a longer session name is refused: errors and logs echo it


@dataclass(frozen=True)
class SessionFields:
    """A request's session fields, checked."""

    name: str
    start: bool  # start from zeros, replacing whatever the name holds
    end: bool
    step: int | None


@dataclass
class Waiting:
    """A session's request, checked: admitted now if its session is idle, else when its turn comes."""

    client: bytes
    request_id: Any
    model: Any  # its Planner
    inputs: Any
    fields: SessionFields
    arrival: float  # perf_counter time
    deadline_ms: int | None
    priority: int
    stream: bool  # partial replies asked for (`stream: true`)
    done: bool = False  # taken from the waiting requests: admitted, refused or cancelled

    @property
    def deadline(self) -> float | None:
        return None if self.deadline_ms is None else self.arrival + self.deadline_ms / 1e3


@dataclass
class Session:
    name: str
    model: str
    step: int = 0  # requests of the session answered so far
    state: dict[str, np.ndarray] = field(default_factory=dict)  # by initial state input: h0, c0
    running: tuple[bytes, Any] | None = None  # (client, request id) of its request admitted and unanswered
    ending: bool = False  # its running request ends it once answered
    idle_since: float = 0.0


def session_fields(message: dict[str, Any]) -> SessionFields | None:
    """The request's `session`, `session_start`, `session_end` and `session_step`, or None if it names no session."""
    name = message.get("session")
    if name is None:
        for extra in ("session_start", "session_end", "session_step"):
            if extra in message:
                raise RequestError(BAD_REQUEST, f"'{extra}' needs 'session' (the session's name)")
        return None
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_SESSION_CHARS:
        raise RequestError(
            BAD_REQUEST, f"'session' must be a string of 1 to {MAX_SESSION_CHARS} characters, got {echo(name)}"
        )
    start, end = message.get("session_start", False), message.get("session_end", False)
    for key, value in (("session_start", start), ("session_end", end)):
        if not isinstance(value, bool):
            raise RequestError(BAD_REQUEST, f"'{key}' must be true or false, got {echo(value)}")
    step = optional_int(message, "session_step", minimum=0)
    if start and step:
        raise RequestError(
            BAD_REQUEST, f"'session_start' starts the session from zeros: it continues no step ('session_step' {step})"
        )
    return SessionFields(name, start, end, step)


def carries_state(model: Any) -> bool:
    """Whether the model takes initial states and returns final ones in one direction (a chain's h0 / h_n)."""
    described = model.describe()
    return (
        getattr(model, "directions", None) == 1
        and "h0" in described.get("inputs", {})
        and "h_n" in described.get("outputs", {})
    )


class SessionStore:
    def __init__(self, ttl_ms: int, max_sessions: int):
        self.ttl_s = ttl_ms / 1e3
        self.max_sessions = max_sessions
        self._live: dict[str, Session] = {}
        self._idle: collections.OrderedDict[str, Session] = collections.OrderedDict()  # least recently used first
        self._tombstones: collections.OrderedDict[str, str] = collections.OrderedDict()  # name -> why it was lost
        self._running: dict[tuple[bytes, Any], Session] = {}
        # Requests waiting for a running one of their session, by session name, oldest first. A queue is
        # never left behind an idle session: when the running request ends the next one is admitted.
        self._queues: dict[str, collections.deque[Waiting]] = {}
        self._waiting: dict[tuple[bytes, Any], Waiting] = {}
        self._deadlines: Deadlines[Waiting] = Deadlines()
        self._capable: dict[str, bool] = {}  # by model name

    def __len__(self) -> int:
        return len(self._live)

    @property
    def waiting(self) -> int:
        """Requests waiting for their session's running one to be answered."""
        return len(self._waiting)

    def holds(self, client: bytes, request_id: Any) -> bool:
        return (client, request_id) in self._waiting

    # -- admission -----------------------------------------------------------------------------
    def check(self, model: Any, inputs: Any) -> None:
        """Refuse, on arrival, a session request that no state of its session could make valid."""
        capable = self._capable.get(model.name)
        if capable is None:
            capable = self._capable[model.name] = carries_state(model)
        if not capable:
            raise RequestError(
                INVALID_INPUT,
                f"model {model.name!r} keeps no state between requests: sessions need a unidirectional "
                "lstm or gru chain",
            )
        if isinstance(inputs, dict) and ("h0" in inputs or "c0" in inputs):
            raise RequestError(
                INVALID_INPUT,
                "a session request starts from its session's state: send h0/c0 without 'session', or not at all",
            )

    def turn(self, model: Any, fields: SessionFields) -> Session | None:
        """The live session a request continues now that its turn came, or None for a new one; raises
        RequestError to refuse it. A start first forgets the session of its name, live or lost."""
        name = fields.name
        if fields.start:
            self._forget(name)
        session = self._live.get(name)
        if session is not None:
            if session.model != model.name:
                raise RequestError(INVALID_INPUT, f"session {echo(name)} belongs to model {session.model!r}")
            if fields.step is not None and fields.step > session.step:
                raise lost(name, f"this server holds it at step {session.step}, not {fields.step}")
            return session
        why = self._tombstones.get(name)
        if why is not None:
            raise lost(name, why)
        if fields.step:
            raise lost(
                name,
                f"this server holds no state for it (asked to continue from step {fields.step}): "
                "the server restarted, the session ended, or it lives on another server",
            )
        if len(self._live) >= self.max_sessions:
            raise RequestError(OVERLOADED, f"{len(self._live)} sessions live (limit {self.max_sessions}); retry later")
        return None

    def _forget(self, name: str) -> None:
        """Drop the session of this name (it runs no request) and its tombstone: a start replaces both."""
        session = self._live.pop(name, None)
        if session is not None:
            self._idle.pop(name, None)
        self._tombstones.pop(name, None)

    def model_of(self, name: Any) -> str | None:
        """The model (a version's internal name) a request of the session arriving now will run on: the latest
        waiting start's, else the live session's. A session's requests stay on the version it started on."""
        for waiting in reversed(self._queues.get(name, ())):
            if waiting.fields.start and not waiting.done:
                return waiting.model.name
        session = self._live.get(name)
        return None if session is None else session.model

    def models_in_use(self) -> set[str]:
        """The models the live sessions run on."""
        return {session.model for session in self._live.values()}

    def busy(self, name: str) -> bool:
        """Whether a request of this session runs, or waits: a new one must wait behind it."""
        session = self._live.get(name)
        return (session is not None and session.running is not None) or name in self._queues

    def wait(self, waiting: Waiting) -> None:
        """Hold a request until the requests of its session before it are answered."""
        self._queues.setdefault(waiting.fields.name, collections.deque()).append(waiting)
        self._waiting[(waiting.client, waiting.request_id)] = waiting
        deadline = waiting.deadline
        if deadline is not None:
            self._deadlines.add(deadline, waiting)

    @staticmethod
    def inputs(session: Session | None, inputs: dict[str, Any]) -> dict[str, Any]:
        """The request's inputs with the session's state as its initial state (arrays, as the model takes them)."""
        if session is None or not session.state:
            return inputs
        return {**inputs, **session.state}

    def started(self, session: Session | None, fields: SessionFields, model: str, key: tuple[bytes, Any]) -> None:
        """A request of the session (a new one if None) was admitted under `key`: it runs now."""
        if session is None:
            session = self._live[fields.name] = Session(fields.name, model)
        self._idle.pop(session.name, None)
        session.running, session.ending = key, fields.end
        self._running[key] = session

    # -- answers -------------------------------------------------------------------------------
    def is_running(self, key: tuple[bytes, Any]) -> bool:
        return key in self._running

    def answered(self, key: tuple[bytes, Any], outputs: dict[str, Any], now: float) -> tuple[str, int]:
        """The session's running request was answered: keep its final state (`h_n` as the next `h0`, ...).
        Returns the session's name and step; `session_end` forgets it here."""
        session = self._running.pop(key)
        session.step += 1
        session.state = {  # a worker's answer relayed as it came holds tensor maps
            f"{name[:-2]}0": np.array(map_to_tensor(value) if is_tensor_map(value) else value, np.float32)
            for name, value in outputs.items()
            if name.endswith("_n")
        }
        if session.ending:
            del self._live[session.name]
        else:
            self._rest(session, now)
        return session.name, session.step

    def failed(self, key: tuple[bytes, Any], now: float) -> str:
        """The session's running request failed: its state stays as it was. Returns the session's name."""
        session = self._running.pop(key)
        self._rest(session, now)
        return session.name

    def next_waiting(self, name: str) -> Waiting | None:
        """The oldest request waiting for session `name`, taken from the queue, once no request of it runs."""
        session = self._live.get(name)
        if session is not None and session.running is not None:
            return None
        queue = self._queues.get(name)
        while queue:
            waiting = queue.popleft()
            if not waiting.done:
                self.take((waiting.client, waiting.request_id))
                break
        else:
            waiting = None
        if not queue:
            self._queues.pop(name, None)
        return waiting

    def _rest(self, session: Session, now: float) -> None:
        session.running = None
        session.idle_since = now
        self._idle[session.name] = session

    # -- waiting requests ----------------------------------------------------------------------
    def take(self, key: tuple[bytes, Any]) -> Waiting | None:
        """Remove a waiting request (its turn came, it was cancelled, its deadline passed, its client left)."""
        waiting = self._waiting.pop(key, None)
        if waiting is not None:
            waiting.done = True
            self._deadlines.forget_done(len(self._waiting))
        return waiting

    def of_clients(self, clients: set[bytes]) -> list[Waiting]:
        return [self._waiting[key] for key in self._waiting if key[0] in clients]

    def all_waiting(self) -> list[Waiting]:
        return list(self._waiting.values())

    def wait_ms(self, longest: int) -> int:
        """How long the event loop may sleep before a waiting request's deadline (at most `longest`)."""
        return self._deadlines.wait_ms(longest)

    def past_deadline(self, now: float) -> list[Waiting]:
        """Waiting requests whose deadline has passed."""
        return list(self._deadlines.due(now))

    def expire(self, now: float) -> None:
        """Drop the sessions idle for longer than the TTL, leaving tombstones (the last `max_sessions`)."""
        horizon = now - self.ttl_s
        while self._idle:
            name, session = next(iter(self._idle.items()))
            if session.idle_since > horizon:
                return
            del self._idle[name], self._live[name]
            self._tombstones[name] = f"it was idle for more than session_ttl_ms ({self.ttl_s * 1e3:.0f} ms) and expired"
            while len(self._tombstones) > self.max_sessions:
                self._tombstones.popitem(last=False)


def lost(name: str, why: str) -> RequestError:
    return RequestError(
        SESSION_LOST, f"session {echo(name)} is lost: {why}; start it again from zeros with session_start"
    )
