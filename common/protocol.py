"""Client wire protocol, version 1: msgpack maps, tensor maps and error codes.

Only msgpack and numpy are needed here, so the thin clients can share this
module with the server. Nothing received is ever unpickled or evaluated.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import KeysView
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

# Error codes (docs/protocol.md, "Errors").
BAD_REQUEST = "BAD_REQUEST"
UNKNOWN_MODEL = "UNKNOWN_MODEL"
INVALID_INPUT = "INVALID_INPUT"
OVERLOADED = "OVERLOADED"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
CANCELLED = "CANCELLED"
WORKER_LOST = "WORKER_LOST"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
SESSION_LOST = "SESSION_LOST"
# A worker's answer to a request routed to its running batch that cannot hold the request's values (all its steps'
# at once); never sent to a client: the manager runs that request's steps itself, a few lanes' rows at a time.
NO_ROOM = "NO_ROOM"
ERROR_CODES = (
    BAD_REQUEST,
    UNKNOWN_MODEL,
    INVALID_INPUT,
    OVERLOADED,
    DEADLINE_EXCEEDED,
    CANCELLED,
    WORKER_LOST,
    UNAVAILABLE,
    INTERNAL,
    SESSION_LOST,
)

# The fields a request of each op may carry (docs/protocol.md, "Requests"): any other is refused.
REQUEST_FIELDS = {
    "infer": (
        *("id", "op", "model", "version", "inputs", "deadline_ms", "priority", "stream"),
        *("session", "session_start", "session_end", "session_step", "traceparent", "tracestate"),
    ),
    "models": ("id", "op"),
    "health": ("id", "op"),
    "stats": ("id", "op"),
    "cancel": ("id", "op", "target"),
    "load": ("id", "op", "model", "weights", "config"),
    "unload": ("id", "op", "model"),
    "reload": ("id", "op"),
}
OPS = tuple(REQUEST_FIELDS)
_FIELDS = {op: dict.fromkeys(fields).keys() for op, fields in REQUEST_FIELDS.items()}  # ordered, and sets
SHOWN_UNKNOWN_NAMES = 8  # unknown names a refusal quotes at most
# Every op but infer: calls about the server, which stats counts apart from inference requests.
CONTROL_OPS = tuple(op for op in REQUEST_FIELDS if op != "infer")

# Tensor dtypes accepted on the wire; anything else is refused rather than guessed.
WIRE_DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

MAX_RANK = 32  # dimensions a tensor map may have (numpy's own limit is 64); served inputs have one
ECHO_CHARS = 80  # at most this much of a client's value is echoed in an error message

_echo = reprlib.Repr()
_echo.maxstring = _echo.maxother = _echo.maxlong = ECHO_CHARS
_echo.maxlist = _echo.maxtuple = _echo.maxdict = _echo.maxset = 8
_echo.maxlevel = 3


def echo(value: Any) -> str:
    """A client's value as an error message shows it: a repr cut short, at a cost bounded by the cut
    rather than by the value, so that a refusal never costs or weighs more than what it refuses."""
    text = _echo.repr(value)
    return text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 3] + "..."


class RequestError(Exception):
    """A request that cannot be served, carrying the protocol error code to reply with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def optional_int(
    message: dict[str, Any], field: str, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    """The message's integer `field` within the bounds given, or None when absent; BAD_REQUEST if it is not one."""
    value = message.get(field)
    if value is None:
        return None
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        bound = f" >= {minimum}" if minimum is not None else ""
        bound += f" and <= {maximum}" if maximum is not None else ""
        raise RequestError(BAD_REQUEST, f"'{field}' must be an integer{bound}, got {echo(value)}")
    return value


def unknown_names(given: dict[Any, Any], allowed: KeysView[str], noun: str) -> str | None:
    """The keys of `given` outside `allowed` as a refusal names them ("input 'x'", "inputs 'x', 'y'"),
    the first few each cut short; None when there are none, which costs one set comparison."""
    if given.keys() <= allowed:
        return None
    unknown = [name for name in given if name not in allowed]
    quoted = ", ".join(echo(name) for name in unknown[:SHOWN_UNKNOWN_NAMES])
    return f"{noun}{'s' if len(unknown) > 1 else ''} {quoted}{', ...' if len(unknown) > SHOWN_UNKNOWN_NAMES else ''}"


def check_request_fields(message: dict[Any, Any]) -> None:
    """Refuse a field its op does not read: a misspelt optional field (`deadline` for `deadline_ms`)
    would otherwise be ignored without a word. An unknown op is left to whoever dispatches ops."""
    op = message.get("op", "infer")
    allowed = _FIELDS.get(op) if isinstance(op, str) else None
    unknown = None if allowed is None else unknown_names(message, allowed, "field")
    if unknown is not None:
        raise RequestError(BAD_REQUEST, f"unknown {unknown} for op {op!r}; its fields are: {', '.join(allowed)}")


def encode(message: Any) -> bytes:
    """Pack one message (a map) as a single msgpack frame."""
    return msgpack.packb(message, use_bin_type=True, default=_encode_extra)


def _encode_extra(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return tensor_to_map(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} on the wire")


def decode(frame: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Unpack one frame, refusing anything that is not a single well-formed msgpack value.

    Size limits bound what a hostile frame can make us allocate.
    """
    if len(frame) > max_bytes:
        raise RequestError(BAD_REQUEST, f"message of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=False,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes,
        )
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise RequestError(BAD_REQUEST, f"message is not valid msgpack: {exc}") from None


_LITTLE_ENDIAN_NAMES = {np.dtype(name).newbyteorder("<"): name for name in WIRE_DTYPES}


def tensor_to_map(array: np.ndarray) -> dict[str, Any]:
    """Encode an array as a tensor map: dtype, shape and C-order little-endian bytes."""
    array = np.asarray(array)
    name = _LITTLE_ENDIAN_NAMES.get(array.dtype)  # every reply takes this path: no dtype name lookups
    if name is not None:
        return {"dtype": name, "shape": list(array.shape), "data": array.tobytes()}
    if array.dtype.name not in WIRE_DTYPES:
        raise TypeError(f"dtype {array.dtype.name} cannot be sent on the wire")
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": np.ascontiguousarray(little).tobytes()}


def is_tensor_map(value: Any) -> bool:
    return isinstance(value, dict) and {"dtype", "shape", "data"} <= value.keys()


def map_to_tensor(value: Any, name: str = "tensor", rank: int | None = None) -> np.ndarray:
    """Decode a tensor map, checking dtype, shape and byte count against each other.

    `rank`, when given, is the number of dimensions the input must have. The shape is checked
    before its product is taken: its length first, then each dimension against what the data can
    hold, so that a hostile shape costs at most MAX_RANK comparisons of small integers."""
    if not is_tensor_map(value):
        raise RequestError(BAD_REQUEST, f"{name} must be a tensor map with dtype, shape and data")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise RequestError(BAD_REQUEST, f"{name}: unsupported dtype {echo(dtype)}; use one of {', '.join(WIRE_DTYPES)}")
    if not isinstance(data, bytes):
        raise RequestError(BAD_REQUEST, f"{name}: data must be binary")
    if not isinstance(shape, list):
        raise RequestError(BAD_REQUEST, f"{name}: shape must be a list of non-negative integers")
    if rank is not None and len(shape) != rank:
        raise RequestError(INVALID_INPUT, f"{name} must have {rank} dimension(s), its shape has {len(shape)}")
    if len(shape) > MAX_RANK:
        raise RequestError(INVALID_INPUT, f"{name}: shape has {len(shape)} dimensions, at most {MAX_RANK} are allowed")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise RequestError(BAD_REQUEST, f"{name}: shape must be a list of non-negative integers")
    np_dtype = np.dtype(dtype).newbyteorder("<")
    elements = len(data) // np_dtype.itemsize
    if 0 not in shape and max(shape, default=0) > elements:  # an empty tensor may have any other dimensions
        raise RequestError(INVALID_INPUT, f"{name}: shape {echo(shape)} cannot fit in {len(data)} bytes of {dtype}")
    expected = math.prod(shape) * np_dtype.itemsize  # cheap: at most MAX_RANK factors of 64 bits
    if expected != len(data):
        raise RequestError(
            INVALID_INPUT, f"{name}: shape {echo(shape)} of {dtype} needs {expected} bytes, got {len(data)}"
        )
    try:
        array = np.frombuffer(data, dtype=np_dtype).reshape(shape)
    except ValueError:  # an empty tensor whose other dimensions numpy cannot index
        raise RequestError(INVALID_INPUT, f"{name}: shape {echo(shape)} is too large") from None
    return array.astype(np.dtype(dtype), copy=False)


def decode_outputs(outputs: dict[str, Any]) -> dict[str, Any]:
    """Turn the tensor maps of a reply's outputs into arrays, leaving plain values alone."""
    return {key: map_to_tensor(value, key) if is_tensor_map(value) else value for key, value in outputs.items()}


def error_reply(request_id: Any, code: str, message: str, retry_after_ms: int | None = None) -> dict[str, Any]:
    """`retry_after_ms`: for OVERLOADED, when the server expects to admit the request (docs/protocol.md, "Errors")."""
    error: dict[str, Any] = {"code": code, "message": message}
    if retry_after_ms is not None:
        error["retry_after_ms"] = retry_after_ms
    return {"id": request_id, "ok": False, "error": error}


def partial_reply(request_id: Any, outputs: dict[str, Any], restarted: bool = False) -> dict[str, Any]:
    """A streamed request's outputs that became final (docs/protocol.md, "Streaming"); `restarted`
    says that the request started over, and the partials sent before this one are void."""
    reply = {"id": request_id, "ok": True, "partial": True, "outputs": outputs}
    if restarted:
        reply["restarted"] = True
    return reply


def is_partial(reply: dict[str, Any]) -> bool:
    return reply.get("partial") is True
