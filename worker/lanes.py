"""The body of a lane task on tensors, the same on every backend (common.lanes, common.task).

A lane task runs `steps[i]` steps of each of its lanes, lanes in descending order of steps, so the
lanes still going at step j are the first `batch[j]`: those that end drop off the end of the batch,
as in a packed sequence. Its inputs are read once: every input's rows of the first step gathered
at the start, a sequence's rows of the later steps sent packed; from then on a state is the value
its source output had at the step before, carried as a tensor, never written to the arena and read
back, and a constant keeps its first rows.
Each output's last value per lane is written to its row once, at the end, and the rows the host
must see are copied from the steps' results in one index per output. So a task costs a fixed
number of operations beyond its cells, whatever its number of steps or lanes, and one loop
iteration of Python per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from batchmaker.common.lanes import SEQUENCE, STATE
from batchmaker.common.task import LaneTaskMessage, TaskInput
from batchmaker.worker.batched_task import Inline, InputRows, PeerArenas, RemoteInput, gather, inline_rows


class LaneRows(NamedTuple):
    """One cell input of a lane task, resolved: its rows of the first step (`first`, a row per lane) and
    a sequence's rows of the later steps, packed step after step (`data`)."""

    mode: int
    source: int
    first: InputRows
    data: torch.Tensor | None


class StepRows(NamedTuple):
    """Rows of output `port` of every step (packed step after step) that a download takes, by `entries`,
    and where they go: an io arena and its rows, in the backend's own form."""

    port: int
    entries: torch.Tensor
    io: Any
    io_slots: Any


@dataclass
class LaneTask:
    """A lane task with its arenas and rows resolved to tensors, ready for the stream."""

    task_id: int
    cell: nn.Module
    batch: list[int]  # lanes running each step, descending
    offsets: list[int]  # where each step's rows start among the packed rows of every step
    inputs: list[LaneRows]
    outputs: list[tuple[torch.Tensor, torch.Tensor]]  # per output: (arena, a row per lane for its last value)
    downloads: list[StepRows]


def step_batches(steps: np.ndarray) -> tuple[list[int], list[int]]:
    """For lanes running `steps` steps each (descending): the lanes running at each step, and where each
    step's rows start when every step's rows are packed one step after the other."""
    if not len(steps):
        return [], []
    if steps[-1] < 1 or (np.diff(steps) > 0).any():
        raise ValueError(f"a lane task's steps must be positive and descending, got {steps.tolist()}")
    batch = np.searchsorted(-steps, -np.arange(int(steps[0])), side="left")
    offsets = np.cumsum(batch) - batch
    return batch.tolist(), offsets.tolist()


def check_sequence(mode: int, rows: torch.Tensor | None, later: int) -> None:
    """A sequence input holds a row for each of the later steps' lanes, `later` in all; any other none."""
    held = 0 if rows is None else rows.shape[0]
    if held != (later if mode == SEQUENCE else 0):
        what = "a sequence input" if mode == SEQUENCE else "an input that is not a sequence"
        raise ValueError(f"{what} of {held} rows for {later} rows of later steps")


