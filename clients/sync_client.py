"""Blocking client for the batchmaker wire protocol (docs/protocol.md).

It is deliberately thin: one DEALER socket per server, one msgpack frame per request,
and nothing but pyzmq, msgpack, numpy and common.protocol, so any service can embed it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np
import zmq

from batchmaker.common.auth import apply_curve_client
from batchmaker.common.protocol import INTERNAL, RequestError, decode, decode_outputs, encode, is_partial

from .errors import ServerError, ServerLost
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

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT = 30.0
MAX_REMEMBERED_TIMEOUTS = 1024  # requests that timed out, remembered so that cancel reaches their server
CurveKeys = tuple[str | Path, str | Path]  # (client secret key file, server public key file)

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """A successful inference: outputs with tensor maps turned into arrays, and the server's timing."""

    outputs: dict[str, Any]
    timing: dict[str, int]
    session_step: int | None = None  # of a session's request: the session's requests answered so far


def infer_message(
    model: str, inputs: dict[str, Any], deadline_ms: int | None, priority: int | None, stream: bool = False
) -> dict[str, Any]:
    """Build an infer request, leaving out optional fields so the server applies its defaults."""
    if isinstance(inputs, dict):
        inputs = {name: wire_value(name, value) for name, value in inputs.items()}
    message: dict[str, Any] = {"op": "infer", "model": model, "inputs": inputs}
    if deadline_ms is not None:
        message["deadline_ms"] = deadline_ms
    if priority is not None:
        message["priority"] = priority
    if stream:
        message["stream"] = True
    return message


def wire_value(name: str, value: Any) -> Any:
    """An input as the wire carries it: array-likes of other libraries (a torch tensor, through its
    `__array__`) become numpy arrays, so the client needs none of them installed."""
    if isinstance(value, dict):
        return {key: wire_value(f"{name}.{key}", item) for key, item in value.items()}
    if isinstance(value, (np.ndarray, np.generic, list, tuple, str, bytes, int, float, bool)) or value is None:
        return value
    if not hasattr(value, "__array__"):
        return value  # the encoder refuses it, naming its type
    try:
        return np.asarray(value)
    except (TypeError, RuntimeError, ValueError) as exc:  # e.g. a tensor on a GPU, or one that requires grad
        raise TypeError(
            f"input {name!r}: cannot read the {type(value).__name__} as a numpy array ({exc}); "
            "pass value.detach().cpu().numpy()"
        ) from None


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
    return Reply(
        outputs=decode_outputs(reply.get("outputs") or {}), timing=reply.get("timing") or {}, session_step=reply.get("session_step")
    )


def to_stream_item(reply: dict[str, Any]) -> Partial | Reply:
    """A streamed request's reply as its caller gets it: a Partial, or the final Reply (ServerError for an error)."""
    if is_partial(reply):
        return Partial(outputs=decode_outputs(reply.get("outputs") or {}), restarted=reply.get("restarted") is True)
    return to_infer_reply(check(reply))


def connect_dealer(
    context: zmq.Context, address: str, curve: CurveKeys | None, receive_queue_unbounded: bool = False
) -> zmq.Socket:
    """A DEALER socket connected to one server; `receive_queue_unbounded` for clients with many requests in flight."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if receive_queue_unbounded:
        socket.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        apply_curve_client(socket, Path(curve[0]), Path(curve[1]))
    socket.connect(address)
    return socket


def timeout_error(address: str, timeout: float, request_id: Any, parked: bool, closed: int = 0) -> TimeoutError:
    """`closed`: how often the server closed this client's connection while it waited."""
    if parked:
        hint = "no server was up to take it (all set aside or draining)"
    elif closed:
        hint = (
            f"the server closed the connection {closed} time(s): it may be serving its server.max_clients "
            "connections already, or the request was larger than its server.max_message_bytes"
        )
    else:
        hint = "is the server running?"
    return TimeoutError(f"no reply from {address} within {timeout:g} s to request {request_id!r}; {hint}")


