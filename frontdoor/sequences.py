"""Triton's sequence parameters as the server's sessions (docs/protocol.md, "Sessions").

`sequence_id` names a session. `sequence_start` starts it from zeros (`session_start`): the server replaces a
live session of that id, or forgets that it lost one, when the start's turn comes, so a start never continues
another sequence's state, whichever door process each request reached. A request without `sequence_start`
continues its sequence and says so (`session_step: 1`): a sequence the server does not hold (it ended, expired,
or the server restarted) is SESSION_LOST, never a silent start from zeros. The server's session is the one
record of a sequence: the front door keeps nothing per sequence.
"""

from __future__ import annotations

from typing import Any

from batchmaker.common.protocol import INVALID_INPUT, echo

from .errors import DoorError

SESSION_PREFIX = "oip-sequence-"  # the server's session names for OIP sequences, apart from other clients' names


def sequence_session(parameters: dict[str, Any]) -> str | None:
    """The server's session for a request's `sequence_id`; None outside a sequence."""
    sequence_id = parameters.get("sequence_id", 0)
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)):
        raise DoorError(INVALID_INPUT, f"sequence_id must be an integer or a string, got {echo(sequence_id)}")
    return None if sequence_id in (0, "") else f"{SESSION_PREFIX}{sequence_id}"


def session_fields(parameters: dict[str, Any]) -> dict[str, Any]:
    """The session fields of an infer message for a request's parameters; none outside a sequence."""
    session = sequence_session(parameters)
    start, end = parameters.get("sequence_start", False), parameters.get("sequence_end", False)
    if not isinstance(start, bool) or not isinstance(end, bool):
        raise DoorError(INVALID_INPUT, "sequence_start and sequence_end must be booleans")
    if session is None:
        if start or end:
            raise DoorError(INVALID_INPUT, "sequence_start and sequence_end need a sequence_id")
        return {}
    fields: dict[str, Any] = {"session": session}
    if start:
        fields["session_start"] = True
    else:
        fields["session_step"] = 1  # it continues a session the server holds, checked when its turn comes
    if end:
        fields["session_end"] = True
    return fields
