"""When a refused request is sent again (docs/protocol.md, "Retries").

An `OVERLOADED` refusal from a server that is not stopping means the request was not run: the
server's admission turned it away before it touched any state, a session's included. So resending
it later is safe, and the clients do so after a backoff: the server's own estimate when its
refusal carries `retry_after_ms`, else a doubling wait. Either is jittered, so that a burst refused
together does not come back together and get refused together again.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchmaker.common.protocol import OVERLOADED

from .servers import is_stopping

DEFAULT_MAX_RETRIES = 10  # resends after a backoff, per request; 0 hands every refusal to the caller
MAX_DOUBLINGS = 30  # keeps 2**retry a float well below any cap


@dataclass(frozen=True)
class Backoff:
    """How long a refused request waits before it is sent again.

    Without an estimate from the server, the n-th wait (n from 0) is drawn between half and all of
    `first_s * 2**n`, capped at `max_s`. A server's estimate replaces that: the wait is drawn
    between the estimate and twice it, uncapped, as coming back sooner would only be refused."""

    first_s: float = 0.01
    max_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"Backoff needs 0 < first_s <= max_s, got first_s={self.first_s}, max_s={self.max_s}")

    def delay(self, retry: int, estimate_s: float | None, draw: Callable[[], float] = random.random) -> float:
        """Seconds to wait before resend number `retry` (0 for the first); `draw` is uniform in [0, 1)."""
        if estimate_s is not None:
            return estimate_s * (1 + draw())
        ceiling = min(self.max_s, self.first_s * 2 ** min(retry, MAX_DOUBLINGS))
        return ceiling * (0.5 + 0.5 * draw())


DEFAULT_BACKOFF = Backoff()


def is_refusal(reply: dict[str, Any]) -> bool:
    """An OVERLOADED answer from a server that is not stopping: the request did not run and may run later there."""
    error = reply.get("error") if reply.get("ok") is False else None
    return isinstance(error, dict) and error.get("code") == OVERLOADED and not is_stopping(reply)


def retry_after_s(reply: dict[str, Any]) -> float | None:
    """The server's estimate, in seconds, of when a refused request would be admitted; None if it gave none."""
    error = reply.get("error")
    value = error.get("retry_after_ms") if isinstance(error, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return value / 1e3
