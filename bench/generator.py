"""Load generators for the benchmarks: a raw DEALER socket in a process of its own.

The server, its worker and the load share this machine's two cores, so the load must cost as
little as possible: requests are encoded before the run, the generator only sends frames and
keeps the replies' bytes with their arrival times, and the replies are decoded after the run.

* open loop: send times follow a schedule (Poisson arrivals), never the replies; latency counts
  from the scheduled time, so a server that falls behind cannot hide its queueing;
* closed loop: a fixed number of requests outstanding, for saturation.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty
from typing import Any

import msgpack
import numpy as np
import zmq

POLL_MS = 1  # the open loop's longest sleep between due sends: sends are late by at most about this


@dataclass
class Replies:
    """What a run brought back: per request (by position in the frames) when it was sent and answered
    (seconds from the start; answered is NaN if never), its first reply, the generator's own CPU
    time, and how many replies came beyond a request's first (a server must send none)."""

    sent: np.ndarray
    received: np.ndarray
    replies: list[dict[str, Any] | None]
    cpu_seconds: float
    duplicates: int = 0

    @property
    def lost(self) -> int:
        return sum(reply is None for reply in self.replies)


def _socket(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(address)
    return socket


def _open_loop(address: str, frames: list[bytes], due: np.ndarray, timeout: float, result: Any) -> None:
    context = zmq.Context()
    socket = _socket(context, address)
    sent = np.full(len(frames), np.nan)
    arrivals: list[tuple[float, bytes]] = []
    following = 0
    cpu = time.process_time()  # this process's threads, ZeroMQ's among them, from here on: the run alone
    start = time.perf_counter()
    deadline = float(due[-1]) + timeout if len(due) else 0.0
    while len(arrivals) < len(frames):
        now = time.perf_counter() - start
        if now > deadline:
            break
        while following < len(frames) and due[following] <= now:
            socket.send(frames[following])
            sent[following] = now
            following += 1
        wait = POLL_MS if following < len(frames) else 100
        if socket.poll(wait):
            while True:
                try:
                    arrivals.append((time.perf_counter() - start, socket.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
    result.put((sent, arrivals, time.process_time() - cpu))
    socket.close(linger=0)
    context.term()


def _closed_loop(address: str, frames: list[bytes], window: int, result: Any) -> None:
    context = zmq.Context()
    socket = _socket(context, address)
    sent = np.full(len(frames), np.nan)
    arrivals: list[tuple[float, bytes]] = []
    following = 0
    cpu = time.process_time()
    start = time.perf_counter()
    while len(arrivals) < len(frames):
        while following < len(frames) and following - len(arrivals) < window:
            socket.send(frames[following])
            sent[following] = time.perf_counter() - start
            following += 1
        body = socket.recv()
        arrivals.append((time.perf_counter() - start, body))
    result.put((sent, arrivals, time.process_time() - cpu))
    socket.close(linger=0)
    context.term()


def spawned(target: Callable[..., None], *args: Any) -> Any:
    """Run `target(*args, queue)` in a process of its own, whose CPU time is the load's alone,
    and return what it puts on the queue."""
    spawn = multiprocessing.get_context("spawn")
    queue: Any = spawn.Queue()
    process = spawn.Process(target=target, args=(*args, queue))
    process.start()
    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except Empty:
            if not process.is_alive():
                raise RuntimeError(f"the load process exited with status {process.exitcode} without a result") from None
    process.join()
    return result


def _run(target: Callable[..., None], *args: Any) -> Replies:
    sent, arrivals, cpu = spawned(target, *args)
    received = np.full(len(sent), np.nan)
    replies: list[dict[str, Any] | None] = [None] * len(sent)
    duplicates = 0
    for at, body in arrivals:
        reply = msgpack.unpackb(body, raw=False, strict_map_key=False)
        if replies[reply["id"]] is not None:
            duplicates += 1
            continue
        received[reply["id"]] = at
        replies[reply["id"]] = reply
    return Replies(sent, received, replies, cpu, duplicates)


def request_frames(model: str, inputs: list[dict[str, Any]]) -> list[bytes]:
    """One encoded infer request per input, its id its position."""
    return [msgpack.packb({"id": i, "model": model, "inputs": x}) for i, x in enumerate(inputs)]


def open_loop(address: str, frames: list[bytes], due: np.ndarray, timeout: float = 60.0) -> Replies:
    """Send frame i at `due[i]` seconds after the start; wait for replies up to `timeout` s after the last send."""
    return _run(_open_loop, address, frames, due, timeout)


def closed_loop(address: str, frames: list[bytes], window: int) -> Replies:
    """Send every frame, keeping `window` requests outstanding."""
    return _run(_closed_loop, address, frames, window)


def poisson_schedule(rate: float, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Send times of Poisson arrivals at `rate` per second during `seconds`."""
    gaps = rng.exponential(1.0 / rate, size=int(rate * seconds * 1.2) + 16)
    times = np.cumsum(gaps) - gaps[0]
    return times[times < seconds]
