"""Client wire protocol, version 1: msgpack maps, tensor maps and error codes.

Only msgpack and numpy are needed here, so the thin clients can share this
module with the server. Nothing received is ever unpickled or evaluated.
"""

from __future__ import annotations

import math
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
)

OPS = ("infer", "models", "health", "stats", "cancel")

# Tensor dtypes accepted on the wire; anything else is refused rather than guessed.
WIRE_DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class RequestError(Exception):
    """A request that cannot be served, carrying the protocol error code to reply with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


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


def map_to_tensor(value: Any, name: str = "tensor") -> np.ndarray:
    """Decode a tensor map, checking dtype, shape and byte count against each other."""
    if not is_tensor_map(value):
        raise RequestError(BAD_REQUEST, f"{name} must be a tensor map with dtype, shape and data")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype not in WIRE_DTYPES:
        raise RequestError(BAD_REQUEST, f"{name}: unsupported dtype {dtype!r}; use one of {', '.join(WIRE_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise RequestError(BAD_REQUEST, f"{name}: shape must be a list of non-negative integers")
    if not isinstance(data, bytes):
        raise RequestError(BAD_REQUEST, f"{name}: data must be binary")
    np_dtype = np.dtype(dtype).newbyteorder("<")
    expected = math.prod(shape) * np_dtype.itemsize  # exact integers: a huge shape cannot wrap around
    if expected != len(data):
        raise RequestError(BAD_REQUEST, f"{name}: shape {shape} of {dtype} needs {expected} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=np_dtype).reshape(shape).astype(np.dtype(dtype), copy=False)


def decode_outputs(outputs: dict[str, Any]) -> dict[str, Any]:
    """Turn the tensor maps of a reply's outputs into arrays, leaving plain values alone."""
    return {key: map_to_tensor(value, key) if is_tensor_map(value) else value for key, value in outputs.items()}


def error_reply(request_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": {"code": code, "message": message}}
