"""The exceptions a client raises: an error answer from the server, a server lost with resending off, or a
request too large to send."""

from __future__ import annotations

from typing import Any


class ServerError(Exception):
    """An `ok: false` reply, kept whole so callers can branch on the protocol error code.

    `code` is one of the codes in common.protocol (e.g. OVERLOADED means retry later,
    INVALID_INPUT means the request itself is wrong); `request_id` is the id it answered;
    `retry_after_ms` the server's estimate of when an OVERLOADED request would be admitted, when it gave one.
    """

    def __init__(self, code: str, message: str, request_id: Any = None, retry_after_ms: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
        self.retry_after_ms = retry_after_ms


SESSION_ON_SERVER = "it continues a session whose state is on that server alone"  # why a request stays
SET_ASIDE = "it was found lost earlier and has not answered since"  # why a server is aside when a request comes


class ServerLost(ConnectionError):
    """The server holding a request stopped answering, and the request could not go elsewhere: the client was
    told not to resend (`resend=False`), or the request continues a session whose state is on that server.

    The request may or may not have run there; nothing was sent elsewhere.
    """

    def __init__(self, address: str, request_id: Any, reason: str, why_kept: str = "resending is off"):
        super().__init__(
            f"server {address} was set aside ({reason}) before answering request {request_id!r}; "
            f"it was not sent elsewhere because {why_kept}"
        )
        self.address = address
        self.request_id = request_id


class RequestTooLarge(ValueError):
    """A request whose encoded frame is over the server's `server.max_message_bytes`, refused before sending:
    the server would close the connection without reading it, and the caller would learn nothing until its
    timeout. Nothing was sent; other requests on the client are not disturbed."""

    def __init__(self, size: int, limit: int, request_id: Any):
        super().__init__(
            f"request {request_id!r} is {size} bytes encoded, over the server's limit of {limit} bytes "
            "(server.max_message_bytes); it was not sent: send smaller inputs, or raise the server's "
            "server.max_message_bytes (and the client's max_message_bytes if you set it)"
        )
        self.size = size
        self.limit = limit
        self.request_id = request_id
