"""One ModelStreamInfer call: its requests run side by side as they arrive, except that the requests of one
sequence run one after another, in the order sent, as Triton applies them; and the call holds at most
`[grpc] max_stream_requests` requests in flight and `max_stream_replies` replies that its client has not read
yet (docs/protocol.md, "Open Inference Protocol", "Streaming").

A sequence's request waits for the stream's previous request of its sequence to be answered before it goes to
the server: the server's own order (arrival) is then the order sent, whatever each request awaits on its way.
A stream past a bound ends with RESOURCE_EXHAUSTED: its requests are cancelled and its unread replies dropped,
so a client that sends and never reads holds a bounded share of the front door; other streams go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

from .errors import EXHAUSTED, DoorError

Request = TypeVar("Request")
Reply = TypeVar("Reply")


class StreamCall(Generic[Request, Reply]):
    """The requests of one stream, its replies in the order they are made, and its bounds."""

    def __init__(
        self,
        answer: Callable[[Request], AsyncIterator[Reply]],
        sequence_of: Callable[[Request], str | None],
        max_requests: int,
        max_replies: int,
        exhausted: Callable[[DoorError], None],
    ):
        """`answer` yields a request's replies (its error among them); `sequence_of` names its sequence;
        `exhausted` is told at once when the stream passes a bound (its client may never read the error)."""
        self._answer = answer
        self._sequence_of = sequence_of
        self._exhausted = exhausted
        self._max_requests = max_requests
        self._max_replies = max_replies
        self._replies: asyncio.Queue[Reply | DoorError | None] = asyncio.Queue()  # None: every request answered
        self._running: set[asyncio.Task[None]] = set()
        self._latest: dict[str, asyncio.Task[None]] = {}  # by sequence: its request sent last, while in flight
        self._failed = False

    async def replies(self, requests: AsyncIterator[Request]) -> AsyncIterator[Reply]:
        """The replies to `requests` as they come, until the client ended its side and each request is answered;
        raises DoorError (RESOURCE_EXHAUSTED) once the stream passed a bound. Closing it cancels the requests."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while (reply := await self._replies.get()) is not None:
                if isinstance(reply, DoorError):
                    raise reply
                yield reply
        finally:
            for task in [reader, *self._running]:
                task.cancel()

    async def _read(self, requests: AsyncIterator[Request]) -> None:
        async for request in requests:
            if self._failed:
                return
            if len(self._running) >= self._max_requests:
                self._fail(
                    f"it has {len(self._running)} requests in flight ([grpc] max_stream_requests): "
                    "wait for replies before sending more"
                )
                return
            sequence = self._sequence_of(request)
            before = None if sequence is None else self._latest.get(sequence)
            task = asyncio.create_task(self._run(request, before))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            if sequence is not None:
                self._latest[sequence] = task
                task.add_done_callback(lambda done, name=sequence: self._settled(name, done))
        while self._running:
            await asyncio.wait(set(self._running))
        self._replies.put_nowait(None)

    def _settled(self, sequence: str, task: asyncio.Task[None]) -> None:
        if self._latest.get(sequence) is task:
            del self._latest[sequence]

    async def _run(self, request: Request, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await asyncio.wait([before])
        async with contextlib.aclosing(self._answer(request)) as replies:
            async for reply in replies:
                if self._failed:
                    return
                if self._replies.qsize() >= self._max_replies:
                    self._fail(
                        f"{self._replies.qsize()} of its replies wait unread ([grpc] max_stream_replies): "
                        "read replies as they come"
                    )
                    return
                self._replies.put_nowait(reply)

    def _fail(self, why: str) -> None:
        """The stream passed a bound: its requests are cancelled, its unread replies dropped, and the error is
        the next thing it sends."""
        self._failed = True
        for task in self._running:
            task.cancel()
        while not self._replies.empty():
            self._replies.get_nowait()
        error = DoorError(EXHAUSTED, f"this stream is closed: {why}")
        self._replies.put_nowait(error)
        self._exhausted(error)
