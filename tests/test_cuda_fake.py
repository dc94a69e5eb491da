"""The CUDA backend's tensor work on a machine without a GPU: every tensor on a fake "cuda" device.

torch's FakeTensorMode creates tensors on "cuda" in a CPU-only build, with shapes, dtypes
and devices but no data, and raises on an operation that mixes devices, as a GPU would.
`DeviceTasks` (worker/device_tasks.py) runs here exactly as in the CUDA backend, through the
backend's own `StreamCalls`; only the CUDA runtime under them is a stand-in (tests/cuda_fakes.py),
which records the stream of every operation and refuses unpinned copies. Warm-up, the issue path
(staging, gathers, inline inputs, peers' rows with and without peer access, scatters,
downloads) and every built-in model's cells run with all arenas and weights on "cuda".
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from cuda_fakes import FakeRuntime
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode
from torch.overrides import TorchFunctionMode

from batchmaker.common.config import load_config
from batchmaker.common.graph import CellTypeSpec
from batchmaker.common.models.base import build_model, cell_layout
from batchmaker.common.task import SLOT_DTYPE, TaskMessage, TaskStep
from batchmaker.worker.backend import arena_ids
from batchmaker.worker.batched_task import IssuedTask, run_task
from batchmaker.worker.cuda import TORCH_DTYPES, StreamCalls
from batchmaker.worker.device_tasks import DeviceTasks, staged_bytes

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda", 0)
PEER_DEVICE = torch.device("cuda", 1)
ROWS = 256
ACCESSIBLE_PEER, DISTANT_PEER = 7, 8  # a peer mapped on this GPU (peer access), and one mapped on its own


class FakeCalls(StreamCalls):
    """The CUDA backend's device calls on a fake runtime, counting what they enqueued."""

    def __init__(self, runtime: FakeRuntime | None = None) -> None:
        super().__init__(DEVICE, runtime or FakeRuntime())
        self.peer_streams: list[torch.device] = []

    def on_peer_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        self.peer_streams.append(device)
        return super().on_peer_stream(device)

    def count(self, what: str) -> int:
        return sum(call.what == what for call in self.runtime.calls)

    @property
    def signals(self) -> int:
        return self.count("signal")

    @property
    def sent(self) -> int:
        return self.count("upload")

    @property
    def downloads(self) -> int:
        return self.count("download")


class GuardFreeIndexing(TorchFunctionMode):
    """`tensor[...]` with slices, integers, None and Ellipsis, lowered to the aten view ops.

    Python indexing sets a device guard first, which a CPU-only build lacks for "cuda"; the
    view ops it lowers to need none, and none of them moves data between devices.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            return _basic_index(*args)
        return func(*args, **(kwargs or {}))


def _basic_index(tensor: torch.Tensor, key) -> torch.Tensor:
    key = key if isinstance(key, tuple) else (key,)
    if Ellipsis in key:
        at = key.index(Ellipsis)
        fill = tensor.dim() - sum(k is not None for k in key if k is not Ellipsis)
        key = key[:at] + (slice(None),) * fill + key[at + 1 :]
    dim = 0
    for item in key:
        if item is None:
            tensor = tensor.unsqueeze(dim)
            dim += 1
        elif isinstance(item, int):
            tensor = tensor.select(dim, item)
        elif isinstance(item, slice):
            start = 0 if item.start is None else item.start
            stop = sys.maxsize if item.stop is None else item.stop
            tensor = torch.ops.aten.slice.Tensor(tensor, dim, start, stop, item.step or 1)
            dim += 1
        else:
            raise TypeError(f"indexing with {type(item).__name__} is not lowered here")
    return tensor


# torch's fused RNN cell kernels exist only for CUDA and have no shape function; these give them one,
# so GRUCell and LSTMCell take the very path they take on a GPU. (FakeTensorMode checks the devices.)
_FUSED_CELLS = torch.library.Library("aten", "IMPL")
_FUSED_SHAPES = {
    "_thnn_fused_gru_cell": lambda gates, hidden_gates, hx, *biases: (
        hx.new_empty(hx.shape),
        hx.new_empty((hx.shape[0], 5 * hx.shape[1])),
    ),
    "_thnn_fused_lstm_cell": lambda gates, hidden_gates, cx, *biases: (
        cx.new_empty(cx.shape),
        cx.new_empty(cx.shape),
        gates.new_empty(gates.shape),
    ),
}
for _name, _shapes in _FUSED_SHAPES.items():
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):
        _FUSED_CELLS.impl(_name, _shapes, "Meta")


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    mode = FakeTensorMode()
    with mode, GuardFreeIndexing():
        yield mode


def on_fake_device(module: nn.Module, device: torch.device = DEVICE) -> nn.Module:
    """What `cell.to(device)` does to parameters and buffers, with fake tensors (no data to copy)."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def all_cells(path: Path = ROOT / "configs" / "all.toml") -> tuple[list[CellTypeSpec], list[nn.Module], list]:
    """Every model of a config (by default every built-in one): specs, cells with random weights, value kinds."""
    config = load_config(path)
    models = [build_model(model_config) for model_config in config.models.values()]
    specs, kinds = cell_layout(models)
    modules: dict[str, nn.Module] = {}
    for model in models:
        modules.update(model.make_cells(model.init_weights(0)))
    return specs, [modules[spec.key].eval() for spec in specs], kinds


