"""Unit tests for common/protocol.py: message framing, tensor maps and their validation."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
from conftest import CountingList

from batchmaker.common.protocol import (
    BAD_REQUEST,
    ECHO_CHARS,
    ERROR_CODES,
    INVALID_INPUT,
    MAX_RANK,
    WIRE_DTYPES,
    RequestError,
    decode,
    decode_outputs,
    encode,
    error_reply,
    is_tensor_map,
    map_to_tensor,
    tensor_to_map,
)


def refused(excinfo: pytest.ExceptionInfo[RequestError], code: str = BAD_REQUEST) -> str:
    assert excinfo.value.code == code
    assert isinstance(excinfo.value.message, str) and excinfo.value.message.strip()
    return excinfo.value.message


# -- encode / decode ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        {"id": 1, "op": "infer", "model": "lstm", "inputs": {"tokens": [1, 2, 3]}},
        {"id": "req-é", "ok": True, "nested": {"a": [1, 2.5, None, True, "x"]}, "blob": b"\x00\xff\x01"},
        {"id": 2**64 - 1, "neg": -(2**63), "empty": {}, "list": []},
        {},
    ],
)
def test_encode_decode_round_trip(message: dict[str, Any]) -> None:
    frame = encode(message)
    assert isinstance(frame, bytes)
    assert decode(frame) == message


def test_decode_keeps_bytes_and_str_apart() -> None:
    decoded = decode(encode({"s": "text", "b": b"text"}))
    assert decoded["s"] == "text" and isinstance(decoded["s"], str)
    assert decoded["b"] == b"text" and isinstance(decoded["b"], bytes)


def test_encode_turns_arrays_into_tensor_maps_and_numpy_scalars_into_plain_values() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    decoded = decode(encode({"x": array, "n": np.int64(7), "f": np.float32(0.5)}))
    assert decoded["n"] == 7 and type(decoded["n"]) is int
    assert decoded["f"] == 0.5 and type(decoded["f"]) is float
    assert decoded["x"] == {"dtype": "float32", "shape": [2, 3], "data": array.tobytes()}
    np.testing.assert_array_equal(map_to_tensor(decoded["x"]), array)


def test_encode_refuses_unknown_objects() -> None:
    with pytest.raises(TypeError):
        encode({"x": object()})
    with pytest.raises(TypeError):
        encode({"x": np.array(["a", "b"])})  # a string array has no wire dtype


@pytest.mark.parametrize(
    "garbage",
    [b"\xc1", b"", b"\x82\xa2id", b"\x93\x01\x02", b"not msgpack \xc1\xff", b"\xa4\xff\xfe\xfd\xfc", b"\x91" * 100_000],
    ids=["reserved-byte", "empty", "truncated-map", "truncated-array", "text", "bad-utf8", "deep-nesting"],
)
def test_decode_refuses_garbage_with_bad_request(garbage: bytes) -> None:
    with pytest.raises(RequestError) as excinfo:
        decode(garbage)
    refused(excinfo)


def test_decode_refuses_trailing_bytes_after_one_value() -> None:
    with pytest.raises(RequestError) as excinfo:
        decode(encode({"id": 1}) + encode({"id": 2}))
    refused(excinfo)


def test_decode_refuses_oversize_frame() -> None:
    frame = encode({"id": 1, "pad": b"x" * 200})
    assert decode(frame, max_bytes=len(frame)) == {"id": 1, "pad": b"x" * 200}
    with pytest.raises(RequestError) as excinfo:
        decode(frame, max_bytes=len(frame) - 1)
    message = refused(excinfo)
    assert str(len(frame) - 1) in message


def test_decode_bounds_declared_lengths_by_max_bytes() -> None:
    # A bin header may declare far more bytes than the frame holds; it must never be trusted.
    frame = b"\xc6\x7f\xff\xff\xff" + b"x" * 10
    with pytest.raises(RequestError) as excinfo:
        decode(frame, max_bytes=1024)
    refused(excinfo)


# -- tensor maps ------------------------------------------------------------------------------------

SHAPES = [(), (0,), (1,), (5,), (2, 3), (3, 0, 2), (2, 1, 2, 2)]


@pytest.mark.parametrize("dtype", WIRE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_map_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{shape}".encode()))
    if dtype == "bool":
        array = rng.integers(0, 2, size=shape).astype(bool)
    elif np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        array = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    else:
        array = (rng.standard_normal(shape) * 50).astype(dtype)
    tensor = tensor_to_map(array)
    assert tensor["dtype"] == dtype
    assert tensor["shape"] == list(shape)
    assert isinstance(tensor["data"], bytes)
    assert len(tensor["data"]) == array.size * np.dtype(dtype).itemsize
    assert is_tensor_map(tensor)
    back = map_to_tensor(decode(encode(tensor)))
    assert back.dtype == np.dtype(dtype)
    assert back.shape == shape
    np.testing.assert_array_equal(back, array)


def test_tensor_map_data_is_little_endian_c_order() -> None:
    array = np.array([[1, 2], [3, 4]], dtype=">i4")  # big-endian input must be converted
    tensor = tensor_to_map(array)
    assert tensor["dtype"] == "int32"
    assert tensor["data"] == np.array([1, 2, 3, 4], dtype="<i4").tobytes()
    fortran = np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3))
    assert tensor_to_map(fortran)["data"] == np.arange(6, dtype="<i2").tobytes()
    np.testing.assert_array_equal(map_to_tensor(tensor_to_map(fortran)), fortran)


def test_tensor_to_map_refuses_dtypes_not_on_the_wire() -> None:
    for array in (np.zeros(2, dtype=np.complex64), np.zeros(2, dtype=np.uint64), np.array(["a"])):
        with pytest.raises(TypeError):
            tensor_to_map(array)


def test_map_to_tensor_refuses_wrong_byte_count() -> None:
    good = tensor_to_map(np.arange(4, dtype=np.int64))
    for data in (good["data"][:-8], good["data"] + b"\x00" * 8, good["data"][:-1], b""):
        with pytest.raises(RequestError) as excinfo:
            map_to_tensor(good | {"data": data}, "tokens")
        assert "tokens" in refused(excinfo, INVALID_INPUT)
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor(good | {"shape": [2, 3]})
    refused(excinfo, INVALID_INPUT)


@pytest.mark.parametrize("dtype", ["int128", "float8", "complex64", "uint64", "object", "<i8", "", 5, None])
def test_map_to_tensor_refuses_unknown_dtype(dtype: Any) -> None:
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor({"dtype": dtype, "shape": [1], "data": b"\x00" * 8})
    refused(excinfo)


@pytest.mark.parametrize(
    "shape",
    [[-1], [2, -1], [1.0], ["2"], [True], [None], 2, "2", None, {"0": 2}, [[2]]],
    ids=repr,
)
def test_map_to_tensor_refuses_negative_or_ill_typed_shape(shape: Any) -> None:
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor({"dtype": "int8", "shape": shape, "data": b"\x00\x00"})
    refused(excinfo)


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**63], [2**64 - 1], [2**62, 4], [2**61, 2**3]], ids=repr)
def test_map_to_tensor_refuses_shapes_whose_size_overflows(shape: list[int]) -> None:
    """The byte count must be computed without wrapping: a wrapped count of 0 "matches" empty data."""
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor({"dtype": "int64", "shape": shape, "data": b""})
    refused(excinfo, INVALID_INPUT)


@pytest.mark.parametrize("rank", [1, None])
def test_a_shape_of_many_huge_dimensions_is_refused_before_its_dimensions_are_read(rank: int | None) -> None:
    """[2**64 - 1] * N once cost time quadratic in N (a product of N 64-bit factors, then its decimal
    string), and failed with an internal error. Its length alone refuses it now."""
    shape = CountingList([2**64 - 1] * 40_000)
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor({"dtype": "int64", "shape": shape, "data": b"\x00" * 8}, "tokens", rank=rank)
    message = refused(excinfo, INVALID_INPUT)
    assert shape.read == 0
    assert "40000" in message and len(message) < 200


def test_a_dimension_larger_than_the_data_is_refused_after_reading_at_most_the_rank_plus_one() -> None:
    shape = CountingList([2, 2**64 - 1])
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor({"dtype": "int8", "shape": shape, "data": b"\x00" * 4}, "x", rank=2)
    assert "cannot fit in 4 bytes" in refused(excinfo, INVALID_INPUT)
    assert shape.read <= 2 * 3  # one pass for the types, one for a zero, one for the largest


def test_map_to_tensor_refuses_a_rank_other_than_the_expected_one() -> None:
    tensor = tensor_to_map(np.arange(4, dtype=np.int64).reshape(2, 2))
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor(tensor, "tokens", rank=1)
    assert "tokens must have 1 dimension(s), its shape has 2" in refused(excinfo, INVALID_INPUT)
    assert map_to_tensor(tensor, "tokens", rank=2).shape == (2, 2)
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor({"dtype": "int8", "shape": [1] * (MAX_RANK + 1), "data": b"\x00"})
    refused(excinfo, INVALID_INPUT)


def test_empty_tensors_numpy_cannot_index_are_invalid_input() -> None:
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor({"dtype": "int64", "shape": [0, 2**62], "data": b""})
    refused(excinfo, INVALID_INPUT)


def test_error_messages_echo_at_most_a_bounded_piece_of_the_value() -> None:
    for dtype in ("x" * 1_000_000, [1] * 1_000_000, {"k" * 100: "v" * 100}):
        with pytest.raises(RequestError) as excinfo:
            map_to_tensor({"dtype": dtype, "shape": [1], "data": b"\x00"})
        assert len(refused(excinfo)) < ECHO_CHARS + 120


@pytest.mark.parametrize("data", ["AAAAAAAAAAA=", [0] * 8, None, 0], ids=repr)
def test_map_to_tensor_refuses_non_bytes_data(data: Any) -> None:
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor({"dtype": "int64", "shape": [1], "data": data})
    refused(excinfo)


@pytest.mark.parametrize(
    "value",
    [[1, 2], "tensor", None, {"dtype": "int64", "shape": [1]}, {"shape": [1], "data": b"\x00" * 8}],
    ids=["list", "str", "nil", "no-data", "no-dtype"],
)
def test_map_to_tensor_refuses_non_tensor_maps(value: Any) -> None:
    assert not is_tensor_map(value)
    with pytest.raises(RequestError) as excinfo:
        map_to_tensor(value, "x")
    refused(excinfo)


def test_map_to_tensor_returns_a_usable_array() -> None:
    tensor = tensor_to_map(np.arange(3, dtype=np.float32))
    array = map_to_tensor(tensor)
    assert array.dtype == np.float32 and array.dtype.isnative
    assert (array + 1).tolist() == [1.0, 2.0, 3.0]


# -- replies -----------------------------------------------------------------------------------------


def test_decode_outputs_turns_tensor_maps_into_arrays_and_leaves_the_rest() -> None:
    h = np.linspace(-1, 1, 8, dtype=np.float32)
    tokens = np.array([4, 5, 6], dtype=np.int64)
    reply = decode(encode({"h": h, "tokens": tokens, "plain": [1, 2], "count": 3, "label": "x"}))
    outputs = decode_outputs(reply)
    np.testing.assert_array_equal(outputs["h"], h)
    assert outputs["h"].dtype == np.float32
    np.testing.assert_array_equal(outputs["tokens"], tokens)
    assert outputs["plain"] == [1, 2] and outputs["count"] == 3 and outputs["label"] == "x"
    assert decode_outputs({}) == {}


def test_decode_outputs_refuses_a_broken_tensor_map() -> None:
    with pytest.raises(RequestError) as excinfo:
        decode_outputs({"h": {"dtype": "float32", "shape": [4], "data": b"\x00" * 15}})
    assert "h" in refused(excinfo, INVALID_INPUT)


def test_error_reply_shape() -> None:
    for code in ERROR_CODES:
        reply = decode(encode(error_reply("r1", code, "what went wrong")))
        assert reply == {"id": "r1", "ok": False, "error": {"code": code, "message": "what went wrong"}}
    assert decode(encode(error_reply(None, BAD_REQUEST, "no id")))["id"] is None


def test_request_error_carries_code_and_message() -> None:
    error = RequestError(BAD_REQUEST, "bad thing")
    assert error.code == BAD_REQUEST and error.message == "bad thing" and str(error) == "bad thing"
