"""Captured cells (worker/cuda_graphs.py): the graph path's buffer plumbing, on fake "cuda" tensors
and with real values on the CPU, and the real capture on a GPU (`cuda`-marked).

Without a GPU nothing can be captured, so `EagerReplay` stands in for `CapturedCell`: the same
static inputs, static outputs and `run`, with a replay that runs the cell eagerly over the static
inputs and copies its results into the static outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL_LSTM, SMALL_SEQ2SEQ, start_server, stop_server, write_config
from test_cuda_fake import (
    ACCESSIBLE_PEER,
    DEVICE,
    DISTANT_PEER,
    ROWS,
    FakeCalls,
    all_cells,
    fake_cuda,
    fake_tasks,
    serving_task,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from batchmaker.clients import AsyncClient
from batchmaker.common.config import Config
from batchmaker.common.models import build_model
from batchmaker.common.models.seq2seq import decoding_mismatch
from batchmaker.common.task import TaskMessage
from batchmaker.worker.backend import TORCH_DTYPES, arena_ids
from batchmaker.worker.batched_task import gather
from batchmaker.worker.cuda_graphs import CapturedCell, as_tuple, capturable
from batchmaker.worker.device_tasks import DeviceCalls, DeviceTasks, Staging

BATCH = 4  # a batch size every cell type of configs/all.toml supports
NEAR_TIE = 1e-4


class EagerReplay(CapturedCell):
    """A captured cell whose replay runs the cell eagerly: the graph path's plumbing without a GPU."""

    def __init__(self, cell: nn.Module, inputs: list[torch.Tensor]):
        self.replays = 0
        super().__init__(cell, inputs, None, None)

    def _capture(self, cell, stream, pool) -> tuple[torch.Tensor, ...]:
        self._cell = cell
        return as_tuple(cell(*self.inputs))

    def replay(self) -> tuple[torch.Tensor, ...]:
        self.replays += 1
        for static, result in zip(self.outputs, as_tuple(self._cell(*self.inputs))):
            torch.ops.aten.copy_(static, result)  # Tensor.copy_ sets a device guard, which a CPU-only build lacks
        return self.outputs


