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
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

import zmq
import zmq.asyncio

from batchmaker.common.protocol import encode, is_partial

from .base import ClientBase, Outgoing
from .errors import SESSION_ON_SERVER, SET_ASIDE, ServerLost
from .messages import CurveKeys, Reply, check, connect_dealer, read_reply, timeout_error, to_stream_item
from .servers import ASIDE, RequestId, Server, connection_closed, is_probe
from .streams import Partial, cancel_message, restart_notice


class _Call:
    """A request awaiting its reply: the request, the server holding it, its last send, its backoff's timer.

    A streamed request's partials go to `partials`, followed by None once `future` is done."""

    __slots__ = ("request", "future", "server", "sent", "timer", "partials", "streamed", "restart")

    def __init__(self, request: Outgoing, future: asyncio.Future[dict[str, Any]], stream: bool = False):
        self.request = request
        self.future = future
        self.server: Server | None = None  # None while no server is up to take it
        self.sent: asyncio.Future[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None  # sends it again once its backoff ends
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


class AsyncClient(ClientBase):
    """Concurrent client for one event loop; `asyncio.gather` thousands of `infer` calls on it.

    `address` is one server or several. With several, `resend=False` fails the requests
    of a lost server with ServerLost instead of sending them to another server, and
    `health_interval` / `health_timeout` (seconds) set how soon a silent server is
    probed and set aside. A request refused with OVERLOADED is sent again after a
    growing backoff while its deadline and timeout allow (docs/protocol.md, "Retries"); one larger than
    the server accepts raises RequestTooLarge unsent. Use it from a single event loop
    (the one that first calls it) and close it there.
    """

    def _connect(self, curve: CurveKeys | None) -> None:
        self._pending: dict[RequestId, _Call] = {}
        self._parked: dict[RequestId, _Call] = {}  # requests waiting for a server to be up
        self._in_order = asyncio.Lock()  # first come, first sent: held while a server is asked its limit
        self._tasks: list[asyncio.Task[None]] = []
        self._closed_reason: str | None = None
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
        version: int | None = None,
    ) -> Reply:
        """Run one inference; numpy arrays in `inputs` travel as tensor maps. `session` continues that
        server-held session (docs/protocol.md, "Sessions"); `session_end` ends it once answered. `version`
        asks for that version of the model (default: the newest ready one; a session's, for a session)."""
        message, server = self._infer_request(
            model, inputs, deadline_ms, priority, session, session_end, stream=False, version=version
        )
        return self._infer_reply(await self._call(message, server), session, session_end)

    async def stream(
        self,
        model: str,
        inputs: dict[str, Any],
        deadline_ms: int | None = None,
        priority: int | None = None,
        version: int | None = None,
        trace_context: dict[str, str] | None = None,
    ) -> AsyncIterator[Partial | Reply]:
        """Run one inference with `stream: true`: yield each Partial as it arrives, then the final Reply.

        A Partial with `restarted` set voids those before it (the request started over on another
        server or worker). Closing the iterator early cancels the request (`contextlib.aclosing` closes
        it when its block ends); `timeout` bounds the whole stream. `version` as for `infer`;
        `trace_context` (`traceparent`, `tracestate`) is sent instead of the current span's: a proxy's caller's."""
        message, _ = self._infer_request(
            model, inputs, deadline_ms, priority, None, False, stream=True, version=version, trace=trace_context
        )
        request_id, call = await self._start(message, None, stream=True)
        assert call.partials is not None
        try:
            while True:
                try:
                    reply = await asyncio.wait_for(call.partials.get(), call.request.until - time.monotonic())
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
        return await self._answer(*await self._start(message, server))

    async def _answer(self, request_id: RequestId, call: _Call) -> dict[str, Any]:
        """Await a started request's reply within its timeout, then forget the request."""
        try:
            async with asyncio.timeout(call.request.until - time.monotonic()):
                reply = await call.future
        except TimeoutError:
            raise timeout_error(self.address, self.timeout, request_id, parked=call.server is None) from None
        finally:
            self._forget(request_id, call)
        return check(reply)

    async def _start(
        self, message: dict[str, Any], server: Server | None, stream: bool = False
    ) -> tuple[RequestId, _Call]:
        """Give the request an id, size it and send it (or park it); the caller awaits and then forgets it.

        Requests leave in the order of the calls (a session's pipelined requests run in it), also while
        a server is asked its max_message_bytes: requests that come meanwhile wait for the answer."""
        if self._closed_reason is not None:
            raise ConnectionError(self._closed_reason)
        request = self._outgoing(message, server, self._pending)
        async with self._in_order:
            for asked in self._limits_to_ask(request):
                question = self._send_new(self._outgoing({"op": "health"}, asked, self._pending))
                self._heard_limit(asked, await self._answer(*question))
            return self._send_new(request, stream)

    def _send_new(self, request: Outgoing, stream: bool = False) -> tuple[RequestId, _Call]:
        """Size a request and send it (or park it), now."""
        self._check_size(request)
        if request.request_id in self._pending:  # taken while a limit was asked
            raise ValueError(f"request id {request.request_id!r} is already in flight on this client")
        call = _Call(request, asyncio.get_running_loop().create_future(), stream)
        self._pending[request.request_id] = call
        self.sessions.sending(request.message)
        self._ensure_started()
        self._dispatch(request.request_id, call, request.home)
        return request.request_id, call

    def _dispatch(self, request_id: RequestId, call: _Call, server: Server | None = None) -> None:
        """Send a request to `server`, else to the least loaded up server, else park it until one is up."""
        if server is not None and server.state == ASIDE and self._stays_home(call.request):
            call.future.set_exception(ServerLost(server.address, request_id, SET_ASIDE, SESSION_ON_SERVER))
            return
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
        sent = call.sent = self._sockets[server.index].send(call.request.frame)
        sent.add_done_callback(lambda done: self._on_sent(done, request_id, call))

    def _forget(self, request_id: RequestId, call: _Call) -> None:
        if self._pending.get(request_id) is call:
            del self._pending[request_id]
            self.sessions.settled(call.request.message)
        self._parked.pop(request_id, None)
        if call.server is not None:
            call.server.outstanding.discard(request_id)
        call.future.cancel()
        if call.sent is not None:
            call.sent.cancel()
        if call.timer is not None:
            call.timer.cancel()

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
        now = time.monotonic()
        self._servers.heard(server, now)
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
        resend = self._resend(call.request, server, reply, now)
        if resend is not None:
            server.outstanding.discard(request_id)
            if resend.at <= now:
                self._dispatch(request_id, call, resend.target)
            else:
                loop = asyncio.get_running_loop()
                call.timer = loop.call_later(
                    resend.at - now, self._resend_later, request_id, call, resend.target, reply
                )
            return
        call.answer(reply)

    def _resend_later(self, request_id: RequestId, call: _Call, target: Server | None, refusal: dict[str, Any]) -> None:
        """Its backoff ended: send the request again, unless a request of its session was sent since (that one
        would run first): then its caller gets the refusal."""
        if self.sessions.pipelined(call.request.message):
            call.answer(refusal)
        else:
            self._dispatch(request_id, call, target)

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
            if self._stays_home(call.request):
                call.future.set_exception(ServerLost(server.address, request_id, reason, SESSION_ON_SERVER))
            elif self.resend:
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
