"""The manager's and workers' ZeroMQ threads run in SCHED_BATCH; a plain context's do not."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import zmq

from common.io_threads import server_context

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies and /proc are Linux's")

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