def run_lanes(task: LaneTask) -> list[torch.Tensor]:
    """Run every step of a lane task: its results written to their rows, and for each download the rows
    it takes, for the backend to copy to the io arena (in the task's order of downloads).

    Every tensor must already be on the arenas' device (nothing here moves data between devices)."""
    inputs, batch = task.inputs, task.batch
    values = gather([entry.first for entry in inputs])
    carried = [(port, entry.source) for port, entry in enumerate(inputs) if entry.mode == STATE]
    sequences = [(port, entry.data) for port, entry in enumerate(inputs) if entry.mode == SEQUENCE]
    later = batch[0] if batch else 0  # where the later steps' rows start among the packed rows
    per_step: dict[int, list[torch.Tensor]] = {download.port: [] for download in task.downloads}
    ends: list[list[torch.Tensor]] = [[] for _ in task.outputs]  # per output, the last values of lanes as they end
    for step, size in enumerate(batch):
        if step:
            start = task.offsets[step] - later
            for port, data in sequences:
                values[port] = data[start : start + size]
        produced = task.cell(*[value if value.shape[0] == size else value[:size] for value in values])
        results = (produced,) if isinstance(produced, torch.Tensor) else tuple(produced)
        for port, source in carried:
            values[port] = results[source]
        for port, rows in per_step.items():
            rows.append(results[port])
        following = batch[step + 1] if step + 1 < len(batch) else 0
        if following < size:  # lanes end at this step: rows `following` to `size` are their last values
            for output, pieces in enumerate(ends):
                value = results[output]
                pieces.append(value if following == 0 else value.narrow(0, following, size - following))
    for (arena, rows), pieces in zip(task.outputs, ends):  # lanes that end last come first
        arena.index_copy_(0, rows, pieces[0] if len(pieces) == 1 else torch.cat(pieces[::-1]))
    taken = []
    for port, entries, _, _ in task.downloads:
        rows = per_step[port]
        taken.append((rows[0] if len(rows) == 1 else torch.cat(rows)).index_select(0, entries))
    return taken


def resolve_lanes(
    task: LaneTaskMessage, tensors: list[torch.Tensor], cells: list[nn.Module], peers: PeerArenas
) -> LaneTask:
    """A lane task message on host tensors (the CPU backend's arenas): the issuer's share of the work.

    Every index array of the task becomes one tensor, viewed per array."""
    arrays = [array for entry in task.inputs for array in _input_arrays(entry.first)]
    arrays += [slots for _, slots in task.outputs]
    arrays += [array for _, entries, _, io_slots in task.downloads for array in (entries, io_slots)]
    views = iter(torch.from_numpy(np.concatenate(arrays)).split([len(array) for array in arrays]) if arrays else ())
    later = int(task.steps.sum()) - len(task.steps)
    inputs = []
    for mode, source, arena, first, data in task.inputs:
        sequence = inline_rows(data, _arena(tensors, arena)) if data else None
        check_sequence(mode, sequence, later)
        inputs.append(LaneRows(mode, source, _input_rows(first, tensors, peers, views), sequence))
    outputs = [(tensors[arena], next(views)) for arena, _ in task.outputs]
    downloads = [StepRows(port, next(views), tensors[io], next(views)) for port, _, io, _ in task.downloads]
    batch, offsets = step_batches(task.steps)
    return LaneTask(task.task_id, cells[task.cell_index], batch, offsets, inputs, outputs, downloads)


def _input_arrays(entry: TaskInput) -> list[np.ndarray]:
    """A first step's index arrays, in the order `_input_rows` takes their views."""
    arrays = [entry.slots]
    for _, _, rows, at in entry.remote or ():
        arrays += [rows, at]
    if entry.values is not None:
        arrays.append(entry.values.positions)
    return arrays


def _input_rows(entry: TaskInput, tensors: list[torch.Tensor], peers: PeerArenas, views: Iterator[torch.Tensor]) -> InputRows:
    slots = next(views)
    remote = [RemoteInput(peers[(peer, arena)], next(views), next(views)) for peer, arena, _, _ in entry.remote or ()]
    inline = None
    if entry.values is not None:
        positions, data = entry.values
        whole = len(positions) == len(entry.slots) and bool((positions == np.arange(len(positions))).all())
        inline = Inline(next(views), inline_rows(data, tensors[entry.arena]), whole)
    return InputRows(_arena(tensors, entry.arena), slots, None, remote, inline)


def _arena(tensors: list[torch.Tensor], arena_id: int) -> torch.Tensor:
    if not 0 <= arena_id < len(tensors):
        raise KeyError(f"no arena {arena_id} on this worker")
    return tensors[arena_id]
