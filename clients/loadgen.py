"""Open-loop load generator: Poisson arrivals at a fixed rate, many requests in flight.

Send times follow the arrival schedule, never the replies, and latency is measured
from the scheduled send time, so a slow server cannot hide its queueing
(no coordinated omission).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .async_client import AsyncClient
from .errors import ServerError, ServerLost


@dataclass
class Sample:
    """One request of a run: when it was due, sent and answered, and what came back."""

    index: int  # position in the input list
    scheduled: float  # seconds after the start of the run
    sent: float = 0.0
    received: float = 0.0
    error: str | None = None  # error code, or None for a successful reply
    timing: dict[str, int] = field(default_factory=dict)  # the server's queue/compute/total microseconds
    outputs: dict[str, Any] | None = None

    @property
    def latency(self) -> float:
        return self.received - self.scheduled


async def run_open_loop(
    address: str | Sequence[str],
    model: str,
    inputs: list[dict[str, Any]],
    rate: float,
    duration: float,
    seed: int = 0,
    timeout: float = 60.0,
    keep_outputs: bool = True,
) -> list[Sample]:
    """Send requests with exponential inter-arrival gaps at `rate` per second for `duration` seconds.

    Request i uses inputs[i % len(inputs)], drawn in a seeded random order. Several
    addresses spread the load over several servers. A refusal is a sample's outcome: nothing is resent.
    """
    async with AsyncClient(address, timeout=timeout, max_retries=0) as client:
        return await send_open_loop(client, model, inputs, rate, duration, seed, keep_outputs)


async def send_open_loop(
    client: AsyncClient,
    model: str,
    inputs: list[dict[str, Any]],
    rate: float,
    duration: float,
    seed: int = 0,
    keep_outputs: bool = True,
) -> list[Sample]:
    """`run_open_loop` through a client of the caller's, with its settings (its resends of refusals, say)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(inputs))
    loop = asyncio.get_running_loop()
    samples: list[Sample] = []

    async def one(sample: Sample) -> None:
        sample.sent = loop.time() - start
        try:
            reply = await client.infer(model, inputs[sample.index])
            sample.timing = reply.timing
            if keep_outputs:
                sample.outputs = reply.outputs
        except ServerError as exc:
            sample.error = exc.code
        except ServerLost:
            sample.error = "SERVER_LOST"
        except TimeoutError:
            sample.error = "TIMEOUT"
        sample.received = loop.time() - start

    pending = []
    start = loop.time()
    due = 0.0
    while due < duration:
        delay = start + due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sample = Sample(index=int(order[len(samples) % len(order)]), scheduled=due)
        samples.append(sample)
        pending.append(asyncio.create_task(one(sample)))
        due += rng.exponential(1.0 / rate)
    await asyncio.gather(*pending)
    return samples


def percentiles(values: list[float] | np.ndarray, points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if len(values) == 0:
        return {f"p{p}": float("nan") for p in points}
    return {f"p{p}": float(v) for p, v in zip(points, np.percentile(values, points))}


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """Throughput and latency of a run (latencies in milliseconds)."""
    ok = [s for s in samples if s.error is None]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
    span = max((s.received for s in samples), default=0.0)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": errors,
        "throughput_rps": len(ok) / span if span > 0 else 0.0,
        "latency_ms": percentiles([s.latency * 1e3 for s in ok]),
        "queue_ms": percentiles([s.timing["queue_us"] / 1e3 for s in ok]),
        "compute_ms": percentiles([s.timing["compute_us"] / 1e3 for s in ok]),
    }
