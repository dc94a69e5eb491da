"""Logging for every process: plain text for people, or one JSON object per line for log pipelines.

`BATCHMAKER_LOG_FORMAT=json` (which `batchmaker serve --log-format json` sets for all its
processes) selects JSON; fields given as `extra=` on a log call (request_id, model,
outcome, ...) become keys of the object.
"""

from __future__ import annotations

import json
import logging
import os
import time

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "role": self.role,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(role: str) -> None:
    handler = logging.StreamHandler()
    if os.environ.get("BATCHMAKER_LOG_FORMAT") == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
