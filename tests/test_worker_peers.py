"""A worker's peers: a task reading a peer the worker has not opened fails alone, in its turn (a
multi-step task whole, writing nothing); a peer whose arenas cannot be mapped is not read; and the
worker tells the manager which peers it can read."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import zmq
from test_worker import cells, io_array, lstm_step_task, make_backend, multi_step, wait_signal

from batchmaker.common.protocol import decode
from batchmaker.common.slots import ZERO_SLOT
from batchmaker.common.task import TaskMessage, decode_task, encode_task
from batchmaker.worker.main import Worker

__all__ = ["cells"]  # the fixture, shared with tests/test_worker.py


def reading_an_unknown_peer(task: TaskMessage, task_id: int) -> TaskMessage:
    """`task` (one row) with its h input read from worker 99, which this worker has not opened; no downloads."""
    state = task.inputs[1]
    unknown_peer = (*state[:3], [(99, state[0], np.array([5]), np.array([0]))], None)
    return TaskMessage(task_id, 0, 1, [task.inputs[0], unknown_peer, task.inputs[2]], task.outputs, [])


def test_a_multi_step_task_with_a_step_it_cannot_resolve_fails_whole_and_writes_nothing(cells):
    _, _, kinds, _ = cells
    backend = make_backend("cpu", cells)
    try:
        results = io_array(backend, "float32[64]")
        first = lstm_step_task(1, kinds, [5], [ZERO_SLOT], [10], [6])
        second = reading_an_unknown_peer(lstm_step_task(1, kinds, [7], [10], [20], None), 1)
        backend.issue(decode_task(encode_task(multi_step(1, [first, second]))))
        backend.issue(decode_task(encode_task(lstm_step_task(2, kinds, [2], [ZERO_SLOT], [12], None))))
        wait_signal(backend, 2)
        assert "99" in (backend.finish(1) or "") and backend.finish(2) is None
        assert not results.array[6].any()  # the first step never ran: nothing was downloaded
        results.close()
    finally:
        backend.close()


def test_cpu_backend_reports_a_task_it_cannot_resolve_in_its_turn(cells):
    """A task naming a peer this worker has not opened fails alone, after the tasks issued before it."""
    _, _, kinds, _ = cells
    backend = make_backend("cpu", cells)
    try:
        first = lstm_step_task(1, kinds, [2], [ZERO_SLOT], [10], None)
        bad = reading_an_unknown_peer(first, 2)
        for task in (first, bad, lstm_step_task(3, kinds, [2], [ZERO_SLOT], [12], None)):
            backend.issue(decode_task(encode_task(task)))
        wait_signal(backend, 3)
        assert [backend.finish(task_id) for task_id in (1, 3)] == [None, None]
        assert "99" in (backend.finish(2) or "")
    finally:
        backend.close()


def test_a_cpu_worker_that_cannot_map_a_peer_says_why_and_maps_the_others(cells):
    """A peer whose shared memory is gone (it died as it was announced) is not read from; the worker lives,
    reads the peers it could map, and says why for the manager to place requests by."""
    peer = make_backend("cpu", cells)
    backend = make_backend("cpu", cells)
    try:
        announced = [info.to_wire() for info in peer.arenas]
        gone = [
            {**arena, "shm": f"{arena['shm']}-gone"} if arena["space"] == "device" else arena for arena in announced
        ]
        assert backend.attach_peer(7, announced) is None
        reason = backend.attach_peer(8, gone)
        assert reason is not None and "FileNotFoundError" in reason
        assert {worker_id for worker_id, _ in backend._peers} == {7}
        assert 8 not in backend._peer_memory
    finally:
        backend.close()
        peer.close()


def test_the_worker_tells_the_manager_which_peers_it_can_read(tmp_path: Path):
    """After opening the arenas it was told of, the worker reports which it can read and why not the others,
    on its control socket: the manager moves requests to it only from those."""
    reasons = {7: None, 8: "RuntimeError: GPU 1 has no peer access from GPU 0"}
    backend = SimpleNamespace(attach_peer=lambda worker_id, arenas: reasons[worker_id])
    address = f"ipc://{tmp_path}/workers"
    context = zmq.Context()
    manager = context.socket(zmq.ROUTER)
    manager.bind(address)
    worker = Worker(backend, address, 0, [], None, "host-a")
    try:
        worker._socket.connect(address)
        worker._attach_peers({"7": [], "8": []})
        assert manager.poll(60_000)
        _, frame = manager.recv_multipart()
        assert decode(frame) == {"op": "peers", "readable": [7], "unreadable": {"8": reasons[8]}}
        worker._attach_peers({})  # nothing announced: nothing to report
        assert not manager.poll(100)
    finally:
        worker._socket.close(linger=0)
        worker._context.term()
        manager.close(linger=0)
        context.term()
