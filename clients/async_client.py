"""asyncio client: many requests in flight over one DEALER socket per server.

Replies may come back in any order (docs/protocol.md), so one receive task per
server routes each reply to the Future registered under its id. Given several
server addresses, each request goes to the server with the fewest outstanding
requests, and a server that is lost has its unanswered requests sent to the others
(docs/protocol.md, "Several servers"). This is what a service or a load generator
uses to keep the servers' batches full.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Self

import zmq
import zmq.asyncio

from batchmaker.common.protocol import encode, is_partial

from .errors import ServerLost
from .servers import (
    ASIDE,
    DEFAULT_HEALTH_INTERVAL,
    DEFAULT_HEALTH_TIMEOUT,
    RequestId,
    Server,
    ServerSet,
    as_addresses,
    connection_closed,
    is_probe,
)
from .sessions import SessionSteps
from .streams import Partial, cancel_message, restart_notice
from .sync_client import (
    DEFAULT_ADDRESS,
    DEFAULT_TIMEOUT,
    CurveKeys,
    Reply,
    check,
    connect_dealer,
    infer_message,
    read_reply,
    timeout_error,
    to_infer_reply,
    to_stream_item,
)


class _Call:
    """A request awaiting its reply: its frame (kept to send it again), the server holding it, its last send.

    A streamed request's partials go to `partials`, followed by None once `future` is done."""

    __slots__ = ("frame", "future", "server", "sent", "refused_by", "partials", "streamed", "restart")

    def __init__(self, frame: bytes, future: asyncio.Future[dict[str, Any]], stream: bool = False):
        self.frame = frame
        self.future = future
        self.server: Server | None = None  # None while no server is up to take it
        self.sent: asyncio.Future[Any] | None = None
        self.refused_by: set[Server] = set()  # servers that answered it with a retryable error
        self.partials: asyncio.Queue[dict[str, Any] | None] | None = None
        self.streamed = False  # partials were delivered
        self.restart = False  # it was sent again since: the next partial delivered says so
        if stream:
            partials = self.partials = asyncio.Queue()
            future.add_done_callback(lambda _: partials.put_nowait(None))

    def deliver(self, reply: dict[str, Any]) -> None:
        assert self.partials is not None
        if self.restart:
            reply, self.restart = {**reply, "restarted": True}, False
        self.streamed = True
        self.partials.put_nowait(reply)

    def answer(self, reply: dict[str, Any]) -> None:
        if self.restart:  # resent, and answered before any new partial: the caller still learns of it
            self.deliver(restart_notice(reply["id"]))
        self.future.set_result(reply)