class DeviceArgs(TorchDispatchMode):
    """Records every operation's tensor arguments, and where each gather and scatter wrote or read."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()
        self.gathered_into: list[torch.Tensor] = []
        self.scattered_from: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in [*args, *kwargs.values()]:
            if isinstance(value, torch.Tensor):
                self.devices.add(value.device.type)
        if func is torch.ops.aten.index_select.out:
            self.gathered_into.append(kwargs["out"])
        if func is torch.ops.aten.index_copy_.default:
            self.scattered_from.append(args[3])
        return func(*args, **kwargs)


def is_among(tensor: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    return any(tensor is other for other in tensors)


def test_the_graph_path_keeps_every_tensor_on_the_device():
    """Static buffers on the device, filled from the arenas, peers and inline rows, scattered back from."""
    layout = all_cells()
    specs, _, _ = layout
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        tasks.warm_up(EagerReplay)
        captured = {(i, size) for i, spec in enumerate(specs) if capturable(spec) for size in spec.batch_sizes}
        assert set(tasks.graphs) == captured
        assert "childsum/node" not in {specs[i].key for i, _ in tasks.graphs}  # ragged: stays eager
        for (index, size), graph in tasks.graphs.items():
            spec = specs[index]
            assert [(tuple(t.shape), t.dtype) for t in graph.inputs] == [
                ((size, *kind.shape), TORCH_DTYPES[kind.dtype]) for kind in spec.inputs
            ]
            assert all(t.device == DEVICE for t in [*graph.inputs, *graph.outputs]), spec.key
            assert graph.replays == 1, spec.key  # warm-up ran each graphed task once
        warm_up_downloads = calls.downloads
        for task_id, spec in enumerate(specs, start=1):
            graph = tasks.graphs.get((task_id - 1, BATCH))
            recorder = DeviceArgs()
            with recorder:
                tasks.issue(serving_task(task_id, task_id - 1, spec, ids, BATCH))
            assert tasks.finish(task_id) is None, spec.key
            assert recorder.devices == {"cuda"}, f"{spec.key} touched {recorder.devices}"
            if graph is None:
                assert not recorder.gathered_into, spec.key
                continue
            assert graph.replays == 2, spec.key
            # Every input gathered into its static buffer, every output scattered from the static outputs.
            assert [id(t) for t in recorder.gathered_into] == [id(t) for t in graph.inputs], spec.key
            assert all(is_among(out, recorder.scattered_from) for out in graph.outputs), spec.key
    assert calls.downloads - warm_up_downloads == sum(len(spec.outputs) for spec in specs)


def test_a_task_that_does_not_fit_its_graph_fails_alone():
    """Fewer rows than the captured batch would resize a static input: that task fails, the next one runs."""
    layout = all_cells()
    specs, _, _ = layout
    index = next(i for i, spec in enumerate(specs) if spec.key == "lstm/layer0")
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        tasks.warm_up(EagerReplay)
        good = serving_task(1, index, specs[index], ids, BATCH)
        arena, slots, *_ = good.inputs[1]
        inputs = [good.inputs[0], (arena, slots[:3], None, None, None), *good.inputs[2:]]
        short = TaskMessage(2, index, BATCH, inputs, good.outputs, [])
        for task in (short, serving_task(3, index, specs[index], ids, BATCH)):
            tasks.issue(task)
        assert calls.signals == 2
        assert "input 1 has 3 rows; its static input holds 4" in tasks.finish(2)
        assert tasks.finish(3) is None
        assert tuple(tasks.graphs[(index, BATCH)].inputs[1].shape) == (BATCH, 256)


def test_a_ragged_input_is_never_gathered_into_a_static_buffer():
    arena = torch.zeros((8, 3))
    ragged = (arena, torch.tensor([2, 3, 4]), torch.tensor([0, 0, 1]), [], None)
    with pytest.raises(ValueError, match="input 0 is ragged"):
        gather([ragged], into=[torch.zeros((2, 3))])


class HostCalls(DeviceCalls):
    """Device calls on the CPU with real values: the staging buffer is the device buffer."""

    device = torch.device("cpu")

    def on_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def on_peer_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def staging(self, nbytes: int) -> Staging:
        host = np.zeros(nbytes, dtype=np.uint8)
        return Staging(host, torch.from_numpy(host), lambda: None)

    def signal(self) -> None:
        pass

    def download(self, host: np.ndarray, rows: torch.Tensor) -> None:
        host[:] = rows.numpy()


def filled_arenas(kinds, device: torch.device, seed: int = 0):
    """Arenas of random rows (tokens below every vocabulary size), row 0 zero as the manager expects;
    two peers' arenas likewise; empty io arenas."""
    generator = torch.Generator().manual_seed(seed)
    ids = arena_ids(kinds)

    def arena(kind) -> torch.Tensor:
        shape = (ROWS, *kind.shape)
        if kind.dtype == "int64":
            rows = torch.randint(0, 8000, shape, generator=generator)
        else:
            rows = torch.randn(shape, generator=generator).to(TORCH_DTYPES[kind.dtype])
        rows[0] = 0
        return rows.to(device)

    arenas = {ids[kind][0]: arena(kind) for kind in kinds}
    io = {ids[kind][1]: np.zeros((ROWS, *kind.shape), dtype=kind.dtype) for kind in kinds}
    peers = {(worker, ids[kind][0]): arena(kind) for worker in (ACCESSIBLE_PEER, DISTANT_PEER) for kind in kinds}
    return ids, arenas, io, peers


def serve_every_cell(calls: DeviceCalls, layout, capture, finished=lambda: None):
    """One serving task per cell type (peers' rows, inline tokens, downloads); the arenas and io arenas after."""
    specs, cells, kinds = layout
    with calls.on_stream():  # filled on the stream that reads them, as the CUDA backend does
        ids, arenas, io, peers = filled_arenas(kinds, calls.device)
        cells = [cell.to(calls.device) for cell in cells]
    tasks = DeviceTasks(calls, cells, specs, ids, arenas, io)
    tasks.peers.update(peers)
    tasks.warm_up(capture)
    for index, spec in enumerate(specs):
        tasks.issue(serving_task(index + 1, index, spec, ids, BATCH))
    finished()
    assert [tasks.finish(index + 1) for index in range(len(specs))] == [None] * len(specs)
    return {key: arena.cpu().numpy() for key, arena in arenas.items()}, io, tasks


