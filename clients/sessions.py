"""The client's side of server-held sessions: where each session lives, and the step it reached.

A session's state lives on one server, so a client with several addresses sends all of a
session's requests to the server its first one went to (while that server is up). And it sends
back the step the session reached, from its replies: a server that does not know a session (it restarted,
or another server behind a multi-address
client answered before) and is asked to continue from step n > 0 answers SESSION_LOST instead of
silently starting over from zero. SESSION_LOST is not retryable: it is never sent to another server.
And it counts each session's requests in flight: a refused one among several pipelined ones is not
resent later, as it would then run after those sent behind it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from .servers import Server


class SessionSteps:
    def __init__(self) -> None:
        self._steps: dict[str, int] = {}
        self._servers: dict[str, Server] = {}
        self._in_flight: Counter[str] = Counter()

    def sending(self, message: dict[str, Any]) -> None:
        """A request is sent (a session's counts)."""
        name = message.get("session")
        if isinstance(name, str):
            self._in_flight[name] += 1

    def settled(self, message: dict[str, Any]) -> None:
        """A request sent is answered or given up on."""
        name = message.get("session")
        if isinstance(name, str):
            self._in_flight[name] -= 1
            if self._in_flight[name] <= 0:
                del self._in_flight[name]

    def pipelined(self, message: dict[str, Any]) -> bool:
        """Whether another request of the message's session is in flight: this one must not be resent behind it."""
        name = message.get("session")
        return isinstance(name, str) and self._in_flight[name] > 1

    def server(self, session: str, pick: Callable[[], Server | None]) -> Server | None:
        """The server the session's next request goes to: the one its first went to (`pick` chooses it)."""
        server = self._servers.get(session)
        if server is None:
            server = pick()
            if server is not None:
                self._servers[session] = server
        return server

    def fields(self, session: str, end: bool) -> dict[str, Any]:
        """The request fields naming the session (and the step this client saw it reach)."""
        fields: dict[str, Any] = {"session": session}
        if end:
            fields["session_end"] = True
        step = self._steps.get(session)
        if step is not None:
            fields["session_step"] = step
        return fields

    def answered(self, session: str, end: bool, reply: dict[str, Any]) -> None:
        """A request of the session was answered: remember how far it got (replies may come out of order)."""
        if end:
            self._steps.pop(session, None)
            self._servers.pop(session, None)
            return
        step = reply.get("session_step")
        if isinstance(step, int):
            self._steps[session] = max(step, self._steps.get(session, 0))
