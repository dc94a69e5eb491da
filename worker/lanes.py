"""The body of a lane task on tensors, the same on every backend (common.lanes, common.task).

A lane task runs `steps[i]` steps of each of its lanes, lanes in descending order of steps, so the
lanes still going at step j are the first `batch[j]`: those that end drop off the end of the batch,
as in a packed sequence. Its inputs are read once: every input's rows of the first step gathered at
the start, and a sequence's rows of the later steps, packed step after step, in one gather; from
then on a state is the value its source output had at the step before, carried as a tensor, never
written to the arena and read back, and a constant keeps its first rows (a ragged one, the rows of
the lanes still going). Each output's last value per lane is written to its row once, at the end
(an output read outside the lane at every step: every step's values, in one scatter), and the rows
the host must see are copied from the steps' results in one index per output. So a task costs a
fixed number of operations beyond its cells, whatever its number of steps or lanes, and one loop
iteration of Python per step.

A cell type with a stop (a decoder's EOS, common.graph.Stop) has it applied here, on the device: a lane
whose carried stop output already holds the stop value keeps the values it carried in, so its state
stays as it was and its later tokens are the stop value, with no host sync and no Python per lane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from batchmaker.common.graph import Stop
from batchmaker.common.lanes import SEQUENCE, STATE
from batchmaker.common.task import LaneTaskMessage, TaskInput
from batchmaker.worker.batched_task import (
    InputRows,
    KernelClock,
    PeerArenas,
    arena_of,
    gather,
    index_views,
    inline_rows,
    input_rows,
    slot_arrays,
)


class LaneRows(NamedTuple):
    """One cell input of a lane task, resolved: its rows of the first step (`first`, a row per lane, or
    for a ragged input any number, with `cuts[b]` of them belonging to the first b lanes) and a
    sequence's rows of the later steps, packed step after step (`later`)."""

    mode: int
    source: int
    first: InputRows
    later: InputRows | torch.Tensor | None  # rows to gather, or the rows themselves (sent as values)
    cuts: list[int] | None = None


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
    outputs: list[tuple[torch.Tensor, torch.Tensor]]  # per output: (arena, rows: each lane's last, or its entries')
    every_step: dict[int, torch.Tensor]  # outputs written at every step: which of their rows of every step
    downloads: list[StepRows]
    stop: Stop | None = None


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


def check_lane_task(task: LaneTaskMessage) -> list[list[int] | None]:
    """Check on the host what the rows of a lane task must add up to (a sequence's later rows once they are
    known: `check_later`); returns, per input, the cuts of a ragged one (one with segments,
    `LaneRows.cuts`): its rows of the first b lanes, for every b."""
    lanes, packed = len(task.steps), int(task.steps.sum())
    cuts: list[list[int] | None] = []
    for entry in task.inputs:
        segments = entry.first.segments
        cuts.append(None if segments is None else np.searchsorted(segments, np.arange(lanes + 1)).tolist())
    every = dict(task.every_step)
    for port, (_, slots) in enumerate(task.outputs):
        if len(slots) != (len(every[port]) if port in every else lanes):
            raise ValueError(f"output {port} has {len(slots)} rows for {lanes} lanes or its rows of every step")
        if port in every and len(every[port]) and (every[port].min() < 0 or every[port].max() >= packed):
            raise IndexError(f"output {port} takes rows beyond the {packed} its steps compute")
    return cuts


def check_later(mode: int, rows: int, steps: np.ndarray) -> None:
    """A sequence input holds a row for each of the later steps' lanes; any other none."""
    later = int(steps.sum()) - len(steps)
    if rows != (later if mode == SEQUENCE else 0):
        what = "a sequence input" if mode == SEQUENCE else "an input that is not a sequence"
        raise ValueError(f"{what} of {rows} rows for {later} rows of later steps")


