"""The CUDA backend itself on a fake runtime (tests/cuda_fakes.py): stream order, downloads into the io
arenas, bad tasks, attaching peers; warm-up, polling and device faults are in test_cuda_backend_polling.py.
Every tensor is a fake on "cuda"; what only a real GPU can show is in the `cuda`-marked tests and
scripts/device-check."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from conftest import SMALL_LSTM, write_config
from cuda_fakes import FakeRuntime, Recorder
from test_cuda_fake import (
    ACCESSIBLE_PEER,
    DISTANT_PEER,
    PEER_DEVICE,
    ROWS,
    FakeCalls,
    all_cells,
    fake_cuda,
    fake_tasks,
    on_fake_device,
    serving_task,
    slots,
)

from batchmaker.common.task import TaskMessage
from batchmaker.worker.cuda import CudaBackend
from batchmaker.worker.device_tasks import consecutive_runs
from batchmaker.worker.main import InProgressFIFO, Poller

BATCH = 4
# Operations that read no device memory: the staging buffer's allocation and its views.
NO_DATA = {
    "aten.empty.memory_format",
    "aten.narrow.default",
    "aten.slice.Tensor",
    "aten.view.default",
    "aten.view.dtype",
}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory):
    """The LSTM of tests/conftest.py: cell specs, cells with random weights, value kinds."""
    return all_cells(write_config(tmp_path_factory.mktemp("small"), SMALL_LSTM).path)


@contextlib.contextmanager
def fake_backend(layout, runtime: FakeRuntime | None = None, device: str = "cuda:0", **options) -> Iterator:
    """A CudaBackend on a fake runtime, its cells' weights made on the default stream as worker.main
    makes them, every operation recorded: (backend, runtime, recorder)."""
    specs, cells, kinds = layout
    runtime = runtime or FakeRuntime()
    with fake_cuda(), Recorder(runtime) as recorder:
        moved = [on_fake_device(cell, torch.device(device)) for cell in cells]
        backend = CudaBackend(device, moved, specs, kinds, ROWS, ROWS, runtime=runtime, **options)
        try:
            yield backend, runtime, recorder
        finally:
            backend.close()


def hold_stream(backend: CudaBackend, runtime: FakeRuntime) -> None:
    """Hold the backend's stream, as a hung device would: nothing issued after runs until `runtime.run`."""
    with backend._calls.on_stream():
        runtime.hold()


def lstm_task(task_id: int, layout, backend: CudaBackend, **changes) -> TaskMessage:
    specs, _, _ = layout
    ids = {info.kind: (info.arena_id, info.arena_id + 1) for info in backend.arenas if info.space == "device"}
    task = serving_task(task_id, 0, specs[0], ids, BATCH)
    inputs = [(*entry[:3], None, entry[4]) for entry in task.inputs]  # no peers unless asked
    return TaskMessage(**{**task.__dict__, "inputs": inputs, **changes})


def calls_of(runtime: FakeRuntime, start: int) -> list[tuple[str, object]]:
    return [(call.what, call.stream) for call in runtime.calls[start:]]


@contextlib.contextmanager
def poller_of(backend: CudaBackend, fifo: InProgressFIFO, tmp_path: Path) -> Iterator[tuple[Poller, zmq.Socket]]:
    """A started Poller of `backend`, and the socket its notices arrive on."""
    context = zmq.Context()
    receiver = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/completions"
    receiver.bind(address)
    try:
        poller = Poller(context, address, worker_id=7, key=b"key-7", backend=backend, fifo=fifo, curve=None)
        poller.start()
        yield poller, receiver
        poller.stopping.set()
        poller.join(timeout=60)
    finally:
        receiver.close()
        context.destroy(linger=0)  # a poller that died would leave its socket open


# -- stream order -------------------------------------------------------------------------------------


def test_a_task_runs_on_the_worker_stream_with_its_signal_last():
    """Every operation of a served task is on the worker's stream (reads of a peer mapped on its own GPU:
    on this worker's stream there, torch ordering the copies between them), and the signal comes last."""
    layout = all_cells()
    specs, _, _ = layout
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        with Recorder(calls.runtime) as recorder:
            for task_id, spec in enumerate(specs, start=1):
                start = len(calls.runtime.calls)
                tasks.issue(serving_task(task_id, task_id - 1, spec, ids, BATCH))
                assert tasks.finish(task_id) is None
                issued = calls_of(calls.runtime, start)
                assert issued[-1] == ("signal", calls.stream), spec.key
                before = {what for what, _ in issued[: issued.index(("upload", calls.stream))]}
                assert before <= NO_DATA, spec.key  # nothing reads device memory before the slots arrive
                elsewhere = {(what, stream.device) for what, stream in issued if stream is not calls.stream}
                peer_reads = {"aten.index_select.default", "aten.to.dtype_layout", "aten._to_copy.default"}
                assert elsewhere <= {(what, PEER_DEVICE) for what in peer_reads}, spec.key
                assert all(stream is not calls.runtime.default[0] for _, stream in issued), spec.key
        assert recorder.hazards == []


