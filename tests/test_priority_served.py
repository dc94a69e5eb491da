"""Request priority on a real server: high-priority requests overtake queued low-priority ones."""

from __future__ import annotations

import asyncio

import pytest
from conftest import SMALL_LSTM, start_server, stop_server, wait_until_async, write_config

from batchmaker.clients import AsyncClient

LOW_LENGTH = 600  # with one cell per step, each low request holds the worker for LOW_LENGTH steps


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_high_priority_requests_overtake_queued_low_priority_ones(tmp_path, running_batch: str):
    """Four long low-priority requests, then a short high-priority one sent once all four are admitted
    and unanswered. With one cell per step they run one after another, oldest first, so at most the
    first has started when the high one arrives: it is answered before the other three. So whether the
    manager decides each step (one cell per task) or the worker's running batch does (a batch of one)."""
    models = SMALL_LSTM.replace("max_length = 200", f"max_length = {LOW_LENGTH}").replace(
        "batch_sizes = [1, 2, 4, 8, 16, 32]", "batch_sizes = [1]"
    )
    server = start_server(write_config(tmp_path, models, scheduler=f'running_batch = "{running_batch}"'), workers=1)
    try:
        order = asyncio.run(reply_order(server.address))
    finally:
        stop_server(server)
    assert order.index("high") < min(order.index(name) for name in ("low2", "low3", "low4")), order


async def reply_order(address: str) -> list[str]:
    order: list[str] = []
    async with AsyncClient(address) as client:

        async def infer(name: str, length: int, priority: int) -> None:
            await client.infer("lstm", {"tokens": [1 + i % 999 for i in range(length)]}, priority=priority)
            order.append(name)

        lows = [asyncio.ensure_future(infer(f"low{i}", LOW_LENGTH, 0)) for i in range(1, 5)]

        async def all_lows_at_the_worker() -> bool:
            """In flight, and the manager has submitted a task (its steps) or routed all four whole (the
            worker's running batch: the manager queues none, the worker holds them until they end)."""
            stats = await client.stats()
            routed = sum(stats["routed"]["by_worker"].values())
            return stats["requests_in_flight"] == 4 and (stats["tasks"] > 0 or routed == 4)

        await wait_until_async(all_lows_at_the_worker, "the four low-priority requests admitted and running")
        assert not order, "a low-priority request was answered before the high-priority one was sent"
        await asyncio.gather(infer("high", 5, 10), *lows)
    return order