def run_lanes(task: LaneTask, clock: KernelClock | None = None) -> list[torch.Tensor]:
    """Run every step of a lane task: its results written to their rows, and for each download the rows
    it takes, for the backend to copy to the io arena (in the task's order of downloads); `clock`, if
    given, times the cell's calls.

    Every tensor must already be on the arenas' device (nothing here moves data between devices)."""
    inputs, batch = task.inputs, task.batch
    first = [gather([entry.first]) for entry in inputs]  # each input's rows (and a ragged one's segments)
    values = [rows[0] for rows in first]
    later = [
        (port, gather([entry.later])[0] if isinstance(entry.later, InputRows) else entry.later)
        for port, entry in enumerate(inputs)
        if entry.later is not None
    ]
    carried = [(port, entry.source) for port, entry in enumerate(inputs) if entry.mode == STATE]
    stop = task.stop if task.stop is not None and any(source == task.stop.port for _, source in carried) else None
    ragged = [(port, first[port][1], entry.cuts) for port, entry in enumerate(inputs) if entry.cuts is not None]
    kept = {port: [] for port in {*task.every_step, *(download.port for download in task.downloads)}}
    ends: list[list[torch.Tensor]] = [[] for _ in task.outputs]  # per output, the last values of lanes as they end
    lanes = batch[0] if batch else 0
    for step, size in enumerate(batch):
        if step:
            start = task.offsets[step] - lanes
            for port, rows in later:
                values[port] = rows[start : start + size]
        args: list[Any] = [value if value.shape[0] == size else value[:size] for value in values]
        for port, segments, cuts in reversed(ragged):  # a ragged input: the rows of the lanes still going
            cut = cuts[size]
            args[port : port + 1] = [values[port][:cut], segments[:cut]]
        produced = task.cell(*args) if clock is None else clock.call(task.cell, *args)
        results = (produced,) if isinstance(produced, torch.Tensor) else tuple(produced)
        if stop is not None:
            results = _stopped_kept(results, values, carried, stop, size)
        for port, source in carried:
            values[port] = results[source]
        for port, rows in kept.items():
            rows.append(results[port])
        following = batch[step + 1] if step + 1 < len(batch) else 0
        if following < size:  # lanes end at this step: rows `following` to `size` are their last values
            for output, pieces in enumerate(ends):
                value = results[output]
                pieces.append(value if following == 0 else value.narrow(0, following, size - following))
    for output, entries in task.every_step.items():  # first: a lane's last values may overwrite them in place
        arena, rows = task.outputs[output]
        arena.index_copy_(0, rows, _packed(kept[output]).index_select(0, entries))
    for output, ((arena, rows), pieces) in enumerate(zip(task.outputs, ends)):
        if output not in task.every_step:  # lanes that end last come first
            arena.index_copy_(0, rows, pieces[0] if len(pieces) == 1 else torch.cat(pieces[::-1]))
    return [_packed(kept[port]).index_select(0, entries) for port, entries, _, _ in task.downloads]


def _stopped_kept(
    results: tuple[torch.Tensor, ...], values: list[Any], carried: list[tuple[int, int]], stop: Stop, size: int
) -> tuple[torch.Tensor, ...]:
    """A step's results with the rows of lanes already stopped (their carried stop output holds the stop
    value) replaced by the values they carried in: those lanes stand still."""
    carried_in = {source: values[port][:size] for port, source in carried}
    stopped = carried_in[stop.port] == stop.value
    return tuple(
        torch.where(stopped.view(-1, *(1,) * (result.dim() - 1)), carried_in[output], result)
        if output in carried_in
        else result
        for output, result in enumerate(results)
    )


def _packed(rows: list[torch.Tensor]) -> torch.Tensor:
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def resolve_lanes(
    task: LaneTaskMessage, tensors: list[torch.Tensor], cells: list[nn.Module], peers: PeerArenas, stop: Stop | None
) -> LaneTask:
    """A lane task message on host tensors (the CPU backend's arenas): the issuer's share of the work;
    `stop` is its cell type's.

    Every index array of the task becomes one tensor, viewed per array."""
    cuts = check_lane_task(task)
    entries = [entry for lane in task.inputs for entry in (lane.first, lane.later) if isinstance(entry, TaskInput)]
    arrays = [array for entry in entries for array in slot_arrays(entry)]
    arrays += [slots for _, slots in task.outputs] + [entries for _, entries in task.every_step]
    arrays += [array for _, positions, _, io_slots in task.downloads for array in (positions, io_slots)]
    views = index_views(arrays)
    inputs = []
    for (mode, source, arena, first, later), cut in zip(task.inputs, cuts):
        rows = input_rows(first, tensors, peers, views)
        if isinstance(later, TaskInput):
            later_rows: InputRows | torch.Tensor | None = input_rows(later, tensors, peers, views)
            check_later(mode, len(later.slots), task.steps)
        else:
            later_rows = None if later is None else inline_rows(later, arena_of(tensors, arena))
            check_later(mode, 0 if later_rows is None else later_rows.shape[0], task.steps)
        inputs.append(LaneRows(mode, source, rows, later_rows, cut))
    outputs = [(arena_of(tensors, arena), next(views)) for arena, _ in task.outputs]
    every_step = {port: next(views) for port, _ in task.every_step}
    downloads = [StepRows(port, next(views), arena_of(tensors, io), next(views)) for port, _, io, _ in task.downloads]
    batch, offsets = step_batches(task.steps)
    return LaneTask(task.task_id, cells[task.cell_index], batch, offsets, inputs, outputs, every_step, downloads, stop)

