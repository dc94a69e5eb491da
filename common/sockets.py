"""ZeroMQ for the manager's and workers' hot paths: contexts whose threads do not preempt the
sender, and multipart sends and receives without per-frame Python overhead.

Every message a socket sends wakes the context's I/O thread, which then writes it out. Linux
runs a thread it has just woken ahead of the one that woke it when it can, so on a machine
with few cores a send often costs the sender a pair of context switches: the event loop (or
a worker's stream) stops mid-turn while the I/O thread writes a few hundred bytes. In
SCHED_BATCH (libzmq's ZMQ_THREAD_SCHED_POLICY, applied by each thread as it starts) the I/O
threads still get their fair share of the CPU but wait for the sender's time slice to end,
or for a free core, instead of preempting it.

pyzmq's flags are enum members: OR-ing two builds a new member (microseconds), and
`recv_multipart` asks the socket for RCVMORE through an enum after every frame. Here flags
are plain ints and a frame says itself whether more follow.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import zmq

NOW = int(zmq.NOBLOCK)
MORE = int(zmq.SNDMORE)


def server_context() -> zmq.Context:
    """A new context for the manager's or a worker's sockets (set before its first socket starts its threads)."""
    context = zmq.Context()
    if hasattr(os, "SCHED_BATCH"):  # Linux; elsewhere the threads keep the default policy
        context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return context


def receive(socket: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """One multipart message, every frame as a zmq.Frame (raises zmq.Again under NOW when none waits)."""
    frames = [socket.recv(flags, copy=False)]
    while frames[-1].more:  # the rest of a message arrives with its first frame
        frames.append(socket.recv(flags, copy=False))
    return frames


def send(socket: zmq.Socket, frames: Iterable[bytes], flags: int = 0) -> None:
    """One multipart message; with NOW, raises zmq.Again if the first frame cannot be queued."""
    parts = list(frames)
    for part in parts[:-1]:
        socket.send(part, MORE | flags)
    socket.send(parts[-1], flags)
