"""Run compiled plans in-process the way the server batches them: every wave (lane, depth) of every
request at once, in one batch per cell type and depth, padded to a supported batch size with zero
rows; registers, zero rows and external values resolved as the manager resolves them."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from batchmaker.common.models.base import Model
from batchmaker.common.plan import ZERO_REF, Unfolded


def run_plans(model: Model, cells: dict[str, torch.nn.Module], requests: list[Unfolded]) -> list[dict[str, Any]]:
    """The replies (`model.outputs`) of the requests, computed together."""
    registers: list[dict[int, torch.Tensor]] = [{} for _ in requests]
    results: list[dict[str, np.ndarray]] = [{} for _ in requests]
    waves: dict[int, dict[str, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for r, unfolded in enumerate(requests):
        plan = unfolded.plan
        for lane, key in enumerate(plan.lane_cells):
            for node in range(plan.lane_bounds[lane], plan.lane_bounds[lane + 1]):
                waves[int(plan.depth[node])][key].append((r, node))
    for depth in sorted(waves):
        for key, nodes in waves[depth].items():
            spec = model.cell_types[key]
            for first in range(0, len(nodes), spec.max_batch):
                _run_batch(cells[key], spec, requests, registers, results, nodes[first : first + spec.max_batch])
    return [model.outputs(u, found) for u, found in zip(requests, results)]


def _run_batch(cell, spec, requests, registers, results, batch: list[tuple[int, int]]) -> None:
    """One task: the nodes of `batch` (request, node), padded to a batch size."""
    size = spec.padded_size(len(batch))
    args = []
    for port, kind in enumerate(spec.inputs):
        column = [_value(requests[r], registers[r], node, port, kind) for r, node in batch]
        zero = np.zeros(kind.shape, kind.dtype)
        args.append(torch.as_tensor(np.stack(column + [zero] * (size - len(batch)))))
    with torch.inference_mode():
        out = cell(*args)
    out = (out,) if isinstance(out, torch.Tensor) else out
    for row, (r, node) in enumerate(batch):
        plan = requests[r].plan
        for port in range(len(spec.outputs)):
            registers[r][int(plan.outputs[node, port])] = out[port][row].clone()
        for name, port in plan.copies.get(node, ()):
            results[r][name] = out[port][row].numpy().copy()


def _value(unfolded: Unfolded, registers: dict[int, torch.Tensor], node: int, port: int, kind) -> np.ndarray:
    ref = int(unfolded.plan.inputs[node, port])
    if ref == ZERO_REF:
        return np.zeros(kind.shape, kind.dtype)
    if ref <= -2:
        return unfolded.externals[kind][-2 - ref]
    return registers[ref].numpy()
