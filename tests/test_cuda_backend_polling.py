"""The CUDA backend's signal counter on a fake runtime (tests/cuda_fakes.py): warm-up's timed tasks,
the poller that waits for the counter, device faults, and a stream that does not finish."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from cuda_fakes import FakeRuntime
from test_cuda_backend import fake_backend, hold_stream, lstm_task, peer_arenas, poller_of, small
from test_cuda_fake import ACCESSIBLE_PEER, slots
from torch.overrides import TorchFunctionMode

from batchmaker.common.notice import decode_notice
from batchmaker.common.task import TaskMessage
from batchmaker.worker import backend as backend_module
from batchmaker.worker import cuda
from batchmaker.worker.backend import FULL_TASK_RUNS, DeviceFault
from batchmaker.worker.main import InProgressFIFO

__all__ = ["small"]  # the fixture, shared with tests/test_cuda_backend.py


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
