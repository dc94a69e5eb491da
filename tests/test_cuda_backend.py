"""The CUDA backend itself on a fake runtime (tests/cuda_fakes.py): stream order, attaching peers,
polling, device faults, warm-up, downloads into the io arenas. Every tensor is a fake on "cuda";
what only a real GPU can show is in the `cuda`-marked tests and scripts/device-check."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

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
from torch.overrides import TorchFunctionMode

from batchmaker.common.task import TaskMessage, decode_notice
from batchmaker.worker import backend as backend_module
from batchmaker.worker import cuda
from batchmaker.worker.backend import FULL_TASK_RUNS, DeviceFault
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


# -- warm-up ------------------------------------------------------------------------------------------------


def test_warm_up_runs_every_operation_serving_runs(small):
    """Inline values, a peer's rows, downloads: nothing a served task does is first done on live traffic."""
    announced = peer_arenas(small, uuid_index=1)
    with fake_backend(small, FakeRuntime(peer_access=frozenset({(0, 1)}))) as (backend, runtime, _):
        backend.warm_up()
        warmed = {call.what for call in runtime.calls}
        assert not backend._tasks.peers, "warm-up left its own arenas open as a peer's"
        backend.attach_peer(ACCESSIBLE_PEER, announced)
        start = len(runtime.calls)
        task = lstm_task(1, small, backend)
        state = task.inputs[1]
        with_peer = [
            task.inputs[0],
            (*state[:3], [(ACCESSIBLE_PEER, state[0], slots([5]), slots([0]))], None),
            *task.inputs[2:],
        ]
        backend.issue(TaskMessage(**{**task.__dict__, "inputs": with_peer}))
        assert backend.finish(1) is None
        served = {call.what for call in runtime.calls[start:]}
    assert {"aten.index_copy_.default", "download", "upload", "signal"} <= served
    assert served <= warmed


def test_warm_up_times_each_cell_types_full_task_through_the_stream(small):
    """The manager's admission has a step cost from the first request: each cell type's task at its largest
    batch, issued, signalled and awaited FULL_TASK_RUNS times as serving runs it."""
    specs, _, _ = small
    with fake_backend(small) as (backend, runtime, _):
        backend.warm_up()
        timed = backend.full_task_seconds()
        signals = [call for call in runtime.calls if call.what == "signal"]
    assert set(timed) == {spec.key for spec in specs}
    assert all(seconds > 0 for seconds in timed.values())
    assert len(signals) == FULL_TASK_RUNS * len(specs) == backend.signal()
    assert all(call.stream is backend._calls.stream for call in signals)


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


def test_the_poller_reports_from_where_warm_up_left_the_counter(small, tmp_path: Path):
    """Warm-up's timed tasks moved the counter and are in no FIFO: the first notice is of the first served task."""
    fifo = InProgressFIFO()
    with fake_backend(small) as (backend, _, _):
        backend.warm_up()
        with poller_of(backend, fifo, tmp_path) as (_, receiver):
            fifo.push(1, [])
            backend.issue(lstm_task(1, small, backend))
            notices = []
            while not any(notice.task_ids for notice in notices):
                assert receiver.poll(60_000), "no notice"
                notices.append(decode_notice(receiver.recv()))
    assert [notice.task_ids for notice in notices if notice.task_ids] == [[1]]
    assert notices[-1].signal == FULL_TASK_RUNS * len(small[0]) + 1


# -- polling and device faults --------------------------------------------------------------------------


class TorchCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_poller_waits_without_torch_calls_or_zero_sleeps(small, monkeypatch: pytest.MonkeyPatch):
    """Each poll that finds the counter unchanged sleeps (one GIL hand-off), never `sleep(0)`, and reads the
    counter without a torch call, which would hand the GIL to the issuer and back."""
    clock = SimpleNamespace(now=0.0, sleeps=[])

    def sleep(seconds: float) -> None:
        clock.sleeps.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(cuda, "time", SimpleNamespace(monotonic=lambda: clock.now, sleep=sleep))
    with fake_backend(small) as (backend, _, _):
        with TorchCalls() as torch_calls:
            backend.wait_for_signal(0, 0.05)
        assert torch_calls.count == 0
        assert min(clock.sleeps) >= cuda.FIRST_POLL_S and max(clock.sleeps) <= cuda.MAX_POLL_S
        assert len(clock.sleeps) <= 0.05 / cuda.MAX_POLL_S + 10  # backs off to MAX_POLL_S at once
        clock.sleeps.clear()
        backend.issue(lstm_task(1, small, backend))
        backend.wait_for_signal(0, 0.05)
        assert clock.sleeps == []  # the counter had moved


