"""Worker backends driven directly with task messages: gather, compute, scatter, signal, poll; and worker
processes that cannot start. Tasks reading peers, and the peers a worker can read, are in test_worker_peers.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from conftest import SMALL_LSTM, write_config

from batchmaker.common.models import build_model
from batchmaker.common.notice import CompletionNotice, decode_notice
from batchmaker.common.slots import SCRATCH_SLOT, ZERO_SLOT
from batchmaker.common.task import TaskMessage, TaskStep, decode_task, encode_task
from batchmaker.worker.backend import arena_ids
from batchmaker.worker.main import load_cells
from batchmaker.worker.notices import InProgressFIFO, Poller
from batchmaker.worker.startup import EXIT_CONFIG_ERROR, EXIT_STARTUP_FAILED

ROWS = 64


@pytest.fixture
def cells(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    specs, modules, kinds = load_cells(config)
    model = build_model(config.models["lstm"])
    return specs, modules, kinds, model.load_weights()


def make_backend(device: str, cells, cuda_graphs: bool = False):
    specs, modules, kinds, _ = cells
    if device == "cpu":
        from batchmaker.worker.cpu import CpuBackend

        return CpuBackend(modules, specs, kinds, ROWS, ROWS)
    from batchmaker.worker.cuda import CudaBackend

    return CudaBackend(device, modules, specs, kinds, ROWS, ROWS, cuda_graphs)


def io_array(backend, kind_key: str):
    """The numpy view the manager would map: attach to the io arena by its shared-memory name."""
    from batchmaker.common.shm import SharedArray

    info = next(a for a in backend.arenas if a.space == "io" and a.kind.key == kind_key)
    return SharedArray(info.kind.dtype, (info.rows, *info.kind.shape), name=info.shm_name)


def lstm_step_task(task_id: int, kinds, tokens: list[int], h_in: list[int], h_out: list[int], results_io):
    """One LSTM step for len(h_out) rows: tokens sent inline, (h, c) read and written in pairs."""
    ids = arena_ids(kinds)
    tok_kind = next(k for k in kinds if k.dtype == "int64")
    state_kind = next(k for k in kinds if k.dtype == "float32")
    tok_dev, _ = ids[tok_kind]
    state_dev, state_io = ids[state_kind]
    n = len(h_out)
    inline = (np.arange(n), np.array(tokens, dtype=np.int64).tobytes())
    return TaskMessage(
        task_id,
        0,
        n,
        [
            (tok_dev, np.full(n, ZERO_SLOT), None, None, inline),
            (state_dev, np.array(h_in), None, None, None),
            (state_dev, np.array([s + 1 if s not in (ZERO_SLOT,) else ZERO_SLOT for s in h_in]), None, None, None),
        ],
        [(state_dev, np.array(h_out)), (state_dev, np.array([s + 1 for s in h_out]))],
        [(state_dev, np.array(h_out), state_io, np.array(results_io))] if results_io else [],
    )


def wait_signal(backend, value: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while backend.signal() < value:
        assert time.monotonic() < deadline, f"signal stuck at {backend.signal()}, expected {value}"
        time.sleep(0.001)


def run_two_steps(device: str, cells, cuda_graphs: bool = False) -> tuple[np.ndarray, int]:
    """Two chained steps of two sequences issued back to back after warm-up (which captures the graphs, if
    on); returns the final h rows from the io arena and how many cell graphs were captured."""
    _specs, _modules, kinds, _ = cells
    backend = make_backend(device, cells, cuda_graphs)
    try:
        backend.warm_up()
        captured = len(backend._tasks.graphs) if device != "cpu" else 0
        seen = backend.signal()
        results = io_array(backend, "float32[64]")
        # sequence A = 5, 7; sequence B = 9, 3
        first = lstm_step_task(1, kinds, [5, 9], [ZERO_SLOT, ZERO_SLOT], [10, 12], None)
        second = lstm_step_task(2, kinds, [7, 3], [10, 12], [20, 22], [2, 3])
        # The second task depends on the first: issued at once, the stream's FIFO order makes it correct.
        backend.issue(decode_task(encode_task(first)))
        backend.issue(decode_task(encode_task(second)))
        wait_signal(backend, seen + 2)
        assert backend.finish(1) is None and backend.finish(2) is None
        out = results.array[2:4].copy()
        results.close()
        return out, captured
    finally:
        backend.close()


def expected_h(cells, sequences: list[list[int]]) -> np.ndarray:
    _specs, _modules, _kinds, state = cells
    embedding = torch.nn.Embedding(state["embedding.weight"].shape[0], state["embedding.weight"].shape[1])
    embedding.load_state_dict({"weight": state["embedding.weight"]})
    lstm = torch.nn.LSTM(32, 64)
    lstm.load_state_dict({k.removeprefix("lstm."): v for k, v in state.items() if k.startswith("lstm.")})
    with torch.inference_mode():
        return np.stack([lstm(embedding(torch.tensor(s)))[1][0][-1].numpy() for s in sequences])


def test_cpu_backend_runs_chained_tasks_in_stream_order(cells):
    got, _ = run_two_steps("cpu", cells)
    np.testing.assert_allclose(got, expected_h(cells, [[5, 7], [9, 3]]), atol=1e-5)


def multi_step(task_id: int, steps: list[TaskMessage]) -> TaskMessage:
    """One task running `steps` back to back, as the manager sends a multi-step task."""
    first, *later = steps
    return TaskMessage(task_id, first.cell_index, first.batch_size, first.inputs, first.outputs, first.downloads,
                       tuple(TaskStep(s.batch_size, s.inputs, s.outputs, s.downloads) for s in later))  # fmt: skip


def test_cpu_backend_runs_a_multi_step_task_and_signals_once(cells):
    """Sequences A = 5, 7, 4 and B = 9, 3 in one task: B drops out of the third step, which runs one row."""
    _, _, kinds, _ = cells
    backend = make_backend("cpu", cells)
    try:
        results = io_array(backend, "float32[64]")
        steps = [
            lstm_step_task(1, kinds, [5, 9], [ZERO_SLOT, ZERO_SLOT], [10, 12], None),
            lstm_step_task(1, kinds, [7, 3], [10, 12], [20, 22], [3, 4]),
            lstm_step_task(1, kinds, [4], [20], [30], [2]),
        ]
        message = decode_task(encode_task(multi_step(1, steps)))
        assert [step.batch_size for step in message.steps()] == [2, 2, 1]
        backend.issue(message)
        wait_signal(backend, 1)
        assert backend.finish(1) is None and backend.signal() == 1
        got = results.array[[2, 4]].copy()
        results.close()
        np.testing.assert_allclose(got, expected_h(cells, [[5, 7, 4], [9, 3]]), atol=1e-5)
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("device", "said"), [("cpu", "index"), pytest.param("cuda:0", "out of range", marks=pytest.mark.cuda)]
)
def test_backend_reports_a_failed_task_and_keeps_going(cells, device, said):
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _, _, kinds, _ = cells
    backend = make_backend(device, cells)
    try:
        bad = lstm_step_task(1, kinds, [2], [ZERO_SLOT], [ROWS + 5], None)  # output slot outside the arena
        good = lstm_step_task(2, kinds, [2], [ZERO_SLOT], [10], None)
        backend.issue(decode_task(encode_task(bad)))
        backend.issue(decode_task(encode_task(good)))
        wait_signal(backend, 2)
        assert said in (backend.finish(1) or "").lower()
        assert backend.finish(2) is None
    finally:
        backend.close()


def test_warm_up_writes_only_the_scratch_row(cells):
    backend = make_backend("cpu", cells)
    try:
        backend.warm_up()
        for info, tensor in zip(backend.arenas, backend._tensors):
            rows = tensor.reshape(tensor.shape[0], -1)
            touched = {int(i) for i in torch.nonzero(rows.abs().sum(dim=1)).flatten()}
            assert touched <= {SCRATCH_SLOT}, (info, touched)
    finally:
        backend.close()


@pytest.fixture
def polled(cells, tmp_path: Path):
    """A CPU backend whose poller sends notices to a PULL socket: (backend, fifo, receiver)."""
    backend = make_backend("cpu", cells)
    context = zmq.Context()
    receiver = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/completions"
    receiver.bind(address)
    fifo = InProgressFIFO()
    poller = Poller(context, address, worker_id=7, key=b"key-7", backend=backend, fifo=fifo, curve=None)
    poller.start()
    yield backend, fifo, receiver
    poller.stopping.set()
    poller.join(timeout=5)
    backend.close()
    poller.close_stream_socket()
    receiver.close()
    context.term()


def notices_until(receiver: zmq.Socket, count: int) -> list[CompletionNotice]:
    """Notices received until `count` tasks have been reported (heartbeats included)."""
    notices: list[CompletionNotice] = []
    while sum(len(n.task_ids) for n in notices) < count:
        reported = [task_id for n in notices for task_id in n.task_ids]
        assert receiver.poll(10_000), f"completions stopped after {reported}"
        notices.append(decode_notice(receiver.recv()))
        assert notices[-1].worker_id == 7 and notices[-1].key == b"key-7"
    return notices


def test_poller_reports_completions_in_fifo_order(cells, polled):
    _specs, _modules, kinds, _ = cells
    backend, fifo, receiver = polled
    for task_id in range(1, 21):
        task = lstm_step_task(task_id, kinds, [2], [ZERO_SLOT], [10 + 2 * (task_id % 5)], None)
        fifo.push(task_id, [])
        backend.issue(decode_task(encode_task(task)))
    seen: list[int] = []
    for notice in notices_until(receiver, 20):
        assert notice.errors == {} and notice.rows == [] and len(notice.busy_us) == len(notice.task_ids)
        seen.extend(notice.task_ids)
        # Every notice carries the stream's counter; a heartbeat, sent apart, may be ahead of the notices.
        assert notice.signal == len(seen) if notice.task_ids else notice.signal >= len(seen)
    assert seen == list(range(1, 21))
    assert len(fifo) == 0


def test_notices_carry_the_downloaded_rows_they_are_asked_for(cells, polled):
    """A worker on another host than the manager sends the rows its tasks downloaded inside their
    notices: exactly those of the io slots asked for, and none for a task that failed."""
    _specs, _modules, kinds, _ = cells
    backend, fifo, receiver = polled
    state_io = arena_ids(kinds)[next(k for k in kinds if k.dtype == "float32")][1]
    first = lstm_step_task(1, kinds, [5, 9], [ZERO_SLOT, ZERO_SLOT], [10, 12], [4, 5])
    second = lstm_step_task(2, kinds, [7, 3], [10, 12], [20, 22], [2, 3])
    failing = lstm_step_task(3, kinds, [1], [ROWS + 5], [30], [6])  # reads a slot past the arena
    for task, sent in ((first, []), (second, [(state_io, np.array([2, 3]))]), (failing, [(state_io, np.array([6]))])):
        fifo.push(task.task_id, sent)
        backend.issue(decode_task(encode_task(task)))
    notices = notices_until(receiver, 3)
    assert [task_id for n in notices for task_id in n.errors] == [3]
    rows = [row for n in notices for row in n.rows]
    assert len(rows) == 1
    arena, slots, data = rows[0]
    assert arena == state_io and slots.tolist() == [2, 3]
    sent = np.frombuffer(data, np.float32).reshape(2, 64)
    np.testing.assert_allclose(sent, expected_h(cells, [[5, 7], [9, 3]]), atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_backend_matches_cpu(cells, cuda_graphs: bool):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    got, captured = run_two_steps("cuda:0", cells, cuda_graphs)
    assert (captured > 0) == cuda_graphs  # replayed graphs, not the eager run again
    np.testing.assert_allclose(got, expected_h(cells, [[5, 7], [9, 3]]), atol=1e-5)
    if cuda_graphs:
        eager, _ = run_two_steps("cuda:0", cells, False)
        np.testing.assert_allclose(got, eager, atol=1e-6)


@pytest.mark.cuda
def test_cuda_counter_is_written_in_stream_order(cells):
    """A stalled stream holds the counter back; once it moves, the tasks' downloads are complete on the host."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    backend = make_backend("cuda:0", cells)
    try:
        results = io_array(backend, "float32[64]")
        with backend._calls.on_stream():
            torch.cuda._sleep(5 * 10**9)  # a few seconds of device time ahead of the tasks
        _, _, kinds, _ = cells
        first = lstm_step_task(1, kinds, [5, 9], [ZERO_SLOT, ZERO_SLOT], [10, 12], None)
        second = lstm_step_task(2, kinds, [7, 3], [10, 12], [20, 22], [2, 3])
        backend.issue(decode_task(encode_task(first)))
        backend.issue(decode_task(encode_task(second)))
        assert backend.signal() == 0, "the counter moved while the stream was still asleep"
        wait_signal(backend, 2, timeout=120)
        assert backend.finish(1) is None and backend.finish(2) is None
        np.testing.assert_allclose(results.array[2:4], expected_h(cells, [[5, 7], [9, 3]]), atol=1e-5)
        results.close()
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("device", "status", "message"),
    [("cuda:0", EXIT_STARTUP_FAILED, "could not start on cuda:0"), ("tpu", EXIT_CONFIG_ERROR, "unknown device 'tpu'")],
)
def test_worker_that_cannot_start_exits_with_its_own_status(tmp_path: Path, device: str, status: int, message: str):
    """A device that cannot run the cells (here: CUDA asked of a CPU-only torch) is a start-up failure:
    one clear log line and status 3, not a crash the supervisor would mistake for a fault to retry at once;
    a device name no backend knows is a configuration error."""
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine can start a CUDA worker")
    config = write_config(tmp_path, SMALL_LSTM)
    process = subprocess.run(
        [sys.executable, "-m", "worker", "--config", str(config.path), "--manager", "tcp://127.0.0.1:9"]
        + ["--device", device],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert process.returncode == status, process.stderr
    assert message in process.stderr


def test_an_empty_host_id_is_refused(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    process = subprocess.run(
        [sys.executable, "-m", "worker", "--config", str(config.path), "--manager", "tcp://127.0.0.1:9",
         "--host-id", " "],
        capture_output=True, text=True, check=False, timeout=120, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert process.returncode == 2 and "--host-id: must not be empty" in process.stderr
