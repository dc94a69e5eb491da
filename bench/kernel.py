"""The raw kernel: each cell of a model at its largest batch size, in a tight loop, in this
process, with no server: the ideal a serving system's throughput is measured against.

Measured twice: the kernels the workers serve (common/models/kernels.py), and the same cells
written with plain torch.nn modules, so a run shows both a faster cell and a server at its
cell's limit."""

from __future__ import annotations

import time

import torch

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.models.base import Model

MIN_SECONDS = 1.0
MIN_CALLS = 20


def _inputs(spec: CellTypeSpec, batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Rows like a task's gathered inputs: token 0 for integer kinds, N(0, 1) for float ones;
    a ragged port gets one child per node."""
    rows: list[torch.Tensor] = []
    for port, kind in enumerate(spec.inputs):
        rows.append(_rows(kind, batch, generator))
        if port in spec.ragged_inputs:
            rows.append(torch.arange(batch))
    return rows


def _rows(kind: ValueKind, batch: int, generator: torch.Generator) -> torch.Tensor:
    if kind.dtype.startswith("int"):
        return torch.zeros((batch, *kind.shape), dtype=torch.int64)
    return torch.randn((batch, *kind.shape), generator=generator)


def time_cell(cell: torch.nn.Module, inputs: list[torch.Tensor], min_seconds: float = MIN_SECONDS) -> float:
    """Seconds per call: the median of repeated timed blocks after a warm-up."""
    with torch.inference_mode():
        for _ in range(3):
            cell(*inputs)
        blocks = []
        spent = 0.0
        while spent < min_seconds or len(blocks) < 5:
            start = time.perf_counter()
            for _ in range(MIN_CALLS // 5 or 1):
                cell(*inputs)
            elapsed = time.perf_counter() - start
            blocks.append(elapsed / (MIN_CALLS // 5 or 1))
            spent += elapsed
    blocks.sort()
    return blocks[len(blocks) // 2]


def measure(model: Model, threads: int, min_seconds: float = MIN_SECONDS) -> dict[str, dict[str, dict[str, float]]]:
    """Per cell type, for the served kernels ("served") and the plain torch.nn cells ("torch_nn"):
    the largest batch size, seconds per call and cells per second, measured alternately."""
    torch.set_num_threads(threads)
    state = model.load_weights()
    variants = {"served": model.make_cells(state), "torch_nn": model.torch_nn_cells(state)}
    generator = torch.Generator().manual_seed(0)
    measured: dict[str, dict[str, dict[str, float]]] = {variant: {} for variant in variants}
    for key, spec in model.cell_types.items():
        batch = spec.max_batch
        inputs = _inputs(spec, batch, generator)
        for variant, cells in variants.items():
            seconds = time_cell(cells[key], inputs, min_seconds)
            measured[variant][key] = {"batch": batch, "seconds_per_call": seconds, "cells_per_s": batch / seconds}
    return measured


def ideal(kernel: dict[str, dict[str, float]], cells_per_request: dict[str, float]) -> dict[str, float]:
    """The raw kernel's request rate for a mix of cells: every cell run in full batches, nothing else."""
    seconds = sum(count / kernel[key]["cells_per_s"] for key, count in cells_per_request.items())
    cells = sum(cells_per_request.values())
    return {"requests_per_s": 1.0 / seconds, "cells_per_s": cells / seconds}
