"""Hot-path ZeroMQ: contexts whose threads run in SCHED_BATCH (a plain one's do not), multipart sends and receives."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import zmq

from batchmaker.common.sockets import NOW, receive, send, server_context

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="scheduling policies and /proc are Linux's"
)

NAMED_WITHIN_S = 10.0  # libzmq names a thread just after it applies its policy, as the thread starts


def background_policies(expected: int, known: set[str]) -> dict[str, int]:
    """Scheduling policy of each ZeroMQ thread not in `known`, once `expected` of them have started."""
    deadline = time.monotonic() + NAMED_WITHIN_S
    while True:
        found = {
            task.name: os.sched_getscheduler(int(task.name))
            for task in Path("/proc/self/task").iterdir()
            if task.name not in known and _comm(task).startswith("ZMQbg/")
        }
        if len(found) >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def _comm(task: Path) -> str:
    try:
        return (task / "comm").read_text()
    except OSError:  # the thread ended meanwhile
        return ""


@pytest.mark.parametrize(("make", "policy"), [(server_context, os.SCHED_BATCH), (zmq.Context, os.SCHED_OTHER)])
def test_background_threads_of_a_context(make, policy):
    known = set(background_policies(0, set()))  # other contexts' threads, left out
    context = make()
    try:
        socket = context.socket(zmq.PUSH)  # the I/O and reaper threads start with the first socket
        policies = background_policies(2, known)
        socket.close(linger=0)
    finally:
        context.term()
    assert len(policies) >= 2 and set(policies.values()) == {policy}


def test_multipart_messages_cross_whole_and_in_order():
    with zmq.Context() as context:
        pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        pull.bind("inproc://frames")
        push.connect("inproc://frames")
        with pytest.raises(zmq.Again):
            receive(pull, NOW)
        send(push, [b"tasks", b"one", b"", b"three"])
        send(push, iter([b"alone"]))
        assert pull.poll(10_000)
        assert [frame.bytes for frame in receive(pull, NOW)] == [b"tasks", b"one", b"", b"three"]
        assert [frame.bytes for frame in receive(pull)] == [b"alone"]
        for socket in (pull, push):
            socket.close(linger=0)
