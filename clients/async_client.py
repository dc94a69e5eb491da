"""asyncio client: many requests in flight over one DEALER socket.

Replies may come back in any order (docs/protocol.md), so a single receive
task routes each one to the Future registered under its id. This is what a
service or a load generator uses to keep the server's batches full.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import zmq
import zmq.asyncio

from common.auth import apply_curve_client
from common.protocol import encode

from .sync_client import (
    DEFAULT_ADDRESS,
    DEFAULT_TIMEOUT,
    CurveKeys,
    Reply,
    check,
    infer_message,
    read_reply,
    to_infer_reply,
)


class AsyncClient:
    """Concurrent client for one event loop; `asyncio.gather` thousands of `infer` calls on it.

    Use it from a single event loop (the one that first calls it) and close it there.
    """

    def __init__(
        self, address: str = DEFAULT_ADDRESS, timeout: float = DEFAULT_TIMEOUT, curve: CurveKeys | None = None
    ):
        self.address = address
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._pending: dict[int | str, asyncio.Future[dict[str, Any]]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._closed_reason: str | None = None
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Replies are bounded by the requests in flight; an unbounded receive queue keeps
        # a burst of them from filling the server's ROUTER pipe, which would drop replies.
        self._socket.setsockopt(zmq.RCVHWM, 0)
        if curve is not None:
            apply_curve_client(self._socket, Path(curve[0]), Path(curve[1]))
        self._socket.connect(address)

    async def infer(
        self,
        model: str,
        inputs: dict[str, Any],
        deadline_ms: int | None = None,
        priority: int | None = None,
    ) -> Reply:
        """Run one inference; numpy arrays in `inputs` travel as tensor maps."""
        return to_infer_reply(await self.call(infer_message(model, inputs, deadline_ms, priority)))

    async def models(self) -> dict[str, Any]:
        return await self.call({"op": "models"})

    async def health(self) -> dict[str, Any]:
        return await self.call({"op": "health"})

    async def stats(self) -> dict[str, Any]:
        return await self.call({"op": "stats"})

    async def cancel(self, target_id: int | str) -> dict[str, Any]:
        """Ask the server to drop a request this client sent (pass your own id to `call` to know it)."""
        return await self.call({"op": "cancel", "target": target_id})

    async def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its reply map, raising ServerError for `ok: false`.

        A fresh id is assigned unless the message has one; a caller-chosen id must not
        already be in flight on this client, or its reply could not be routed.
        """
        if self._closed_reason is not None:
            raise ConnectionError(self._closed_reason)
        if "id" in message:
            request_id = message["id"]
            if request_id in self._pending:
                raise ValueError(f"request id {request_id!r} is already in flight on this client")
        else:
            request_id = next(self._ids)
            while request_id in self._pending:
                request_id = next(self._ids)
            message = {**message, "id": request_id}
        frame = encode(message)
        reply_future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = reply_future
        self._ensure_receiver()
        # Only the reply is awaited: the send completes at once unless zmq's queue is full,
        # and a send that fails or is cancelled by close() fails the reply instead.
        sent = self._socket.send(frame)
        sent.add_done_callback(lambda done: self._on_sent(done, request_id, reply_future))
        try:
            async with asyncio.timeout(self.timeout):
                reply = await reply_future
        except TimeoutError:
            raise TimeoutError(
                f"no reply from {self.address} within {self.timeout:g} s to request {request_id!r}; "
                "is the server running?"
            ) from None
        finally:
            if self._pending.get(request_id) is reply_future:
                del self._pending[request_id]
            reply_future.cancel()
            sent.cancel()
        return check(reply)

    async def close(self) -> None:
        """Stop receiving and fail every request still waiting with a ConnectionError."""
        if self._socket.closed:
            return
        if self._closed_reason is None:
            self._closed_reason = f"AsyncClient for {self.address} is closed"
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._fail_pending(f"AsyncClient for {self.address} was closed before the reply arrived")
        self._socket.close(linger=0)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    def _ensure_receiver(self) -> None:
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive(), name=f"AsyncClient {self.address}")

    async def _receive(self) -> None:
        """Route each reply to its waiting call; replies nobody waits for (timed out) are dropped."""
        try:
            while True:
                reply = read_reply(await self._socket.recv())
                if reply is None:
                    continue
                future = self._pending.pop(reply["id"], None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except Exception as exc:  # whatever ends this loop must not leave calls waiting for their timeout
            self._closed_reason = f"AsyncClient for {self.address} stopped receiving: {type(exc).__name__}: {exc}"
            self._fail_pending(self._closed_reason)

    def _on_sent(
        self,
        sent: asyncio.Future[Any],
        request_id: int | str,
        reply_future: asyncio.Future[dict[str, Any]],
    ) -> None:
        if reply_future.done():
            return
        if sent.cancelled():
            reply_future.set_exception(ConnectionError(f"request {request_id!r} was not sent: the socket was closed"))
        elif sent.exception() is not None:
            reply_future.set_exception(
                ConnectionError(f"cannot send request {request_id!r} to {self.address}: {sent.exception()}")
            )

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for request_id, future in pending.items():
            if not future.done():
                future.set_exception(ConnectionError(f"{reason} (request {request_id!r})"))