@pytest.fixture
def layout():
    return all_cells()


def fake_tasks(layout, calls: FakeCalls) -> tuple[DeviceTasks, dict]:
    """DeviceTasks on fake "cuda" arenas, with two peers' arenas open: one on this GPU, one on another."""
    specs, cells, kinds = layout
    ids = arena_ids(kinds)
    arenas, io = {}, {}
    for kind in kinds:
        device_id, io_id = ids[kind]
        arenas[device_id] = torch.zeros((ROWS, *kind.shape), dtype=TORCH_DTYPES[kind.dtype], device=DEVICE)
        io[io_id] = np.zeros((ROWS, *kind.shape), dtype=kind.dtype)
        calls.runtime.pin(io[io_id])
    tasks = DeviceTasks(calls, [on_fake_device(cell) for cell in cells], specs, ids, arenas, io)
    for (worker_id, device) in ((ACCESSIBLE_PEER, DEVICE), (DISTANT_PEER, PEER_DEVICE)):
        for arena_id, arena in arenas.items():
            tasks.peers[(worker_id, arena_id)] = torch.zeros(arena.shape, dtype=arena.dtype, device=device)
    return tasks, ids


def slots(values) -> np.ndarray:
    return np.asarray(values, dtype=SLOT_DTYPE)


def serving_task(task_id: int, cell_index: int, spec: CellTypeSpec, ids, batch: int) -> TaskMessage:
    """A task like the manager's: inline tokens, peers' rows from both peers, two children per ragged row, downloads."""
    inputs = []
    for port, kind in enumerate(spec.inputs):
        arena = ids[kind][0]
        if port in spec.ragged_inputs:
            width = 2 * batch
            entry = [arena, slots(np.arange(width) + 2), slots(np.repeat(np.arange(batch), 2)), None, None]
        else:
            width = batch
            entry = [arena, slots(np.arange(width) + 2), None, None, None]
        if kind.dtype == "int64":
            values = np.zeros((width, *kind.shape), dtype=kind.dtype)
            entry[4] = (slots(np.arange(width)), values.tobytes())
        else:
            entry[3] = [
                (ACCESSIBLE_PEER, arena, slots([5]), slots([0])),
                (DISTANT_PEER, arena, slots([9]), slots([width - 1])),
            ]
        inputs.append(tuple(entry))
    outputs = [(ids[kind][0], slots(np.arange(batch) + 100 + 10 * i)) for i, kind in enumerate(spec.outputs)]
    downloads = [
        (ids[kind][0], out, ids[kind][1], slots(np.arange(batch))) for kind, (_, out) in zip(spec.outputs, outputs)
    ]
    return TaskMessage(task_id, cell_index, batch, inputs, outputs, downloads)


def test_fake_cuda_catches_an_index_left_on_the_host():
    """The harness can fail: an index on the host next to a "cuda" arena raises, as on a GPU."""
    with fake_cuda():
        arena = torch.zeros((8, 4), device=DEVICE)
        task = IssuedTask(1, nn.Identity(), [(arena, torch.zeros(2, dtype=torch.int64), None, [], None)], [], [])
        with pytest.raises(FakeTensorDeviceMismatchError):
            run_task(task)


def test_warm_up_runs_every_cell_of_every_model_on_the_device(layout):
    specs, _, _ = layout
    assert {spec.key.split("/")[0] for spec in specs} == {"lstm", "gru", "seq2seq", "treelstm", "childsum"}
    with fake_cuda():
        calls = FakeCalls()
        tasks, _ = fake_tasks(layout, calls)
        tasks.warm_up()
    assert calls.sent == sum(len(spec.batch_sizes) for spec in specs)
    assert calls.signals == 0  # warm-up tasks are not the manager's: the counter stays at zero


@pytest.mark.parametrize("batch", [1, 5])
def test_every_cell_serves_a_task_on_the_device(layout, batch: int):
    specs, _, _ = layout
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        for task_id, spec in enumerate(specs, start=1):
            tasks.issue(serving_task(task_id, task_id - 1, spec, ids, batch))
            assert calls.signals == task_id
            assert tasks.finish(task_id) is None, spec.key
    assert calls.sent == len(specs)
    assert calls.downloads == sum(len(spec.outputs) for spec in specs)
    # Rows of the peer mapped on its own GPU are gathered on that GPU's stream; the other peer's need no stream.
    float_inputs = sum(1 for spec in specs for kind in spec.inputs if kind.dtype != "int64")
    assert calls.peer_streams == [PEER_DEVICE] * float_inputs