def test_the_recorder_sees_a_read_that_nothing_orders():
    """The harness can fail: a buffer written on the default stream and read on the worker's is a hazard."""
    runtime = FakeRuntime()
    with fake_cuda(), Recorder(runtime) as recorder:
        calls = FakeCalls(runtime)
        written = torch.ones(4, device=calls.device)
        with calls.on_stream():
            written.sum()
        assert len(recorder.hazards) == 1 and "reads what <default stream" in recorder.hazards[0]
        runtime.synchronize(calls.device)
        with calls.on_stream():
            written.sum()
        assert len(recorder.hazards) == 1


def test_weights_made_on_the_default_stream_are_complete_before_the_worker_stream_reads_them(small):
    with fake_backend(small) as (backend, runtime, recorder):
        backend.warm_up()
        backend.issue(lstm_task(1, small, backend))
        assert backend.finish(1) is None
        assert recorder.hazards == []
        assert runtime.synchronized == 1


# -- downloads straight into the io arenas --------------------------------------------------------------


def test_downloads_land_in_the_page_locked_io_arena_one_copy_per_run_of_rows(small):
    with fake_backend(small) as (backend, runtime, _):
        io_arenas = [info for info in backend.arenas if info.space == "io"]
        assert len(runtime.registered) == len(io_arenas)  # every io arena is page-locked
        task = lstm_task(1, small, backend)
        arena, out, io, _ = task.downloads[0]
        fragmented = [(arena, out, io, slots([7, 8, 3, 20]))]
        start = len(runtime.calls)
        backend.issue(TaskMessage(**{**task.__dict__, "downloads": fragmented}))
        assert backend.finish(1) is None
        assert [what for what, _ in calls_of(runtime, start)].count("download") == 3  # rows 7-8, 3, 20
    assert runtime.registered == []  # unregistered before the shared memory is unmapped


def test_consecutive_runs():
    assert consecutive_runs(slots([])) == []
    assert consecutive_runs(slots([4, 5, 6, 2, 9, 10])) == [(0, 4, 3), (3, 2, 1), (4, 9, 2)]


def test_a_download_into_memory_that_is_not_pinned_is_refused():
    runtime = FakeRuntime()
    with fake_cuda():
        calls = FakeCalls(runtime)
        rows = torch.zeros((2, 3), device=calls.device)
        with pytest.raises(AssertionError, match="unpinned"):
            calls.download(np.zeros((2, 3), np.float32), rows)


# -- bad tasks fail before anything is enqueued ---------------------------------------------------------


@pytest.mark.parametrize("bad", ["io slot", "download length"])
def test_a_task_with_bad_io_slots_enqueues_nothing_but_its_signal(small, bad: str):
    with fake_backend(small) as (backend, runtime, _):
        task = lstm_task(1, small, backend)
        arena, out, io, io_slots = task.downloads[0]
        wrong = slots([0, 1, 2, ROWS + 1]) if bad == "io slot" else io_slots[:2]
        start = len(runtime.calls)
        backend.issue(TaskMessage(**{**task.__dict__, "downloads": [(arena, out, io, wrong)]}))
        enqueued = [(what, stream) for what, stream in calls_of(runtime, start) if what not in NO_DATA]
        assert enqueued == [("signal", backend._calls.stream)]
        error = backend.finish(1)
        assert ("io slot index 257 out of range" if bad == "io slot" else "4 rows into 2 io slots") in error


# -- peers ------------------------------------------------------------------------------------------------


def peer_arenas(layout, uuid_index: int = 1, device: str = "cuda:0") -> list[dict]:
    """The device arenas another worker announces, on the GPU with `uuid_index` in the fake's numbering."""
    exporter = FakeRuntime(gpus=1)
    exporter.uuid = lambda index: f"GPU-{uuid_index:08x}"  # its CUDA_VISIBLE_DEVICES shows it as its GPU 0
    with fake_backend(layout, exporter, device) as (backend, _, _):
        return [info.to_wire() for info in backend.arenas]


