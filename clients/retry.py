"""When a refused request is sent again (docs/protocol.md, "Retries").

An `OVERLOADED` refusal from a server that is not stopping means the request was not run: the
server's admission turned it away before it touched any state, a session's included. So resending
it later is safe, and the clients do so after a backoff: a doubling wait, jittered, so that a burst
refused together does not come back together and get refused together again, and never less than the
server's own estimate when its refusal carries `retry_after_ms`. A request is resent while its deadline
and its call's timeout allow the wait; the count of resends is only a safety net.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchmaker.common.protocol import OVERLOADED

from .servers import is_stopping

DEFAULT_MAX_RETRIES = 100  # resends per request: a safety net, past what the default timeout lets a request wait
MAX_DOUBLINGS = 30  # keeps 2**retry a float well below any cap


@dataclass(frozen=True)
class Backoff:
    """How long a refused request waits before it is sent again.

    The n-th wait (n from 0) is drawn between half and all of `first_s * 2**n`, capped at `max_s`: the
    waits grow, so a request refused again and again comes back ever more rarely, and the random part
    spreads a burst refused together. A server's estimate of when it would admit the request is a floor:
    coming back sooner would only be refused again (the server spreads its estimates over a refused
    burst, so following them does not bring the burst back together)."""

    first_s: float = 0.01
    max_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"Backoff needs 0 < first_s <= max_s, got first_s={self.first_s}, max_s={self.max_s}")

    def delay(self, retry: int, estimate_s: float | None, draw: Callable[[], float] = random.random) -> float:
        """Seconds to wait before resend number `retry` (0 for the first); `draw` is uniform in [0, 1)."""
        ceiling = min(self.max_s, self.first_s * 2 ** min(retry, MAX_DOUBLINGS))
        backoff = ceiling * (0.5 + 0.5 * draw())
        return backoff if estimate_s is None else max(backoff, estimate_s)


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
