"""Error replies packed from a template: per reply, only the request's id is packed.

Under a flood nearly every reply is a refusal, and refusals come in runs that share their error (the
same code, and the same message while the quoted wait stays the same), so building each reply's map
and packing it whole would cost the manager more than deciding the refusal did. A frame holds the
same bytes as `encode(error_reply(...))`; the encoded rest of the reply is kept per error, for a
bounded number of distinct errors. A refusal's `retry_after_ms`, which differs from one refused request
to the next, is the reply's last value: it is packed per reply, after the template, like the id.
"""

from __future__ import annotations

from typing import Any

import msgpack

from batchmaker.common.protocol import RequestError, encode, error_reply

ID_AT = len(encode({"id": None})) - 1  # where the id's value starts in a small map whose first key is "id"
MAX_TEMPLATES = 64  # distinct errors kept encoded; all are dropped when one more comes


class ErrorFrames:
    def __init__(self, max_templates: int = MAX_TEMPLATES):
        self._max_templates = max_templates
        # the bytes around the id, per (code, message, whether a retry_after_ms ends the reply)
        self._templates: dict[tuple[str, str, bool], tuple[bytes, bytes]] = {}
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def frame(self, request_id: Any, error: RequestError, retry_after_ms: int | None = None) -> bytes:
        """The encoded error reply to `request_id` (an int, a str or None, as the frontend echoes ids)."""
        quoted = retry_after_ms is not None
        key = (error.code, error.message, quoted)
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= self._max_templates:
                self._templates.clear()
            # Its id, None, packs as one byte, and so does a retry_after_ms of 0, the reply's last value.
            packed = encode(error_reply(None, error.code, error.message, 0 if quoted else None))
            template = self._templates[key] = (packed[:ID_AT], packed[ID_AT + 1 : len(packed) - quoted])
        head, tail = template
        frame = head + self._pack(request_id) + tail
        return frame + self._pack(retry_after_ms) if quoted else frame

    def __len__(self) -> int:
        return len(self._templates)
