"""What a failed request becomes on each transport: the server's error codes mapped to HTTP statuses and
gRPC status codes (docs/protocol.md, "Open Inference Protocol", "Errors")."""

from __future__ import annotations

from batchmaker.common import protocol

# code -> (HTTP status, gRPC status code name). OVERLOADED is 429 and UNAVAILABLE: a load balancer or client
# backs off and retries both; SESSION_LOST is 404, the sequence (a resource of the server) is not there.
STATUSES: dict[str, tuple[int, str]] = {
    protocol.BAD_REQUEST: (400, "INVALID_ARGUMENT"),
    protocol.INVALID_INPUT: (400, "INVALID_ARGUMENT"),
    protocol.UNKNOWN_MODEL: (404, "NOT_FOUND"),
    protocol.SESSION_LOST: (404, "NOT_FOUND"),
    protocol.OVERLOADED: (429, "UNAVAILABLE"),
    protocol.DEADLINE_EXCEEDED: (504, "DEADLINE_EXCEEDED"),
    protocol.CANCELLED: (499, "CANCELLED"),
    protocol.WORKER_LOST: (503, "UNAVAILABLE"),
    protocol.UNAVAILABLE: (503, "UNAVAILABLE"),
    protocol.INTERNAL: (500, "INTERNAL"),
}
UNAUTHENTICATED = "UNAUTHENTICATED"  # the front door's own: a missing or wrong bearer token (401)
FORBIDDEN = "FORBIDDEN"  # the front door's own: model control, off on this listener (403)
TOO_LARGE = "TOO_LARGE"  # the front door's own: a body over [http] max_body_bytes (413)
EXHAUSTED = "RESOURCE_EXHAUSTED"  # the front door's own: a ModelStreamInfer stream past its bounds
STATUSES[UNAUTHENTICATED] = (401, "UNAUTHENTICATED")
STATUSES[FORBIDDEN] = (403, "PERMISSION_DENIED")
STATUSES[TOO_LARGE] = (413, "RESOURCE_EXHAUSTED")
STATUSES[EXHAUSTED] = (429, "RESOURCE_EXHAUSTED")


class DoorError(Exception):
    """A request refused or failed, with the server's error code (or the front door's own) and what to change."""

    def __init__(self, code: str, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms

    @property
    def text(self) -> str:
        """The error as the client reads it: the code, the message, and when to come back if the server said."""
        retry = f" (retry after {self.retry_after_ms} ms)" if self.retry_after_ms is not None else ""
        return f"{self.code}: {self.message}{retry}"

    @property
    def http_status(self) -> int:
        return STATUSES.get(self.code, (500, "INTERNAL"))[0]

    @property
    def grpc_code(self) -> str:
        return STATUSES.get(self.code, (500, "INTERNAL"))[1]
