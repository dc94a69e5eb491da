"""The exception a client raises when the server answers a request with an error."""

from __future__ import annotations

from typing import Any


class ServerError(Exception):
    """An `ok: false` reply, kept whole so callers can branch on the protocol error code.

    `code` is one of the codes in common.protocol (e.g. OVERLOADED means retry later,
    INVALID_INPUT means the request itself is wrong); `request_id` is the id it answered.
    """

    def __init__(self, code: str, message: str, request_id: Any = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
