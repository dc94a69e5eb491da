"""Structured logs: one JSON object per line, with request fields as keys."""

from __future__ import annotations

import json
import logging

from batchmaker.common.logs import JsonFormatter


def test_json_lines_carry_extra_request_fields():
    record = logging.LogRecord("batchmaker.manager", logging.INFO, __file__, 1, "request %r ended", ("a",), None)
    record.request_id = "a"
    record.outcome = "CANCELLED"
    entry = json.loads(JsonFormatter("manager").format(record))
    assert entry["message"] == "request 'a' ended"
    assert entry["role"] == "manager" and entry["level"] == "info"
    assert entry["request_id"] == "a" and entry["outcome"] == "CANCELLED"
    assert entry["ts"].endswith("Z")
