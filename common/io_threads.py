"""ZeroMQ contexts whose background threads do not preempt the thread that sends.

Every message a socket sends wakes the context's I/O thread, which then writes it out. Linux
runs a thread it has just woken ahead of the one that woke it when it can, so on a machine
with few cores a send often costs the sender a pair of context switches: the event loop (or
a worker's stream) stops mid-turn while the I/O thread writes a few hundred bytes. In
SCHED_BATCH (libzmq's ZMQ_THREAD_SCHED_POLICY, applied by each thread as it starts) the I/O
threads still get their fair share of the CPU but wait for the sender's time slice to end,
or for a free core, instead of preempting it.
"""

from __future__ import annotations

import os

import zmq


def server_context() -> zmq.Context:
    """A new context for the manager's or a worker's sockets (set before its first socket starts its threads)."""
    context = zmq.Context()
    if hasattr(os, "SCHED_BATCH"):  # Linux; elsewhere the threads keep the default policy
        context.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return context
