"""Blocking client for the batchmaker wire protocol (docs/protocol.md).

It is deliberately thin: one DEALER socket per server, one msgpack frame per request,
and nothing but pyzmq, msgpack, numpy and common.protocol, so any service can embed it.
What it shares with AsyncClient (settings, requests, retries) is in base.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Self

import zmq

from batchmaker.common.protocol import encode, is_partial

from .base import ClientBase, Outgoing, Resend
from .errors import SESSION_ON_SERVER, SET_ASIDE, ServerLost
from .messages import (
    CurveKeys,
    Reply,
    check,
    connect_dealer,
    read_reply,
    timeout_error,
    to_stream_item,
)
from .servers import ASIDE, RequestId, Server, connection_closed, is_probe
from .streams import Partial, cancel_message, restart_notice

MAX_REMEMBERED_TIMEOUTS = 1024  # requests that timed out, remembered so that cancel reaches their server


class Client(ClientBase):
    """One request at a time, over one DEALER socket per server.

    `address` is one server or several; with several, each request goes to the next
    server in turn (all have nothing outstanding between calls), and a server that is
    lost or draining has the request sent to another (docs/protocol.md, "Several
    servers"). `resend=False` raises ServerLost instead of resending an unanswered
    request. A request refused with OVERLOADED is sent again after a growing backoff while
    its deadline and timeout allow (docs/protocol.md, "Retries"); one larger than the server
    accepts raises RequestTooLarge unsent. Not thread-safe, like the zmq sockets under
    it: use one Client per thread, or AsyncClient to keep many requests in flight.
    """

    def _connect(self, curve: CurveKeys | None) -> None:
        self._timed_out: dict[RequestId, Server] = {}  # where requests that timed out went, for cancel
        context = zmq.Context.instance()
        self._sockets = [connect_dealer(context, a, curve) for a in self.addresses]
        self._poller = zmq.Poller()
        self._owners: dict[zmq.Socket, tuple[Server, bool]] = {}  # socket -> (its server, whether it is a monitor)
        for server, socket in zip(self._servers.servers, self._sockets):
            self._poller.register(socket, zmq.POLLIN)
            self._owners[socket] = (server, False)
            monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._poller.register(monitor, zmq.POLLIN)
            self._owners[monitor] = (server, True)
        self._tick_s = min(self._servers.health_interval, self._servers.health_timeout) / 4

    def infer(
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
        return self._infer_reply(self._call(message, server), session, session_end)

    def stream(
        self,
        model: str,
        inputs: dict[str, Any],
        deadline_ms: int | None = None,
        priority: int | None = None,
    ) -> Iterator[Partial | Reply]:
        """Run one inference with `stream: true`: yield each Partial as it arrives, then the final Reply.

        A Partial with `restarted` set voids those before it: the request was sent again after its
        server was lost, or replayed after its worker was. Leaving the loop early cancels the
        request. `timeout` bounds the whole stream."""
        message, _ = self._infer_request(model, inputs, deadline_ms, priority, None, False, stream=True)
        with contextlib.closing(self._exchange(message, None)) as replies:
            for reply in replies:
                yield to_stream_item(reply)

    def models(self) -> dict[str, Any]:
        return self.call({"op": "models"})

    def health(self) -> dict[str, Any]:
        return self.call({"op": "health"})

    def stats(self) -> dict[str, Any]:
        return self.call({"op": "stats"})

    def cancel(self, target_id: int | str) -> dict[str, Any]:
        """Ask the server to drop an earlier request of this client, e.g. one whose call timed out.

        The server only looks up ids sent over the same socket, so the cancel goes to
        the server the target was sent to.
        """
        return self._call({"op": "cancel", "target": target_id}, self._timed_out.pop(target_id, None))

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its reply map.

        A fresh id is assigned unless the message has one. Replies to other ids, left
        over from earlier calls that timed out or were answered elsewhere, are skipped.
        """
        return self._call(message, None)

    def _call(self, message: dict[str, Any], server: Server | None) -> dict[str, Any]:
        *_, reply = self._exchange(message, server)
        return check(reply)

    def _exchange(self, message: dict[str, Any], server: Server | None) -> Iterator[dict[str, Any]]:
        """Send one request and yield its replies: a streamed request's partials, then the final one.

        A stream resent after partials were yielded starts over: the next partial yielded says so
        (`restarted`), one without outputs if the final reply comes first. Replies from a server a
        stream left are skipped; closing the generator before the final reply cancels the request."""
        request = self._outgoing(message, server)
        for unasked in self._limits_to_ask(request):
            self._heard_limit(unasked, self._call({"op": "health"}, unasked))
        self._check_size(request)
        request_id, deadline = request.request_id, request.until
        streamed = message.get("stream") is True
        holder: Server | None = None
        resend: Resend | None = None  # a refused request waiting for its backoff to end
        closed = 0  # how often a lone server closed the connection meanwhile (libzmq reconnects on its own)
        resent_at_partial: int | None = None  # `resent` when the last partial was yielded
        answered = False
        self.sessions.sending(request.message)
        try:
            holder = self._send(request, server)
            while True:
                now = time.monotonic()
                if resend is not None and now >= resend.at:
                    holder, resend = self._send(request, resend.target), None
                if now >= deadline:
                    if holder is not None:
                        self._remember_timed_out(request_id, holder)
                    raise timeout_error(self.address, self.timeout, request_id, holder is None, closed)
                wait = (deadline if resend is None else resend.at) - now
                if self._servers.failover:
                    wait = min(wait, self._tick_s)
                for socket, _ in self._poller.poll(max(1, int(wait * 1000))):
                    owner, is_monitor = self._owners[socket]
                    if is_monitor:
                        if not connection_closed(socket.recv_multipart()):
                            continue
                        if self._servers.failover:
                            holder = self._lose(owner, "its connection closed", request, holder)
                        else:
                            closed += 1
                        continue
                    reply = read_reply(socket.recv())
                    if reply is None:
                        continue
                    self._servers.heard(owner, now)
                    if is_probe(reply["id"]):
                        if self._servers.probe_answered(owner, reply) and holder is None and resend is None:
                            holder = self._send(request, None)
                    elif reply["id"] == request_id:
                        if owner is not holder and (reply.get("ok") is False or streamed):
                            continue  # an error, or part of a stream, from a server the request already left
                        restarted = resent_at_partial is not None and resent_at_partial != self.resent
                        if is_partial(reply):
                            resent_at_partial = self.resent
                            yield {**reply, "restarted": True} if restarted else reply
                            continue
                        resend = self._resend(request, owner, reply, now)
                        if resend is None:
                            if restarted:
                                yield restart_notice(request_id)
                            answered = True
                            yield reply
                            return
                        owner.outstanding.discard(request_id)
                        holder = None
                        if resend.at <= now:
                            holder, resend = self._send(request, resend.target), None
                if self._servers.failover:
                    holder = self._check_health(request, holder)
        except GeneratorExit:
            if holder is not None and not answered:
                self._send_cancel(holder, request_id)
            raise
        finally:
            self.sessions.settled(request.message)
            if holder is not None:
                holder.outstanding.discard(request_id)

    def _send_cancel(self, server: Server, target_id: RequestId) -> None:
        with contextlib.suppress(zmq.Again):
            self._sockets[server.index].send(cancel_message(target_id, next(self._ids)), zmq.NOBLOCK)

    def _send(self, request: Outgoing, server: Server | None) -> Server | None:
        """Send to `server`, else the least loaded up server; None when no server is up (the caller waits)."""
        if server is not None and server.state == ASIDE and self._stays_home(request):
            raise ServerLost(server.address, request.request_id, SET_ASIDE, SESSION_ON_SERVER)
        if server is None or server.state == ASIDE:
            server = self._servers.pick()
        if server is None:
            return None
        socket = self._sockets[server.index]
        if not socket.poll(self._remaining_ms(request.until), zmq.POLLOUT):
            raise timeout_error(server.address, self.timeout, request.request_id, parked=False)
        socket.send(request.frame, zmq.NOBLOCK)
        self._servers.sent(server, request.request_id, time.monotonic())
        return server

    def _lose(self, server: Server, reason: str, request: Outgoing, holder: Server | None) -> Server | None:
        """Set a server aside; if it held this call's request, send the request elsewhere (or raise ServerLost)."""
        if server.state == ASIDE or request.request_id not in self._servers.set_aside(server):
            return holder
        if self._stays_home(request):
            raise ServerLost(server.address, request.request_id, reason, SESSION_ON_SERVER)
        if not self.resend:
            raise ServerLost(server.address, request.request_id, reason)
        self.resent += 1
        return self._send(request, None)

    def _check_health(self, request: Outgoing, holder: Server | None) -> Server | None:
        probes, lost = self._servers.tick(time.monotonic())
        for server in lost:
            reason = f"no answer to health within {self._servers.health_timeout:g} s"
            holder = self._lose(server, reason, request, holder)
        for server, probe_id in probes:
            try:
                self._sockets[server.index].send(encode({"op": "health", "id": probe_id}), zmq.NOBLOCK)
            except zmq.Again:
                pass  # its queue is full: the probe is retried later
        return holder

    def _remember_timed_out(self, request_id: RequestId, server: Server) -> None:
        if len(self._timed_out) >= MAX_REMEMBERED_TIMEOUTS:
            del self._timed_out[next(iter(self._timed_out))]
        self._timed_out[request_id] = server

    def close(self) -> None:
        for socket, (_, is_monitor) in self._owners.items():
            if not is_monitor:
                socket.disable_monitor()
        for socket in self._owners:
            socket.close(linger=0)

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
