"""Validation of float32 matrix inputs (feature vectors, initial states): tensor maps or nested lists."""

from __future__ import annotations

from typing import Any

import numpy as np

from batchmaker.common.protocol import INVALID_INPUT, RequestError, is_tensor_map, map_to_tensor


def float_rows(raw: Any, name: str, width: int, rows: int | None = None, max_rows: int | None = None) -> np.ndarray:
    """A float32 [rows, width] matrix from a float32 tensor map or a list of lists of numbers (or, from
    the manager itself, a float32 array: a session's state).

    `rows` is the exact row count required; otherwise there must be 1..`max_rows` rows. Every
    problem (shape, dtype, a NaN or infinite value) is an INVALID_INPUT naming it."""
    expected = f"[{rows if rows is not None else 'T'}, {width}]"
    # a state the manager holds (sessions)
    if isinstance(raw, np.ndarray) and raw.dtype == np.float32 and raw.ndim == 2:
        array = raw
    elif is_tensor_map(raw):
        array = map_to_tensor(raw, name, rank=2)
        if array.dtype != np.float32:
            raise RequestError(INVALID_INPUT, f"{name} must be a float32 tensor {expected}, got {array.dtype}")
    elif isinstance(raw, list):
        # before any scan of the list: refusing a long one costs nothing
        if max_rows is not None and len(raw) > max_rows:
            raise RequestError(INVALID_INPUT, f"{name} has {len(raw)} rows; this model accepts at most {max_rows}")
        try:
            array = np.array(raw)
        except ValueError:  # rows of different lengths
            message = f"{name} must be a {expected} list of equally long rows of numbers"
            raise RequestError(INVALID_INPUT, message) from None
        if array.dtype.kind not in "iuf" or (array.ndim != 2 and array.size):
            raise RequestError(INVALID_INPUT, f"{name} must be a {expected} list of rows of numbers")
        with np.errstate(over="ignore"):  # a number beyond float32 becomes inf, refused below
            array = array.astype(np.float32).reshape(len(raw), -1 if array.size else 0)
    else:
        raise RequestError(
            INVALID_INPUT, f"{name} must be a {expected} float32 tensor map or a list of rows of numbers"
        )
    count, columns = array.shape
    if rows is not None and count != rows:
        raise RequestError(INVALID_INPUT, f"{name} must have shape {expected}, got {list(array.shape)}")
    if rows is None and count == 0:
        raise RequestError(INVALID_INPUT, f"{name} is empty; send at least one row")
    if max_rows is not None and count > max_rows:
        raise RequestError(INVALID_INPUT, f"{name} has {count} rows; this model accepts at most {max_rows}")
    if columns != width:
        raise RequestError(INVALID_INPUT, f"{name} must have shape {expected}, got {list(array.shape)}")
    finite = np.isfinite(array)
    if not finite.all():
        row, column = np.argwhere(~finite)[0]
        raise RequestError(
            INVALID_INPUT,
            f"{name}[{row}][{column}] = {array[row, column]} is not a finite float32 (NaN, infinite or too large)",
        )
    return array
