"""Triton's sequence parameters as the server's sessions (docs/protocol.md, "Sessions").

`sequence_id` names a session; `sequence_start` opens it, `sequence_end` closes it. A request that continues
a sequence always tells the server the step it continues from (at least 1), so a sequence the server does not
hold (it expired, the server restarted) is SESSION_LOST, never a silent start from zeros.
"""

from __future__ import annotations

from typing import Any

from batchmaker.common.protocol import INVALID_INPUT, echo

from .errors import DoorError

SESSION_PREFIX = "oip-sequence-"  # the server's session names for OIP sequences, apart from other clients' names


class Sequences:
    """The step each sequence this front door process served has reached."""

    def __init__(self) -> None:
        self._steps: dict[str, int] = {}

    def fields(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """The session fields of an infer message for a request's parameters; none outside a sequence."""
        sequence_id = parameters.get("sequence_id", 0)
        start, end = parameters.get("sequence_start", False), parameters.get("sequence_end", False)
        if not isinstance(start, bool) or not isinstance(end, bool):
            raise DoorError(INVALID_INPUT, "sequence_start and sequence_end must be booleans")
        if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)):
            raise DoorError(INVALID_INPUT, f"sequence_id must be an integer or a string, got {echo(sequence_id)}")
        if sequence_id in (0, ""):
            if start or end:
                raise DoorError(INVALID_INPUT, "sequence_start and sequence_end need a sequence_id")
            return {}
        session = f"{SESSION_PREFIX}{sequence_id}"
        fields: dict[str, Any] = {"session": session}
        if start:
            if session in self._steps:
                raise DoorError(
                    INVALID_INPUT,
                    f"sequence {echo(sequence_id)} is still open: end it with sequence_end before starting it again",
                )
        else:
            fields["session_step"] = self._steps.get(session, 1)
        if end:
            fields["session_end"] = True
        return fields

    def answered(self, fields: dict[str, Any], reply: dict[str, Any]) -> None:
        """A sequence's request was answered: remember its step, or forget the sequence it ended."""
        session = fields.get("session")
        if session is None:
            return
        if fields.get("session_end"):
            self._steps.pop(session, None)
        elif isinstance(reply.get("session_step"), int):
            self._steps[session] = max(reply["session_step"], self._steps.get(session, 0))