def test_a_peer_is_found_by_its_gpu_not_by_its_index(small):
    """The peer calls its GPU 0; here that GPU is 1: with peer access it is mapped on this GPU, without
    it this worker refuses to read it (an index taken at face value would have called it the same GPU)."""
    announced = peer_arenas(small, uuid_index=1)
    for access, opened in ((frozenset({(0, 1)}), True), (frozenset(), False)):
        runtime = FakeRuntime(peer_access=access)
        with fake_backend(small, runtime, cross_gpu_reads="peer-access") as (backend, _, _):
            backend.attach_peer(ACCESSIBLE_PEER, announced)
            assert bool(runtime.opened) is opened
            assert all(device == 0 for _, device in runtime.opened)
            if not opened:
                assert "GPU 1 has no peer access from GPU 0" in backend._tasks.unreadable[ACCESSIBLE_PEER]


@pytest.mark.parametrize(
    ("refusal", "said"),
    [
        (torch.AcceleratorError("CUDA error: invalid resource handle"), "invalid resource handle"),
        (FileNotFoundError("torch_ref_counter gone"), "torch_ref_counter gone"),
        (None, "is not visible to this process"),
    ],
)
def test_a_peer_that_cannot_be_opened_is_not_read_and_the_worker_lives(small, refusal, said: str):
    """The exporter has died, or its GPU is not visible here: the attach is logged, the worker serves on,
    and a task that needs that peer's values fails alone, saying why."""
    announced = peer_arenas(small, uuid_index=1 if refusal is not None else 5)
    back = peer_arenas(small, uuid_index=1)
    with fake_backend(small, FakeRuntime(peer_access=frozenset({(0, 1)}))) as (backend, runtime, _):
        runtime.refuse_open = refusal
        assert said in backend.attach_peer(DISTANT_PEER, announced)  # for the manager, which places by it
        assert said in backend._tasks.unreadable[DISTANT_PEER]
        task = lstm_task(1, small, backend)
        state = task.inputs[1]
        reads_peer = [
            task.inputs[0],
            (*state[:3], [(DISTANT_PEER, state[0], slots([5]), slots([0]))], None),
            *task.inputs[2:],
        ]
        backend.issue(TaskMessage(**{**task.__dict__, "inputs": reads_peer, "task_id": 2}))
        backend.issue(lstm_task(3, small, backend))
        assert said in backend.finish(2)
        assert backend.finish(3) is None
        runtime.refuse_open = None
        assert backend.attach_peer(DISTANT_PEER, back) is None  # it came back
        assert DISTANT_PEER not in backend._tasks.unreadable
        backend.detach_peer(DISTANT_PEER)
        assert not backend._tasks.peers


@pytest.mark.parametrize(
    ("setting", "access", "mapped_on"),
    [
        ("peer-access", frozenset({(0, 1)}), 0),
        ("peer-access", frozenset(), None),
        ("always", frozenset(), 1),
        ("never", frozenset({(0, 1)}), None),
    ],
)
def test_cross_gpu_reads_follow_the_setting(small, setting: str, access, mapped_on: int | None):
    """Without peer access a read needs a CUDA context on the peer's GPU: "peer-access" refuses it."""
    announced = peer_arenas(small, uuid_index=1)
    runtime = FakeRuntime(peer_access=access)
    with fake_backend(small, runtime, cross_gpu_reads=setting) as (backend, _, _):
        said = backend.attach_peer(DISTANT_PEER, announced)
        assert (said is None) is (mapped_on is not None)
        assert [device for _, device in runtime.opened][:1] == ([] if mapped_on is None else [mapped_on])
        assert (DISTANT_PEER in backend._tasks.unreadable) is (mapped_on is None)


def test_an_unknown_cross_gpu_reads_setting_is_refused(small):
    with (
        pytest.raises(ValueError, match="cross_gpu_reads must be one of"),
        fake_backend(small, cross_gpu_reads="sometimes"),
    ):
        pass


def test_a_detached_peer_is_unmapped_only_after_the_stream_passes_its_last_reads(small):
    announced = peer_arenas(small, uuid_index=0)
    with fake_backend(small) as (backend, runtime, _):
        backend.attach_peer(ACCESSIBLE_PEER, announced)
        hold_stream(backend, runtime)  # reads of the peer may still be queued
        backend.detach_peer(ACCESSIBLE_PEER)
        assert not backend._tasks.peers and len(backend._retired) == 1
        backend.detach_peer(DISTANT_PEER)
        assert len(backend._retired) == 1  # the stream has not moved
        runtime.run(backend._calls.stream)
        backend.issue(lstm_task(1, small, backend))  # the next task (or detach) lets the mapping go
        assert backend._retired == []
