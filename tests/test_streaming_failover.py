"""A stream whose server is lost starts over on another server, and the caller is told: the first
partial after the resend says `restarted`. Fake ROUTER servers on loopback TCP, closed as a killed
process closes its connections."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from test_clients_failover import FakeServer

from batchmaker.clients import AsyncClient, Client, Partial, Reply, ServerLost
from batchmaker.common.protocol import partial_reply

FAST = {"health_interval": 0.1, "health_timeout": 0.3}


class StreamingServer(FakeServer):
    """A fake server answering every infer request with the replies of its script, each its own frame."""

    def __init__(self, name: str, script: list[tuple[list[int], bool]]):
        """`script`: the (tokens, final) replies to each infer request, in order."""
        self.script = script
        super().__init__(name)

    def _replies(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        if message.get("op", "infer") != "infer":
            return super()._replies(message)
        request_id = message["id"]
        replies = []
        for tokens, final in self.script:
            outputs = {"tokens": np.array(tokens, dtype=np.int64)}
            replies.append(
                {"id": request_id, "ok": True, "outputs": outputs} if final else partial_reply(request_id, outputs)
            )
        return replies


@pytest.fixture
def servers() -> Iterator[list[StreamingServer]]:
    started: list[StreamingServer] = []
    yield started
    for server in started:
        server.close()


def pair(
    servers: list[StreamingServer], second: list[tuple[list[int], bool]]
) -> tuple[StreamingServer, StreamingServer]:
    """A first server that streams [1, 2] and stays silent after (until the test closes it), and a second one."""
    servers.append(StreamingServer("s0", [([1, 2], False)]))
    servers.append(StreamingServer("s1", second))
    return servers[0], servers[1]


STREAMED = [([7], False), ([8, 9], False), ([7, 8, 9], True)]
FINAL_ONLY = [([7, 8, 9], True)]


def summary(items: list[Partial | Reply]) -> list[tuple[str, list[int], bool]]:
    return [
        ("partial", item.outputs.get("tokens", np.array([], np.int64)).tolist(), item.restarted)
        if isinstance(item, Partial)
        else ("final", item.outputs["tokens"].tolist(), False)
        for item in items
    ]


AFTER_A_LOSS = pytest.mark.parametrize(
    "second, expected",
    [
        (STREAMED, [("partial", [7], True), ("partial", [8, 9], False), ("final", [7, 8, 9], False)]),
        # answered before any new partial: the caller is told by a partial without outputs
        (FINAL_ONLY, [("partial", [], True), ("final", [7, 8, 9], False)]),
    ],
)


@AFTER_A_LOSS
def test_a_stream_resent_after_its_server_is_lost_restarts_and_says_so(servers, second, expected):
    first, other = pair(servers, second)
    with Client([first.address, other.address], timeout=30, **FAST) as client:
        stream = client.stream("m", {"tokens": [1]})
        assert summary([next(stream)]) == [("partial", [1, 2], False)]
        first.close()  # lost mid-stream
        assert summary(list(stream)) == expected
        assert client.resent == 1 and first.infer_ids == other.infer_ids


@AFTER_A_LOSS
def test_the_async_client_restarts_a_stream_the_same_way(servers, second, expected):
    first, other = pair(servers, second)

    async def run() -> list[Partial | Reply]:
        items: list[Partial | Reply] = []
        async with AsyncClient([first.address, other.address], timeout=30, **FAST) as client:
            async for item in client.stream("m", {"tokens": [1]}):
                items.append(item)
                if len(items) == 1:
                    first.close()
            assert client.resent == 1
        return items

    items = asyncio.run(run())
    assert summary(items) == [("partial", [1, 2], False), *expected]


def test_without_resend_a_lost_stream_raises_server_lost(servers):
    first, other = pair(servers, STREAMED)
    with Client([first.address, other.address], timeout=30, resend=False, **FAST) as client:
        stream = client.stream("m", {"tokens": [1]})
        assert isinstance(next(stream), Partial)
        first.close()
        with pytest.raises(ServerLost):
            next(stream)
        assert other.infer_ids == []


def test_a_stream_answered_without_a_loss_is_not_restarted(servers):
    servers.append(StreamingServer("s0", STREAMED))
    with Client(servers[0].address, timeout=30) as client:
        items = list(client.stream("m", {"tokens": [1]}))
    assert summary(items) == [("partial", [7], False), ("partial", [8, 9], False), ("final", [7, 8, 9], False)]
