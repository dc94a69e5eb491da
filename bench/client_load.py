"""Load driven through the client library (`AsyncClient`) in a process of its own, so that the CPU the
client uses is its own to measure.

* `saturate`: closed loop, a fixed number of requests outstanding per server, for throughput;
* `open_loop`: Poisson arrivals; with a `Fault`, one server gets a signal partway through (SIGKILL
  to all its processes, SIGSTOP, or SIGTERM to its supervisor) while `RecordingClient` notes where
  every request went and when the client set a server aside.

CPU time is sampled from inside the load process, at the edges of what is measured: the open loop's
own, and for the closed loop also the servers' processes by role and the whole machine's.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

from batchmaker.bench.generator import spawned
from batchmaker.clients import AsyncClient, ServerError
from batchmaker.clients.loadgen import percentiles
from batchmaker.clients.messages import infer_message, to_infer_reply
from batchmaker.clients.servers import ASIDE, RequestId, Server, is_probe, is_stopping
from batchmaker.manager.commands.launcher import cpu_seconds

FAULT_WAIT_S = 1.0  # at most this long past its time a fault waits for its server to owe answers


@dataclass(frozen=True)
class Usage:
    """CPU seconds used so far, at one moment: by the load process, by the servers' processes per role,
    and by the whole machine (busy; and stolen by the hypervisor, which no process here sees)."""

    at: float
    client: float
    servers: dict[str, float]
    machine: float
    steal: float


def sample(pids: dict[int, str]) -> Usage:
    machine = psutil.cpu_times()
    busy = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    return Usage(time.monotonic(), time.process_time(), cpu_seconds(pids), busy, machine.steal)


@dataclass
class Saturated:
    """A closed-loop run: requests answered between two CPU samples, and their latency."""

    requests: int
    before: Usage
    after: Usage
    latency_ms: dict[str, float]
    errors: dict[str, int]


@dataclass(frozen=True)
class Fault:
    """`signal` sent to `pids` (one server's processes) `at` seconds into a run, once that server owes answers.
    The exit of its `manager`, which holds the clients' connections, is timed too."""

    name: str
    at: float
    signal: int
    pids: list[int]
    address: str
    manager: int


@dataclass(repr=False)  # asyncio.run formats its main task's result (Python 3.11): thousands of arrays took seconds
class OpenLoop:
    """An open-loop run, times in seconds from its start. Per request: when it was due, sent and answered,
    its error code (None when answered) and, if kept, its outputs. With a fault, also per request every
    (time, address) it was sent to and how many successful replies reached the client (a late one from a
    server set aside included), and for the run the draining refusals and the servers set aside."""

    due: np.ndarray
    sent: np.ndarray
    received: np.ndarray
    errors: list[str | None]
    outputs: list[dict[str, Any] | None]
    cpu_seconds: float = 0.0  # the load process's, from the first send to the last answer
    resent: int = 0
    fault_at: float | None = None
    manager_gone: float | None = None  # when the server's manager exited (None: not during the run)
    sends: list[list[tuple[float, str]]] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)
    refusals: list[tuple[float, str]] = field(default_factory=list)
    set_aside: list[tuple[float, str, str]] = field(default_factory=list)


class RecordingClient(AsyncClient):
    """An AsyncClient that notes, on the run's clock, each request's sends, the successful replies that reach
    it, the draining refusals and the moment it sets a server aside. It decides nothing differently: the
    notes are taken around AsyncClient's own steps, which a failover is timed by."""

    def __init__(self, addresses: list[str], start: float, **options: Any):
        super().__init__(addresses, **options)
        self.start = start
        self.sends: dict[RequestId, list[tuple[float, str]]] = defaultdict(list)
        self.answers: Counter[RequestId] = Counter()
        self.refusals: list[tuple[float, str]] = []
        self.set_aside: list[tuple[float, str, str]] = []

    def _dispatch(self, request_id: RequestId, call: Any, server: Server | None = None) -> None:
        super()._dispatch(request_id, call, server)
        if call.server is not None:
            self.sends[request_id].append((time.monotonic() - self.start, call.server.address))

    def _on_reply(self, server: Server, reply: dict[str, Any]) -> None:
        if not is_probe(reply["id"]):
            if reply.get("ok") is True:
                self.answers[reply["id"]] += 1
            elif is_stopping(reply):
                self.refusals.append((time.monotonic() - self.start, server.address))
        super()._on_reply(server, reply)

    def _server_lost(self, server: Server, reason: str) -> None:
        if server.state != ASIDE:
            self.set_aside.append((time.monotonic() - self.start, server.address, reason))
        super()._server_lost(server, reason)


