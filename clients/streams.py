"""Streamed replies as both clients give them to their caller (docs/protocol.md, "Streaming"): a
Partial for each partial reply, and the messages a client makes on its own for a stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchmaker.common.protocol import encode, partial_reply

from .servers import RequestId


@dataclass
class Partial:
    """Outputs of a streamed request that became final. `restarted`: the request started over (its
    server or worker was lost), so the partials before this one are void and the stream begins
    anew with this one."""

    outputs: dict[str, Any]
    restarted: bool = False


def restart_notice(request_id: RequestId) -> dict[str, Any]:
    """The partial a client gives its caller when a stream it resent is answered before any new partial."""
    return partial_reply(request_id, {}, restarted=True)


def cancel_message(target_id: RequestId, request_id: RequestId) -> bytes:
    """Cancels a stream its caller left early; the answer is not awaited (later calls skip it)."""
    return encode({"op": "cancel", "target": target_id, "id": request_id})
