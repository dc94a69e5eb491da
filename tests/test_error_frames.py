"""Error replies packed from templates: the same bytes as packing the reply's map whole."""

from __future__ import annotations

from typing import Any

import pytest

from batchmaker.common.protocol import BAD_REQUEST, OVERLOADED, RequestError, decode, encode, error_reply
from batchmaker.manager.loop.error_frames import ErrorFrames

IDS = [0, 1, -1, 127, 128, 2**32, 2**63, -(2**63), "", "r1", "é" * 40, "x" * 256, None]


@pytest.mark.parametrize("request_id", IDS)
def test_a_frame_holds_the_bytes_of_the_packed_reply(request_id: Any):
    frames = ErrorFrames()
    for error in (RequestError(OVERLOADED, "estimated wait 300 ms; retry later"), RequestError(BAD_REQUEST, "")):
        frame = frames.frame(request_id, error)
        assert frame == encode(error_reply(request_id, error.code, error.message))
        assert decode(frame) == {"id": request_id, "ok": False, "error": {"code": error.code, "message": error.message}}


def test_errors_that_say_the_same_share_a_template_and_templates_are_bounded():
    frames = ErrorFrames(max_templates=3)
    for request_id in range(10):
        frames.frame(request_id, RequestError(OVERLOADED, "estimated wait 300 ms"))
    assert len(frames) == 1
    for wait in range(3):
        frames.frame(1, RequestError(OVERLOADED, f"estimated wait {wait} ms"))
    assert len(frames) == 1  # the fourth error found the templates full and dropped them
    assert decode(frames.frame(7, RequestError(OVERLOADED, "estimated wait 300 ms")))["error"]["message"] == (
        "estimated wait 300 ms"
    )


def test_a_refusal_saying_when_to_retry_has_its_own_template():
    frames = ErrorFrames()
    error = RequestError(OVERLOADED, "estimated wait 300 ms; retry later")
    frame = frames.frame(5, error, retry_after_ms=250)
    assert frame == encode(error_reply(5, error.code, error.message, 250))
    assert decode(frame)["error"] == {"code": OVERLOADED, "message": error.message, "retry_after_ms": 250}
    assert "retry_after_ms" not in decode(frames.frame(6, error))["error"]
    assert len(frames) == 2


@pytest.mark.parametrize("retry_after_ms", [0, 1, 127, 128, 65_535, 2**31])
def test_refusals_quoting_different_waits_share_one_template(retry_after_ms: int):
    frames = ErrorFrames()
    error = RequestError(OVERLOADED, "estimated wait 300 ms; retry later")
    for request_id in ("r1", 7):
        frame = frames.frame(request_id, error, retry_after_ms)
        assert frame == encode(error_reply(request_id, error.code, error.message, retry_after_ms))
    frames.frame(8, error, retry_after_ms + 1)
    assert len(frames) == 1
