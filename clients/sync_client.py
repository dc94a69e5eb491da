"""Blocking client for the batchmaker wire protocol (docs/protocol.md).

It is deliberately thin: one DEALER socket, one msgpack frame per request, and
nothing but pyzmq, msgpack, numpy and common.protocol, so any service can embed it.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import zmq

from common.auth import apply_curve_client
from common.protocol import INTERNAL, RequestError, decode, decode_outputs, encode

from .errors import ServerError

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT = 30.0
CurveKeys = tuple[str | Path, str | Path]  # (client secret key file, server public key file)

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """A successful inference: outputs with tensor maps turned into arrays, and the server's timing."""

    outputs: dict[str, Any]
    timing: dict[str, int]


def infer_message(model: str, inputs: dict[str, Any], deadline_ms: int | None, priority: int | None) -> dict[str, Any]:
    """Build an infer request, leaving out optional fields so the server applies its defaults."""
    message: dict[str, Any] = {"op": "infer", "model": model, "inputs": inputs}
    if deadline_ms is not None:
        message["deadline_ms"] = deadline_ms
    if priority is not None:
        message["priority"] = priority
    return message


def read_reply(frame: bytes) -> dict[str, Any] | None:
    """Decode one reply frame, or return None (logged) when it cannot be matched to a request."""
    try:
        reply = decode(frame)
    except RequestError as exc:
        log.warning("dropping an undecodable reply: %s", exc.message)
        return None
    request_id = reply.get("id") if isinstance(reply, dict) else None
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
        log.warning("dropping a reply without an int or str id")
        return None
    return reply


def check(reply: dict[str, Any]) -> dict[str, Any]:
    """Return a successful reply, or raise ServerError for an `ok: false` one."""
    if reply.get("ok") is True:
        return reply
    error = reply.get("error")
    if not isinstance(error, dict):
        error = {}
    raise ServerError(
        str(error.get("code", INTERNAL)),
        str(error.get("message", "the server reported an error without a message")),
        reply.get("id"),
    )


def to_infer_reply(reply: dict[str, Any]) -> Reply:
    return Reply(outputs=decode_outputs(reply.get("outputs") or {}), timing=reply.get("timing") or {})


class Client:
    """One request at a time over one DEALER socket.

    Not thread-safe, like the zmq socket under it: use one Client per thread, or
    AsyncClient to keep many requests in flight.
    """

    def __init__(
        self, address: str = DEFAULT_ADDRESS, timeout: float = DEFAULT_TIMEOUT, curve: CurveKeys | None = None
    ):
        """`curve`: (this client's secret key file, the server's public key file) for a server with CurveZMQ on."""
        self.address = address
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            apply_curve_client(self._socket, Path(curve[0]), Path(curve[1]))
        self._socket.connect(address)

    def infer(
        self,
        model: str,
        inputs: dict[str, Any],
        deadline_ms: int | None = None,
        priority: int | None = None,
    ) -> Reply:
        """Run one inference; numpy arrays in `inputs` travel as tensor maps."""
        return to_infer_reply(self.call(infer_message(model, inputs, deadline_ms, priority)))

    def models(self) -> dict[str, Any]:
        return self.call({"op": "models"})

    def health(self) -> dict[str, Any]:
        return self.call({"op": "health"})

    def stats(self) -> dict[str, Any]:
        return self.call({"op": "stats"})

    def cancel(self, target_id: int | str) -> dict[str, Any]:
        """Ask the server to drop an earlier request on this connection, e.g. one whose call timed out.

        The server only looks up ids sent over the same socket, so cancel through the
        client that sent the target.
        """
        return self.call({"op": "cancel", "target": target_id})

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its reply map.

        A fresh id is assigned unless the message has one. Replies to other ids, left
        over from earlier calls that timed out, are skipped.
        """
        if "id" not in message:
            message = {**message, "id": next(self._ids)}
        request_id = message["id"]
        frame = encode(message)
        deadline = time.monotonic() + self.timeout
        if not self._socket.poll(self._remaining_ms(deadline), zmq.POLLOUT):
            raise self._timed_out(request_id)
        self._socket.send(frame, zmq.NOBLOCK)
        while True:
            if not self._socket.poll(self._remaining_ms(deadline), zmq.POLLIN):
                raise self._timed_out(request_id)
            reply = read_reply(self._socket.recv())
            if reply is not None and reply["id"] == request_id:
                return check(reply)

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @staticmethod
    def _remaining_ms(deadline: float) -> int:
        return max(0, int((deadline - time.monotonic()) * 1000))

    def _timed_out(self, request_id: Any) -> TimeoutError:
        return TimeoutError(
            f"no reply from {self.address} within {self.timeout:g} s to request {request_id!r}; is the server running?"
        )