def test_the_graph_path_gives_the_eager_path_results():
    """With real values: gathers into the static inputs (own rows, peers' rows, inline tokens over them),
    the replay, the scatters and the downloads put every value where the eager path does."""
    layout = all_cells()
    eager_arenas, eager_io, _ = serve_every_cell(HostCalls(), layout, None)
    graph_arenas, graph_io, tasks = serve_every_cell(HostCalls(), layout, EagerReplay)
    assert all(graph.replays == 2 for (_, size), graph in tasks.graphs.items() if size == BATCH)
    for key in eager_arenas:
        np.testing.assert_allclose(graph_arenas[key], eager_arenas[key], rtol=0, atol=1e-6, err_msg=f"arena {key}")
    for key in eager_io:
        np.testing.assert_allclose(graph_io[key], eager_io[key], rtol=0, atol=1e-6, err_msg=f"io arena {key}")
    assert any(np.any(rows[100:100 + BATCH]) for rows in graph_arenas.values())  # outputs were written


@pytest.mark.cuda
def test_captured_cells_give_the_eager_results_on_a_gpu():
    """Every cell type of every built-in model, captured on the worker's stream, against the same tasks run eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from batchmaker.worker.cuda import StreamCalls
    from batchmaker.worker.cuda_graphs import capture_on

    results = []
    for graphs in (False, True):
        layout = all_cells()
        calls = StreamCalls(torch.device("cuda:0"))

        def finished(calls=calls) -> None:
            assert calls.wait(120), "the stream did not finish"

        arenas, io, tasks = serve_every_cell(calls, layout, capture_on(calls.stream) if graphs else None, finished)
        assert bool(tasks.graphs) == graphs
        results.append((arenas, io))
    (eager_arenas, eager_io), (graph_arenas, graph_io) = results
    for key in eager_arenas:
        np.testing.assert_allclose(graph_arenas[key], eager_arenas[key], rtol=0, atol=1e-5, err_msg=f"arena {key}")
    for key in eager_io:
        np.testing.assert_allclose(graph_io[key], eager_io[key], rtol=0, atol=1e-5, err_msg=f"io arena {key}")


def served_answers(tmp_path: Path, cuda_graphs: bool, requests: list[tuple[str, dict]]) -> tuple[Config, list[dict]]:
    server_text = f'devices = ["cuda:0"]\ncuda_graphs = {"true" if cuda_graphs else "false"}\n'
    config = write_config(tmp_path, SMALL_LSTM + SMALL_SEQ2SEQ, server=server_text)
    server = start_server(config, workers=1)
    try:

        async def ask() -> list:
            async with AsyncClient(server.address, timeout=120) as client:
                return await asyncio.gather(*(client.infer(model, inputs) for model, inputs in requests))

        return config, [reply.outputs for reply in asyncio.run(ask())]
    finally:
        stop_server(server)


@pytest.mark.cuda
def test_served_answers_with_graphs_equal_those_without(tmp_path: Path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(3)
    requests = [
        (model, {"tokens": rng.integers(0, 1000, int(rng.integers(1, 40))).tolist()})
        for model in ("lstm", "seq2seq")
        for _ in range(60)
    ]
    _, eager = served_answers(tmp_path, False, requests)
    config, graphed = served_answers(tmp_path, True, requests)
    seq2seq = build_model(config.models["seq2seq"])
    state = seq2seq.load_weights()
    for (model, inputs), without, with_graphs in zip(requests, eager, graphed):
        assert set(without) == set(with_graphs)
        if model == "lstm":
            np.testing.assert_allclose(with_graphs["h"], without["h"], rtol=0, atol=1e-5)
            continue
        # An argmax at a near-tie may flip with the last bits; both must decode as the reference does.
        reference = seq2seq.reference(state, inputs)
        for answer in (without, with_graphs):
            problem = decoding_mismatch(answer["tokens"], reference, NEAR_TIE)
            assert problem is None, problem


def test_a_cpu_worker_with_cuda_graphs_set_says_it_runs_eagerly(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """devices = "auto" without GPUs starts CPU workers: the switch cannot apply, and the log says so."""
    from batchmaker.worker.cpu import CpuBackend
    from batchmaker.worker.main import load_cells
    from batchmaker.worker.startup import make_backend

    config = write_config(tmp_path, SMALL_LSTM, server="cuda_graphs = true")
    specs, cells, kinds = load_cells(config)
    with caplog.at_level("WARNING"):
        backend = make_backend("cpu", specs, cells, kinds, 64, 64, config.server.cuda_graphs)
    try:
        assert isinstance(backend, CpuBackend)
        assert "its cells run eagerly" in caplog.text
    finally:
        backend.close()
