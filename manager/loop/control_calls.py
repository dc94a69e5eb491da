"""The calls about the server rather than inferences (`models`, `health`, `stats`, `cancel`, `load`, `unload`,
`reload`), each answered in its turn among its client's messages by the part of the manager that knows; and the
refusal of an inference that came while the server drains."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchmaker.common.protocol import BAD_REQUEST, OPS, OVERLOADED, PROTOCOL_VERSION, RequestError, echo
from batchmaker.manager.batching.outcomes import Outcome
from batchmaker.manager.loop.frontend import ClientFrontend, Incoming
from batchmaker.manager.loop.introspection import health, stats

if TYPE_CHECKING:
    from batchmaker.manager.loop.server import Manager


def answer(frontend: ClientFrontend, incoming: Incoming, fields: dict[str, Any]) -> None:
    """A call's reply: its id, `ok`, and the call's own fields."""
    frontend.reply(incoming.client, {"id": incoming.request_id, "ok": True, **fields})


def handle(manager: Manager, incoming: Incoming) -> list[Outcome]:
    """Answer one message that is not an inference admitted with its burst (a load or a reload answers once its
    versions are served); the outcomes of the requests a `cancel` ended, for the loop to reply to. Raises
    RequestError for an unknown op, a call that lacks a field, and an inference while the server drains."""
    message = incoming.message
    op = message.get("op", "infer")
    if op not in OPS:
        raise RequestError(BAD_REQUEST, f"unknown op {echo(op)}; expected one of {', '.join(OPS)}")
    if op == "infer":  # while draining: every other is admitted in a burst
        raise RequestError(OVERLOADED, "the server is draining before it stops; send the request elsewhere")
    frontend = manager.frontend
    if op == "models":
        answer(frontend, incoming, {"version": PROTOCOL_VERSION, **manager.versions.describe()})
    elif op == "health":
        answer(frontend, incoming, health(manager))
    elif op == "stats":
        answer(frontend, incoming, stats(manager))
    elif op == "cancel":
        if "target" not in message:
            raise RequestError(BAD_REQUEST, "cancel lacks 'target' (the id of an earlier request)")
        outcomes = manager.router.cancel(incoming.client, message["target"])
        outcomes = manager.core.cancel(incoming.client, message["target"]) if outcomes is None else outcomes
        answer(frontend, incoming, {"cancelled": outcomes is not None})
        return outcomes or []
    elif op == "load":
        manager.control.load(incoming)
    elif op == "unload":
        answer(frontend, incoming, manager.control.unload(incoming))
    elif op == "reload":
        manager.control.reload(incoming)
    return []
