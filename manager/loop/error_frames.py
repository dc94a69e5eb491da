"""Error replies packed from a template: per reply, only the request's id is packed.

Under a flood nearly every reply is a refusal, and refusals come in runs that share their error (the
same code, and the same message while the quoted wait stays the same), so building each reply's map
and packing it whole would cost the manager more than deciding the refusal did. A frame holds the
same bytes as `encode(error_reply(...))`; the encoded rest of the reply is kept per error, for a
bounded number of distinct errors.
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
        # the bytes around the id, per (code, message, retry_after_ms)
        self._templates: dict[tuple[str, str, int | None], tuple[bytes, bytes]] = {}
        self._pack_id = msgpack.Packer(use_bin_type=True).pack

    def frame(self, request_id: Any, error: RequestError, retry_after_ms: int | None = None) -> bytes:
        """The encoded error reply to `request_id` (an int, a str or None, as the frontend echoes ids)."""
        key = (error.code, error.message, retry_after_ms)
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= self._max_templates:
                self._templates.clear()
            packed = encode(error_reply(None, *key))  # its id, None, packs as one byte
            template = self._templates[key] = (packed[:ID_AT], packed[ID_AT + 1 :])
        head, tail = template
        return head + self._pack_id(request_id) + tail

    def __len__(self) -> int:
        return len(self._templates)