class Client:
    """One request at a time, over one DEALER socket per server.

    `address` is one server or several; with several, each request goes to the next
    server in turn (all have nothing outstanding between calls), and a server that is
    lost or draining has the request sent to another (docs/protocol.md, "Several
    servers"). `resend=False` raises ServerLost instead of resending an unanswered
    request. Not thread-safe, like the zmq sockets under it: use one Client per
    thread, or AsyncClient to keep many requests in flight.
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
        """`curve`: (this client's secret key file, the server's public key file) for a server with CurveZMQ on."""
        self.addresses = as_addresses(address)
        self.address = ", ".join(self.addresses)
        self.timeout = timeout
        self.resend = resend
        self._servers = ServerSet(self.addresses, health_interval, health_timeout)
        self._ids = itertools.count(1)
        self.resent = 0  # requests sent again because their server was lost or draining
        self.sessions = SessionSteps()
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
        self._tick_s = min(health_interval, health_timeout) / 4

    def infer(
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
            return to_infer_reply(self.call(message))
        server = self.sessions.server(session, self._servers.pick)
        reply = self._call(message | self.sessions.fields(session, session_end), server)
        self.sessions.answered(session, session_end, reply)
        return to_infer_reply(reply)

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
        with contextlib.closing(self._exchange(infer_message(model, inputs, deadline_ms, priority, True), None)) as replies:
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
        if "id" not in message:
            message = {**message, "id": next(self._ids)}
        request_id = message["id"]
        streamed = message.get("stream") is True
        frame = encode(message)
        deadline = time.monotonic() + self.timeout
        holder = self._send(frame, request_id, server, deadline)
        refused_by: set[Server] = set()  # servers that answered it with a retryable error
        closed = 0  # how often a lone server closed the connection meanwhile (libzmq reconnects on its own)
        resent_at_partial: int | None = None  # `resent` when the last partial was yielded
        answered = False
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    if holder is not None:
                        self._remember_timed_out(request_id, holder)
                    raise timeout_error(self.address, self.timeout, request_id, holder is None, closed)
                wait = deadline - now if not self._servers.failover else min(deadline - now, self._tick_s)
                for socket, _ in self._poller.poll(max(1, int(wait * 1000))):
                    owner, is_monitor = self._owners[socket]
                    if is_monitor:
                        if not connection_closed(socket.recv_multipart()):
                            continue
                        if self._servers.failover:
                            holder = self._lose(owner, "its connection closed", frame, request_id, holder, deadline)
                        else:
                            closed += 1
                        continue
                    reply = read_reply(socket.recv())
                    if reply is None:
                        continue
                    self._servers.heard(owner, now)
                    if is_probe(reply["id"]):
                        if self._servers.probe_answered(owner, reply) and holder is None:
                            holder = self._send(frame, request_id, None, deadline)
                    elif reply["id"] == request_id:
                        if owner is not holder and (reply.get("ok") is False or streamed):
                            continue  # an error, or part of a stream, from a server the request already left
                        restarted = resent_at_partial is not None and resent_at_partial != self.resent
                        if is_partial(reply):
                            resent_at_partial = self.resent
                            yield {**reply, "restarted": True} if restarted else reply
                            continue
                        target = self._servers.retry_target(owner, reply, refused_by)
                        if target is None:
                            if restarted:
                                yield restart_notice(request_id)
                            answered = True
                            yield reply
                            return
                        owner.outstanding.discard(request_id)
                        self.resent += 1
                        holder = self._send(frame, request_id, target, deadline)
                if self._servers.failover:
                    holder = self._check_health(frame, request_id, holder, deadline)
        except GeneratorExit:
            if holder is not None and not answered:
                self._send_cancel(holder, request_id)
            raise
        finally:
            if holder is not None:
                holder.outstanding.discard(request_id)

    def _send_cancel(self, server: Server, target_id: RequestId) -> None:
        with contextlib.suppress(zmq.Again):
            self._sockets[server.index].send(cancel_message(target_id, next(self._ids)), zmq.NOBLOCK)

    def _send(self, frame: bytes, request_id: RequestId, server: Server | None, deadline: float) -> Server | None:
        """Send to `server`, else the least loaded up server; None when no server is up (the caller waits)."""
        if server is None or server.state == ASIDE:
            server = self._servers.pick()
        if server is None:
            return None
        socket = self._sockets[server.index]
        if not socket.poll(self._remaining_ms(deadline), zmq.POLLOUT):
            raise timeout_error(server.address, self.timeout, request_id, parked=False)
        socket.send(frame, zmq.NOBLOCK)
        self._servers.sent(server, request_id, time.monotonic())
        return server

    def _lose(
        self, server: Server, reason: str, frame: bytes, request_id: RequestId, holder: Server | None, deadline: float
    ) -> Server | None:
        """Set a server aside; if it held this call's request, send the request elsewhere (or raise ServerLost)."""
        if server.state == ASIDE or request_id not in self._servers.set_aside(server):
            return holder
        if not self.resend:
            raise ServerLost(server.address, request_id, reason)
        self.resent += 1
        return self._send(frame, request_id, None, deadline)

    def _check_health(
        self, frame: bytes, request_id: RequestId, holder: Server | None, deadline: float
    ) -> Server | None:
        probes, lost = self._servers.tick(time.monotonic())
        for server in lost:
            reason = f"no answer to health within {self._servers.health_timeout:g} s"
            holder = self._lose(server, reason, frame, request_id, holder, deadline)
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