def test_a_multi_step_task_enqueues_every_step_and_one_signal_without_a_host_sync(layout):
    """Three steps of every cell type, the batch shrinking 5, 3, 1: one staging copy for all steps, then each
    step's gathers, cell, scatters and downloads go on the stream; no synchronize between them, and the
    counter is written once."""
    specs, _, _ = layout
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        for task_id, spec in enumerate(specs, start=1):
            first, *later = (serving_task(task_id, task_id - 1, spec, ids, batch) for batch in (5, 3, 1))
            steps = tuple(TaskStep(step.batch_size, step.inputs, step.outputs, step.downloads) for step in later)
            tasks.issue(TaskMessage(task_id, first.cell_index, 5, first.inputs, first.outputs, first.downloads, steps))
            assert calls.signals == task_id
            assert tasks.finish(task_id) is None, spec.key
    assert calls.sent == len(specs)  # every step's slot lists and inline values in one copy
    assert calls.downloads == 3 * sum(len(spec.outputs) for spec in specs)
    assert calls.count("synchronize") == 0


def test_a_task_that_cannot_be_issued_completes_with_its_error(layout):
    """Bad slots, a shape error or an unknown peer fail that task only, and still advance the counter."""
    specs, _, _kinds = layout
    index = next(i for i, spec in enumerate(specs) if spec.key == "lstm/layer0")
    spec = specs[index]
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        good = serving_task(1, index, spec, ids, 4)
        arena, _, _, _, inline = good.inputs[0]
        outside = TaskMessage(2, index, 4, good.inputs, [(good.outputs[0][0], slots([2, 3, 4, ROWS]))], [])
        short_inline = (arena, slots([2, 3, 4, 5]), None, None, (inline[0], inline[1][:8]))
        shape_error = TaskMessage(3, index, 4, [short_inline, *good.inputs[1:]], good.outputs, [])
        state = good.inputs[1]
        from_unknown_peer = (*state[:3], [(99, state[0], slots([5]), slots([0]))], None)
        unknown_peer = TaskMessage(4, index, 4, [good.inputs[0], from_unknown_peer, *good.inputs[2:]], good.outputs, [])
        to_bad_io = [(good.outputs[0][0], good.outputs[0][1], 1, slots([0, 1, 2, ROWS + 1]))]
        bad_io = TaskMessage(5, index, 4, good.inputs, good.outputs, to_bad_io)
        for task in (good, outside, shape_error, unknown_peer, bad_io, serving_task(6, index, spec, ids, 4)):
            tasks.issue(task)
        assert calls.signals == 6
        errors = [tasks.finish(task_id) for task_id in range(1, 7)]
    assert errors[0] is None and errors[5] is None
    assert "output index 256 out of range 0..255" in errors[1]
    assert errors[2] is not None
    assert "worker 99" in errors[3]
    assert "io slot index 257 out of range" in errors[4]


def test_a_multi_step_task_with_a_step_it_cannot_issue_enqueues_nothing(layout):
    """The third step writes outside its arena: the task fails whole, before its first step's copy or gathers."""
    specs, _, _ = layout
    index = next(i for i, spec in enumerate(specs) if spec.key == "lstm/layer0")
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        first, second = (serving_task(1, index, specs[index], ids, batch) for batch in (4, 2))
        outside = TaskStep(2, second.inputs, [(second.outputs[0][0], slots([2, ROWS]))], [])
        later = (TaskStep(2, second.inputs, second.outputs, second.downloads), outside)
        tasks.issue(TaskMessage(1, index, 4, first.inputs, first.outputs, first.downloads, later))
        assert "output index 256 out of range 0..255" in tasks.finish(1)
        assert calls.signals == 1
    assert calls.sent == 0 and calls.downloads == 0


def test_staging_holds_exactly_what_the_task_sends(layout):
    specs, _, _ = layout
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        for cell_index, spec in enumerate(specs):
            task = serving_task(cell_index, cell_index, spec, ids, 3)
            staging = calls.staging(staged_bytes(task))
            calls.staging = lambda nbytes, staging=staging: staging  # the task must fill it to the last byte
            tasks.issue(task)
            assert tasks.finish(cell_index) is None
            assert staging._used == staged_bytes(task), spec.key
            del calls.staging


def test_cells_made_from_weights_on_the_gpu_keep_everything_there():
    """The worker moves the weights to its device before making the cells, so folded tables are
    computed on the GPU: every parameter and buffer of every built-in cell ends up there."""
    config = load_config(ROOT / "configs" / "all.toml")
    with fake_cuda():
        for model_config in config.models.values():
            model = build_model(model_config)
            state = {key: torch.empty(shape, device=DEVICE) for key, shape in model.weight_shapes().items()}
            for key, cell in model.make_cells(state).items():
                placed = {tensor.device for tensor in (*cell.parameters(), *cell.buffers())}
                assert placed == {DEVICE}, f"{key}: {placed}"
