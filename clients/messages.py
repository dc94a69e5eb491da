"""What both clients send and receive, apart from any socket: request messages, replies as their
caller gets them, the errors a reply or a silence becomes, and the DEALER socket to a server."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from batchmaker.common.auth import apply_curve_client
from batchmaker.common.protocol import INTERNAL, RequestError, decode, decode_outputs, is_partial

from .errors import ServerError
from .streams import Partial

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT = 30.0
CurveKeys = tuple[str | Path, str | Path]  # (client secret key file, server public key file)

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """A successful inference: outputs with tensor maps turned into arrays, and the server's timing."""

    outputs: dict[str, Any]
    timing: dict[str, int]
    session_step: int | None = None  # of a session's request: the session's requests answered so far
    version: int | None = None  # the version of the model that served it


def infer_message(
    model: str,
    inputs: dict[str, Any],
    deadline_ms: int | None,
    priority: int | None,
    stream: bool = False,
    version: int | None = None,
) -> dict[str, Any]:
    """Build an infer request, leaving out optional fields so the server applies its defaults."""
    if isinstance(inputs, dict):
        inputs = {name: wire_value(name, value) for name, value in inputs.items()}
    message: dict[str, Any] = {"op": "infer", "model": model, "inputs": inputs}
    if deadline_ms is not None:
        message["deadline_ms"] = deadline_ms
    if priority is not None:
        message["priority"] = priority
    if stream:
        message["stream"] = True
    if version is not None:
        message["version"] = version
    return message


def wire_value(name: str, value: Any) -> Any:
    """An input as the wire carries it: array-likes of other libraries (a torch tensor, through its
    `__array__`) become numpy arrays, so the client needs none of them installed."""
    if isinstance(value, dict):
        return {key: wire_value(f"{name}.{key}", item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        return _float32(name, value) if value.dtype == np.float64 else value
    if isinstance(value, (np.generic, list, tuple, str, bytes, int, float, bool)) or value is None:
        return value
    if not hasattr(value, "__array__"):
        return value  # the encoder refuses it, naming its type
    try:
        array = np.asarray(value)
    except (TypeError, RuntimeError, ValueError) as exc:  # e.g. a tensor on a GPU, or one that requires grad
        raise TypeError(
            f"input {name!r}: cannot read the {type(value).__name__} as a numpy array ({exc}); "
            "pass value.detach().cpu().numpy()"
        ) from None
    return wire_value(name, array)


def _float32(name: str, array: np.ndarray) -> np.ndarray:
    """A float64 array as float32, the dtype of every float input the server's models take: the model
    computes in float32 anyway. A value beyond float32's range would change; it is refused here."""
    with np.errstate(over="ignore"):
        cast = array.astype(np.float32)
    if not np.array_equal(np.isfinite(cast), np.isfinite(array)):
        raise ValueError(
            f"input {name!r}: float64 values beyond float32's range (the server's models compute in float32)"
        )
    return cast


def read_reply(frame: bytes) -> dict[str, Any] | None:
    """Decode one reply frame, or return None (logged) when it cannot be matched to a request."""
    try:
        reply = decode(frame)
    except RequestError as exc:
        log.warning("dropping an undecodable reply: %s", exc.message)
        return None
    request_id = reply.get("id") if isinstance(reply, dict) else None
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
        log.warning("dropping a reply without an int or str id")
        return None
    return reply


def check(reply: dict[str, Any]) -> dict[str, Any]:
    """Return a successful reply, or raise ServerError for an `ok: false` one."""
    if reply.get("ok") is True:
        return reply
    error = reply.get("error")
    if not isinstance(error, dict):
        error = {}
    retry_after_ms = error.get("retry_after_ms")
    raise ServerError(
        str(error.get("code", INTERNAL)),
        str(error.get("message", "the server reported an error without a message")),
        reply.get("id"),
        retry_after_ms if isinstance(retry_after_ms, int) and not isinstance(retry_after_ms, bool) else None,
    )


def to_infer_reply(reply: dict[str, Any]) -> Reply:
    return Reply(
        outputs=decode_outputs(reply.get("outputs") or {}),
        timing=reply.get("timing") or {},
        session_step=reply.get("session_step"),
        version=reply.get("version"),
    )


def to_stream_item(reply: dict[str, Any]) -> Partial | Reply:
    """A streamed request's reply as its caller gets it: a Partial, or the final Reply (ServerError for an error)."""
    if is_partial(reply):
        return Partial(outputs=decode_outputs(reply.get("outputs") or {}), restarted=reply.get("restarted") is True)
    return to_infer_reply(check(reply))


def connect_dealer(
    context: zmq.Context, address: str, curve: CurveKeys | None, receive_queue_unbounded: bool = False
) -> zmq.Socket:
    """A DEALER socket connected to one server; `receive_queue_unbounded` for clients with many requests in flight."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if receive_queue_unbounded:
        socket.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        apply_curve_client(socket, Path(curve[0]), Path(curve[1]))
    socket.connect(address)
    return socket


def timeout_error(address: str, timeout: float, request_id: Any, parked: bool, closed: int = 0) -> TimeoutError:
    """`closed`: how often the server closed this client's connection while it waited."""
    if parked:
        hint = "no server was up to take it (all set aside or draining)"
    elif closed:
        hint = (
            f"the server closed the connection {closed} time(s): it may be serving its server.max_clients "
            "connections already, or the request was larger than its server.max_message_bytes"
        )
    else:
        hint = "is the server running?"
    return TimeoutError(f"no reply from {address} within {timeout:g} s to request {request_id!r}; {hint}")
