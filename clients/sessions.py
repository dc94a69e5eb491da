"""The client's side of server-held sessions: the step each session reached, sent back with its next request.

A server that does not know a session (it restarted, or another server behind a multi-address
client answered before) and is asked to continue from step n > 0 answers SESSION_LOST instead of
silently starting over from zero. SESSION_LOST is not retryable: it is never sent to another server.
"""

from __future__ import annotations

from typing import Any


class SessionSteps:
    def __init__(self) -> None:
        self._steps: dict[str, int] = {}

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
            return
        step = reply.get("session_step")
        if isinstance(step, int):
            self._steps[session] = max(step, self._steps.get(session, 0))
