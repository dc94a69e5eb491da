"""Tensors as the Open Inference Protocol carries them: OIP datatypes, JSON `data` (flat or nested), and raw
little-endian bytes (HTTP's binary tensor extension, gRPC's raw contents). Nothing here knows a transport."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from batchmaker.common.protocol import INVALID_INPUT, MAX_RANK, echo

from .errors import DoorError

# OIP datatype -> numpy dtype, for the datatypes the server's wire protocol carries (docs/protocol.md, "Tensors").
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool),
    "UINT8": np.dtype("uint8"),
    "INT8": np.dtype("int8"),
    "INT16": np.dtype("int16"),
    "INT32": np.dtype("int32"),
    "INT64": np.dtype("int64"),
    "FP16": np.dtype("float16"),
    "FP32": np.dtype("float32"),
    "FP64": np.dtype("float64"),
}
_NAMES = {dtype: name for name, dtype in DATATYPES.items()}


def datatype_of(dtype: str | np.dtype) -> str:
    """The OIP datatype of a numpy dtype (or of a dtype name, as the server's `models` reply gives them)."""
    return _NAMES[np.dtype(dtype)]


def numpy_dtype(datatype: Any, name: str) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise DoorError(
            INVALID_INPUT,
            f"input {echo(name)}: datatype {echo(datatype)} is not served; use one of {', '.join(DATATYPES)}",
        )
    return DATATYPES[datatype]


def checked_shape(shape: Any, name: str) -> list[int]:
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_RANK:
        raise DoorError(INVALID_INPUT, f"input {echo(name)}: shape must be a list of at most {MAX_RANK} dimensions")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise DoorError(INVALID_INPUT, f"input {echo(name)}: shape {echo(shape)} must hold non-negative integers")
    return list(shape)


def from_json(name: str, datatype: Any, shape: Any, data: Any) -> np.ndarray:
    """A tensor from JSON `data`, flat or nested in row-major order, holding exactly the shape's elements."""
    dtype = numpy_dtype(datatype, name)
    shape = checked_shape(shape, name)
    try:
        array = np.asarray(data, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise DoorError(
            INVALID_INPUT, f"input {echo(name)}: data is not {datatype} values in nested lists: {exc}"
        ) from None
    if array.size != math.prod(shape):
        raise DoorError(
            INVALID_INPUT, f"input {echo(name)}: shape {shape} needs {math.prod(shape)} values, data holds {array.size}"
        )
    if dtype.kind in "iu" and not _integral(data):
        raise DoorError(INVALID_INPUT, f"input {echo(name)}: {datatype} data must be integers")
    return array.reshape(shape)


def _integral(data: Any) -> bool:
    """Whether nested JSON data holds integers only (numpy would truncate 1.5 to 1 without a word)."""
    if isinstance(data, list):
        return all(_integral(item) for item in data)
    return isinstance(data, int) and not isinstance(data, bool)


def from_bytes(name: str, datatype: Any, shape: Any, raw: bytes | memoryview) -> np.ndarray:
    """A tensor from C-order little-endian bytes, whose size must be the shape's exactly."""
    dtype = numpy_dtype(datatype, name).newbyteorder("<")
    shape = checked_shape(shape, name)
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise DoorError(
            INVALID_INPUT, f"input {echo(name)}: shape {shape} of {datatype} needs {expected} bytes, got {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def to_bytes(array: np.ndarray) -> bytes:
    """An output's raw contents: C-order, little-endian."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def to_json(array: np.ndarray) -> np.ndarray:
    """An output's JSON `data`: flat, in row-major order, as the OIP recommends. It stays an array, which
    orjson writes without a Python object per value (float32 as the shortest text that reads back exactly)."""
    return np.ascontiguousarray(array.reshape(-1))
