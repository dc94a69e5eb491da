"""An open-loop Poisson load generator in its own process, on a raw DEALER socket.

Offering several times a server's capacity takes a generator much cheaper per request than the
server is: the asyncio client (clients/loadgen.py) spends about as much CPU per request as the
manager does, so on a small machine it would fall behind its schedule long before it offered ten
times capacity, and it would take the cores the server needs. This one sends pre-encoded frames
and keeps the replies as bytes until the run is over, then reads them. Send times follow the
schedule, never the replies; every request is recorded with when it was due, sent and answered,
so the latency counts from when it was due and a late send is charged to the server's side.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from queue import Empty
from typing import Any

import msgpack
import numpy as np
import zmq

DRAIN_S = 60.0  # once everything is sent, how long to wait for a further reply before giving up on the rest
UNANSWERED = ""  # the code of a request never answered


@dataclass
class Run:
    """One run's requests, indexed by request id: when each was due, sent and answered (seconds on the
    run's clock, NaN when it was not answered), its outcome ("ok", an error code, or UNANSWERED),
    the server's total time for answered ones (µs), the replies beyond the first, and the CPU seconds
    the generator used."""

    due: np.ndarray
    sent: np.ndarray
    received: np.ndarray
    outcome: list[str]
    server_us: np.ndarray
    duplicates: int
    cpu_s: float
    messages: dict[str, str]  # one message per error code, as the server worded it


def schedule(rate: float, seconds: float, seed: int) -> np.ndarray:
    """Poisson arrivals at `rate` per second for `seconds`: send times from 0."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=int(rate * seconds * 1.2) + 100)
    times = np.cumsum(gaps) - gaps[0]
    while times[-1] < seconds:  # a rare long draw: extend until the run is covered
        more = np.cumsum(rng.exponential(1.0 / rate, size=len(gaps))) + times[-1]
        times = np.concatenate([times, more])
    return times[times < seconds]


def _frames(model: str, inputs: list[dict[str, Any]], count: int, seed: int) -> list[bytes]:
    order = np.random.default_rng(seed).permutation(len(inputs))
    return [msgpack.packb({"id": i, "model": model, "inputs": inputs[order[i % len(order)]]}) for i in range(count)]


def _read(body: bytes) -> dict[str, Any]:
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def _generate(
    address: str, model: str, inputs: list[dict[str, Any]], due: np.ndarray, seed: int, drain_s: float, result: Any
) -> None:
    """The generator process: send request i at due[i], collect replies until each request has one
    (or none has come for `drain_s`)."""
    frames = _frames(model, inputs, len(due), seed)
    cpu = time.process_time()
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, 0)  # never block a send: a server that does not read shows in latency
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    sent = np.full(len(frames), np.nan)
    replies: list[tuple[float, bytes]] = []
    clock = time.perf_counter

    def receive() -> None:
        while True:
            try:
                body = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            replies.append((clock(), body))

    time.sleep(0.2)  # let the connection settle before the clock starts
    start = clock()
    index = 0
    while index < len(frames):
        now = clock() - start
        while index < len(frames) and due[index] <= now:
            socket.send(frames[index])
            sent[index] = clock() - start
            index += 1
        receive()
        if index < len(frames):
            wait = due[index] - (clock() - start)
            if wait > 0.001:
                socket.poll(int(wait * 1000))
            elif wait > 0:
                time.sleep(wait)
    answered = {_read(body)["id"] for _, body in replies}
    last = clock()
    while len(answered) < len(frames) and clock() - last < drain_s:
        if socket.poll(100):
            known = len(replies)
            receive()
            answered.update(_read(body)["id"] for _, body in replies[known:])
            last = clock()
    socket.close()
    context.term()
    result.put((start, sent, replies, time.process_time() - cpu))


def run(
    address: str, model: str, inputs: list[dict[str, Any]], due: np.ndarray, seed: int = 0, drain_s: float = DRAIN_S
) -> Run:
    """Send len(due) requests (inputs in a seeded random order) at the `due` times, in a process of
    their own, and return what happened to each. A request with no reply `drain_s` after the last
    reply that came is counted as never answered."""
    spawn = multiprocessing.get_context("spawn")
    queue: Any = spawn.Queue()
    process = spawn.Process(target=_generate, args=(address, model, inputs, due, seed, drain_s, queue), daemon=True)
    process.start()
    while True:
        try:
            start, sent, replies, cpu_s = queue.get(timeout=1.0)
            break
        except Empty:
            if not process.is_alive():
                raise SystemExit(f"the load generator exited with status {process.exitcode} before reporting") from None
    process.join()
    received = np.full(len(due), np.nan)
    server_us = np.full(len(due), np.nan)
    outcome = [UNANSWERED] * len(due)
    messages: dict[str, str] = {}
    duplicates = 0
    for at, body in replies:
        reply = _read(body)
        i = reply["id"]
        if outcome[i] != UNANSWERED:
            duplicates += 1
            continue
        received[i] = at - start
        if reply["ok"]:
            outcome[i] = "ok"
            server_us[i] = reply["timing"]["total_us"]
        else:
            outcome[i] = reply["error"]["code"]
            messages.setdefault(outcome[i], reply["error"]["message"])
    return Run(due, sent, received, outcome, server_us, duplicates, cpu_s, messages)