async def _saturate(
    addresses: list[str], model: str, inputs: list[dict[str, Any]], window: int, warmup: float, seconds: float,
    pids: dict[int, str],
) -> Saturated:
    loop = asyncio.get_running_loop()
    following = itertools.cycle(inputs)
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    measuring = stopping = False
    async with AsyncClient(addresses, timeout=60, max_retries=0) as client:  # refusals counted as the server gives them

        async def keep_one_outstanding() -> None:
            while not stopping:
                began = loop.time()
                try:
                    await client.infer(model, next(following))
                except ServerError as exc:
                    if measuring:
                        errors[exc.code] += 1
                    continue
                if measuring:
                    latencies.append(loop.time() - began)

        tasks = [asyncio.create_task(keep_one_outstanding()) for _ in range(window * len(addresses))]
        await asyncio.sleep(warmup)
        measuring, before = True, sample(pids)
        await asyncio.sleep(seconds)
        after, measuring, stopping = sample(pids), False, True
        await asyncio.gather(*tasks)
    return Saturated(len(latencies), before, after, percentiles(np.array(latencies) * 1e3), dict(errors))


def in_event_loop(function: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """The load process's body: run `function(*args)` in an event loop; put its result on the queue that ends `args`."""
    *arguments, result = args
    result.put(asyncio.run(function(*arguments)))


def saturate(
    addresses: list[str], model: str, inputs: list[dict[str, Any]], window: int, warmup: float, seconds: float,
    pids: dict[int, str],
) -> Saturated:
    """Keep `window` requests per server outstanding through one AsyncClient; count the replies of `seconds`
    after `warmup`. `pids` (pid -> role) are the servers' processes whose CPU is sampled."""
    return spawned(in_event_loop, _saturate, addresses, model, inputs, window, warmup, seconds, pids)


def _note_exit(process: int, start: float, noted: list[float]) -> None:
    """Wait (in a thread of its own, not the client's loop) for the process behind a pidfd to exit; note when."""
    try:
        select.select([process], [], [])
        noted.append(time.monotonic() - start)
    finally:
        os.close(process)


async def _inject(client: AsyncClient, fault: Fault, start: float, exits: list[float]) -> float:
    """Send the fault's signal at its time, once its server owes answers; return when, on the run's clock.
    The time the server's manager exits is appended to `exits`."""
    await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
    waited_until = time.monotonic() + FAULT_WAIT_S
    while client.outstanding()[fault.address] == 0 and time.monotonic() < waited_until:
        await asyncio.sleep(0.001)
    threading.Thread(target=_note_exit, args=(os.pidfd_open(fault.manager), start, exits), daemon=True).start()
    at = time.monotonic() - start
    for pid in fault.pids:
        try:
            os.kill(pid, fault.signal)
        except ProcessLookupError:
            pass
    return at


async def on_schedule(due: np.ndarray, start: float, send: Callable[[int], Awaitable[None]]) -> float:
    """Start `send(i)` at `due[i]` seconds after `start` (on time.monotonic's clock), whatever the replies, and
    wait for every one; return the CPU seconds this process used from the first send to the last answer."""
    calls = []
    cpu = time.process_time()
    for index, at in enumerate(due):
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        calls.append(asyncio.create_task(send(index)))
    await asyncio.gather(*calls)
    return time.process_time() - cpu


async def _open_loop(
    addresses: list[str], model: str, inputs: list[dict[str, Any]], due: np.ndarray, fault: Fault | None,
    keep_outputs: bool,
) -> OpenLoop:
    count = len(due)
    run = OpenLoop(due, np.full(count, np.nan), np.full(count, np.nan), [None] * count, [None] * count)
    start = time.monotonic()
    # Refusals are counted as the server gives them (no resend after a backoff); failover stays as the library does it.
    recording = RecordingClient(addresses, start, timeout=60, max_retries=0) if fault else None
    async with recording or AsyncClient(addresses, timeout=60, max_retries=0) as client:

        async def one(index: int) -> None:
            run.sent[index] = time.monotonic() - start
            try:
                reply = await client.call({**infer_message(model, inputs[index], None, None), "id": index})
                if keep_outputs:
                    run.outputs[index] = to_infer_reply(reply).outputs
            except ServerError as exc:
                run.errors[index] = exc.code
            except TimeoutError:
                run.errors[index] = "TIMEOUT"
            run.received[index] = time.monotonic() - start

        exits: list[float] = []
        injected = asyncio.create_task(_inject(client, fault, start, exits)) if fault else None
        run.cpu_seconds = await on_schedule(due, start, one)
        run.resent = client.resent
        if injected is not None and recording is not None:
            run.fault_at = await injected
            run.manager_gone = exits[0] if exits else None
            run.sends = [recording.sends.get(index, []) for index in range(count)]
            run.answers = [recording.answers.get(index, 0) for index in range(count)]
            run.refusals, run.set_aside = recording.refusals, recording.set_aside
    return run


def open_loop(
    addresses: list[str], model: str, inputs: list[dict[str, Any]], due: np.ndarray, fault: Fault | None = None,
    keep_outputs: bool = False,
) -> OpenLoop:
    """Send request i (`inputs[i]`) at `due[i]` seconds through one AsyncClient (a RecordingClient when
    there is a fault to inject), and wait for every answer."""
    return spawned(in_event_loop, _open_loop, addresses, model, inputs, due, fault, keep_outputs)