def test_the_counter_moves_only_when_the_stream_passes_the_signal(small):
    with fake_backend(small) as (backend, runtime, _):
        hold_stream(backend, runtime)
        backend.issue(lstm_task(1, small, backend))
        assert backend.signal() == 0
        runtime.run(backend._calls.stream)
        assert backend.signal() == 1


def test_a_device_fault_ends_the_worker_instead_of_failing_one_task(small):
    """A device-side assert poisons the context: the next issue raises DeviceFault (the worker exits and
    is restarted), not a task error the worker would serve on after."""
    with fake_backend(small) as (backend, runtime, _):
        backend.issue(lstm_task(1, small, backend))
        runtime.fail()
        with pytest.raises(DeviceFault, match="cuda:0 failed: CUDA error: device-side assert triggered"):
            backend.issue(lstm_task(2, small, backend))
        assert backend.finish(1) is None


def test_a_device_fault_reaches_the_poller_when_no_task_comes(small, monkeypatch: pytest.MonkeyPatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(
        cuda, "time", SimpleNamespace(monotonic=lambda: clock.now, sleep=lambda s: setattr(clock, "now", clock.now + s))
    )
    with fake_backend(small) as (backend, runtime, _):
        hold_stream(backend, runtime)
        backend.issue(lstm_task(1, small, backend))
        backend.wait_for_signal(0, 0.01)  # a slow stream is no fault
        runtime.fail()
        with pytest.raises(DeviceFault):
            backend.wait_for_signal(0, 0.01)


def test_the_poller_stops_on_a_device_fault_for_the_worker_to_exit(small, tmp_path: Path):
    """The poller learns of the fault while waiting for the counter: it records it and ends, and the
    worker's issue loop ends on it (worker.main exits with EXIT_DEVICE_FAULT, to be restarted)."""
    with fake_backend(small) as (backend, runtime, _):
        hold_stream(backend, runtime)
        fifo = InProgressFIFO()
        fifo.push(1, [])
        backend.issue(lstm_task(1, small, backend))
        runtime.fail()
        with poller_of(backend, fifo, tmp_path) as (poller, _):
            poller.join(timeout=60)
            assert not poller.is_alive()
            assert isinstance(poller.fault, DeviceFault)
            assert "device-side assert" in str(poller.fault)


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


def test_a_warm_up_task_that_does_not_finish_fails_start_up(small, monkeypatch: pytest.MonkeyPatch):
    """Its late signal would otherwise be taken for the first served task's, whose rows were not yet written."""
    monkeypatch.setattr(backend_module, "FULL_TASK_TIMEOUT_S", 0.01)
    specs, _, kinds = small
    with fake_backend(small) as (backend, runtime, _):
        hold_stream(backend, runtime)
        with pytest.raises(RuntimeError, match="did not finish within"):
            backend.time_full_tasks(specs, {kind: (2 * i, 2 * i + 1) for i, kind in enumerate(kinds)})
        runtime.run(backend._calls.stream)


def test_closing_with_copies_still_queued_leaves_the_io_arenas_mapped(small, monkeypatch: pytest.MonkeyPatch):
    """A stuck stream may still copy into the io arenas: they stay pinned and mapped, only their names go."""
    monkeypatch.setattr(cuda, "CLOSE_TIMEOUT_S", 0.01)
    with fake_backend(small) as (backend, runtime, _):
        hold_stream(backend, runtime)
        arenas = list(backend._shared)
        backend.close()
        assert all(runtime.is_pinned(shared.array) for shared in arenas)
        assert not any(Path("/dev/shm", shared.name).exists() for shared in arenas)
        runtime.run(backend._calls.stream)