class AsyncClient:
    """Concurrent client for one event loop; `asyncio.gather` thousands of `infer` calls on it.

    `address` is one server or several. With several, `resend=False` fails the requests
    of a lost server with ServerLost instead of sending them to another server, and
    `health_interval` / `health_timeout` (seconds) set how soon a silent server is
    probed and set aside. Use it from a single event loop (the one that first calls
    it) and close it there.
    """

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        timeout: float = DEFAULT_TIMEOUT,
        curve: CurveKeys | None = None,
        resend: bool = True,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
    ):
        self.addresses = as_addresses(address)
        self.address = ", ".join(self.addresses)
        self.timeout = timeout
        self.resend = resend
        self._servers = ServerSet(self.addresses, health_interval, health_timeout)
        self._ids = itertools.count(1)
        self._pending: dict[RequestId, _Call] = {}
        self._parked: dict[RequestId, _Call] = {}  # requests waiting for a server to be up
        self._tasks: list[asyncio.Task[None]] = []
        self._closed_reason: str | None = None
        self.resent = 0  # requests sent again because their server was lost or draining
        self.sessions = SessionSteps()
        context = zmq.asyncio.Context.instance()
        # Replies are bounded by the requests in flight; an unbounded receive queue keeps
        # a burst of them from filling the server's ROUTER pipe, which would drop replies.
        self._sockets = [connect_dealer(context, a, curve, receive_queue_unbounded=True) for a in self.addresses]
        self._monitors = (
            [socket.get_monitor_socket(zmq.EVENT_DISCONNECTED) for socket in self._sockets]
            if self._servers.failover
            else []
        )

    async def infer(
        self,
        model: str,
        inputs: dict[str, Any],
        deadline_ms: int | None = None,
        priority: int | None = None,
        session: str | None = None,
        session_end: bool = False,
    ) -> Reply:
        """Run one inference; numpy arrays in `inputs` travel as tensor maps. `session` continues that
        server-held session (docs/protocol.md, "Sessions"); `session_end` ends it once answered."""
        message = infer_message(model, inputs, deadline_ms, priority)
        if session is None:
            return to_infer_reply(await self.call(message))
        server = self.sessions.server(session, self._servers.pick)
        reply = await self._call(message | self.sessions.fields(session, session_end), server)
        self.sessions.answered(session, session_end, reply)
        return to_infer_reply(reply)

    async def stream(
        self,
        model: str,
        inputs: dict[str, Any],
        deadline_ms: int | None = None,
        priority: int | None = None,
    ) -> AsyncIterator[Partial | Reply]:
        """Run one inference with `stream: true`: yield each Partial as it arrives, then the final Reply.

        A Partial with `restarted` set voids those before it (the request started over on another
        server or worker). Closing the iterator early cancels the request (`contextlib.aclosing` closes
        it when its block ends); `timeout` bounds the whole stream."""
        request_id, call = self._start(infer_message(model, inputs, deadline_ms, priority, True), None, stream=True)
        assert call.partials is not None
        until = time.monotonic() + self.timeout
        try:
            while True:
                try:
                    reply = await asyncio.wait_for(call.partials.get(), until - time.monotonic())
                except TimeoutError:
                    raise timeout_error(self.address, self.timeout, request_id, parked=call.server is None) from None
                if reply is None:
                    break
                yield to_stream_item(reply)
            yield to_stream_item(call.future.result())
        finally:
            if not call.future.done() and call.server is not None:
                sent = self._sockets[call.server.index].send(cancel_message(request_id, next(self._ids)), zmq.NOBLOCK)
                sent.add_done_callback(_ignore_outcome)
            self._forget(request_id, call)

    async def models(self) -> dict[str, Any]:
        return await self.call({"op": "models"})

    async def health(self) -> dict[str, Any]:
        return await self.call({"op": "health"})

    async def stats(self) -> dict[str, Any]:
        return await self.call({"op": "stats"})

    async def cancel(self, target_id: int | str) -> dict[str, Any]:
        """Ask the server holding a request this client sent to drop it (pass your own id to `call` to know it)."""
        target = self._pending.get(target_id)
        return await self._call({"op": "cancel", "target": target_id}, target.server if target else None)

    async def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its reply map, raising ServerError for `ok: false`.

        A fresh id is assigned unless the message has one; a caller-chosen id must not
        already be in flight on this client, or its reply could not be routed.
        """
        return await self._call(message, None)

    def outstanding(self) -> dict[str, int]:
        """How many requests each server owes an answer, by address."""
        return {server.address: len(server.outstanding) for server in self._servers.servers}

    async def _call(self, message: dict[str, Any], server: Server | None) -> dict[str, Any]:
        request_id, call = self._start(message, server)
        try:
            async with asyncio.timeout(self.timeout):
                reply = await call.future
        except TimeoutError:
            raise timeout_error(self.address, self.timeout, request_id, parked=call.server is None) from None
        finally:
            self._forget(request_id, call)
        return check(reply)

    def _start(self, message: dict[str, Any], server: Server | None, stream: bool = False) -> tuple[RequestId, _Call]:
        """Give the request an id and send it (or park it); the caller awaits and then forgets it."""
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
        call = _Call(encode(message), asyncio.get_running_loop().create_future(), stream)
        self._pending[request_id] = call
        self._ensure_started()
        self._dispatch(request_id, call, server)
        return request_id, call

    def _dispatch(self, request_id: RequestId, call: _Call, server: Server | None = None) -> None:
        """Send a request to `server`, else to the least loaded up server, else park it until one is up."""
        if server is None or server.state == ASIDE:
            server = self._servers.pick()
        call.server = server
        call.restart = call.streamed  # a stream sent again starts over
        if server is None:
            self._parked[request_id] = call
            return
        self._servers.sent(server, request_id, time.monotonic())
        # Only the reply is awaited: the send completes at once unless zmq's queue is full,
        # and a send that fails or is cancelled by close() fails the reply instead.
        sent = call.sent = self._sockets[server.index].send(call.frame)
        sent.add_done_callback(lambda done: self._on_sent(done, request_id, call))

    def _forget(self, request_id: RequestId, call: _Call) -> None:
        if self._pending.get(request_id) is call:
            del self._pending[request_id]
        self._parked.pop(request_id, None)
        if call.server is not None:
            call.server.outstanding.discard(request_id)
        call.future.cancel()
        if call.sent is not None:
            call.sent.cancel()

    async def close(self) -> None:
        """Stop receiving and fail every request still waiting with a ConnectionError."""
        if self._sockets[0].closed:
            return
        if self._closed_reason is None:
            self._closed_reason = f"AsyncClient for {self.address} is closed"
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_pending(f"AsyncClient for {self.address} was closed before the reply arrived")
        for socket in self._sockets:
            if self._monitors:
                socket.disable_monitor()
            socket.close(linger=0)
        for monitor in self._monitors:
            monitor.close(linger=0)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    def _ensure_started(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        for server, socket in zip(self._servers.servers, self._sockets):
            self._tasks.append(loop.create_task(self._receive(server, socket), name=f"AsyncClient {server.address}"))
        for server, monitor in zip(self._servers.servers, self._monitors):
            self._tasks.append(loop.create_task(self._watch_connection(server, monitor)))
        if self._servers.failover:
            self._tasks.append(loop.create_task(self._watch_health()))

    async def _receive(self, server: Server, socket: zmq.asyncio.Socket) -> None:
        """Route each reply to its waiting call; replies nobody waits for (timed out, answered) are dropped."""
        try:
            while True:
                reply = read_reply(await socket.recv())
                if reply is not None:
                    self._on_reply(server, reply)
        except Exception as exc:  # whatever ends this loop must not leave calls waiting for their timeout
            self._closed_reason = f"AsyncClient for {self.address} stopped receiving: {type(exc).__name__}: {exc}"
            self._fail_pending(self._closed_reason)

    def _on_reply(self, server: Server, reply: dict[str, Any]) -> None:
        request_id = reply["id"]
        self._servers.heard(server, time.monotonic())
        if is_probe(request_id):
            if self._servers.probe_answered(server, reply):
                self._dispatch_parked()
            return
        call = self._pending.get(request_id)
        if call is None or call.future.done():
            return
        if call.server is not server and (reply.get("ok") is False or call.partials is not None):
            return  # an error, or part of a stream, from a server the request already left
        if is_partial(reply):
            if call.partials is not None:
                call.deliver(reply)
            return
        target = self._servers.retry_target(server, reply, call.refused_by)
        if target is not None:
            server.outstanding.discard(request_id)
            self.resent += 1
            self._dispatch(request_id, call, target)
            return
        call.answer(reply)

    async def _watch_connection(self, server: Server, monitor: zmq.asyncio.Socket) -> None:
        while True:
            if connection_closed(await monitor.recv_multipart()):
                self._server_lost(server, "its connection closed")

    async def _watch_health(self) -> None:
        """Probe quiet servers and set aside those whose probe goes unanswered."""
        period = min(self._servers.health_interval, self._servers.health_timeout) / 4
        while True:
            await asyncio.sleep(period)
            probes, lost = self._servers.tick(time.monotonic())
            for server in lost:
                self._server_lost(server, f"no answer to health within {self._servers.health_timeout:g} s")
            for server, probe_id in probes:
                sent = self._sockets[server.index].send(encode({"op": "health", "id": probe_id}), zmq.NOBLOCK)
                sent.add_done_callback(_ignore_outcome)  # a probe that cannot be queued is simply retried later

    def _server_lost(self, server: Server, reason: str) -> None:
        if server.state == ASIDE:
            return
        for request_id in self._servers.set_aside(server):
            call = self._pending.get(request_id)
            if call is None or call.future.done():
                continue
            if self.resend:
                self.resent += 1
                self._dispatch(request_id, call)
            else:
                call.future.set_exception(ServerLost(server.address, request_id, reason))

    def _dispatch_parked(self) -> None:
        parked, self._parked = self._parked, {}
        for request_id, call in parked.items():
            if not call.future.done():
                self._dispatch(request_id, call)

    def _on_sent(self, sent: asyncio.Future[Any], request_id: RequestId, call: _Call) -> None:
        if call.future.done() or sent is not call.sent:
            return
        if sent.cancelled():
            call.future.set_exception(ConnectionError(f"request {request_id!r} was not sent: the socket was closed"))
        elif sent.exception() is not None:
            address = call.server.address if call.server is not None else self.address
            call.future.set_exception(
                ConnectionError(f"cannot send request {request_id!r} to {address}: {sent.exception()}")
            )

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        self._parked = {}
        for request_id, call in pending.items():
            if not call.future.done():
                call.future.set_exception(ConnectionError(f"{reason} (request {request_id!r})"))


def _ignore_outcome(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled():
        sent.exception()
