"""Materialized cells: each cell's forward per batch size captured once as a CUDA graph, replayed per task.

A task of a captured (cell type, batch size) gathers its input rows straight into the
graph's static inputs (`index_select(..., out=static)`), replays the graph (one launch
for all of the cell's kernels), and scatters from its static outputs. Cells with ragged
inputs (Child-Sum TreeLSTM nodes, whose children vary in number) stay eager: their
shapes change from task to task.

Every graph of a worker shares one memory pool. That is safe here because replays run
one at a time on the worker's stream and each is followed, in stream order, by the
scatter that reads its outputs, before any other graph can reuse that memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchmaker.common.graph import CellTypeSpec
from batchmaker.worker.backend import TORCH_DTYPES
from batchmaker.worker.batched_task import IssuedTask, gather, scatter

WARM_UP_RUNS = 3  # eager runs before capture, on the capture stream: cuBLAS handles and workspaces exist by then


class CapturedCell:
    """One cell at one batch size over static buffers: fill `inputs`, `replay()`, read `outputs`."""

    def __init__(self, cell: nn.Module, inputs: list[torch.Tensor], stream: torch.cuda.Stream, pool: tuple):
        self.inputs = inputs
        self.outputs = self._capture(cell, stream, pool)

    def _capture(self, cell: nn.Module, stream: torch.cuda.Stream, pool: tuple) -> tuple[torch.Tensor, ...]:
        with torch.cuda.stream(stream):
            for _ in range(WARM_UP_RUNS):
                cell(*self.inputs)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool, stream=stream):
            outputs = cell(*self.inputs)
        return as_tuple(outputs)

    def replay(self) -> tuple[torch.Tensor, ...]:
        """Enqueue the captured kernels on the current stream; the outputs hold their results in stream order."""
        self._graph.replay()
        return self.outputs

    def run(self, task: IssuedTask) -> None:
        """The task through the graph: gather into the static inputs, replay, scatter from the static outputs."""
        gather(task.inputs, into=self.inputs)
        scatter(task, self.replay())


Capture = Callable[[nn.Module, list[torch.Tensor]], CapturedCell]


def capture_on(stream: torch.cuda.Stream) -> Capture:
    """Captures on the worker's own stream, all into one memory pool."""
    pool = torch.cuda.graph_pool_handle()
    return lambda cell, inputs: CapturedCell(cell, inputs, stream, pool)


def capturable(spec: CellTypeSpec) -> bool:
    """Whether every input of the cell type has one row per batch member (no ragged input)."""
    return not spec.ragged_inputs


def capture_cells(
    cells: list[nn.Module], specs: list[CellTypeSpec], device: torch.device, capture: Capture
) -> dict[tuple[int, int], CapturedCell]:
    """A captured cell per (cell index, batch size) of every capturable cell type, on zeroed static inputs."""
    graphs = {}
    for index, (cell, spec) in enumerate(zip(cells, specs)):
        if not capturable(spec):
            continue
        for size in spec.batch_sizes:
            inputs = [
                torch.zeros((size, *kind.shape), dtype=TORCH_DTYPES[kind.dtype], device=device) for kind in spec.inputs
            ]
            graphs[(index, size)] = capture(cell, inputs)
    return graphs


def as_tuple(results: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (results,) if isinstance(results, torch.Tensor) else tuple(results)
