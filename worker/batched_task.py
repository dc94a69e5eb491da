"""The body of a batched task on tensors, the same on every backend: a task message resolved to
index tensors over the arenas, every step of it at once (`resolve`), then gather, compute, scatter (`run_task`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from batchmaker.common.task import TaskInput, TaskMessage


class RemoteInput(NamedTuple):
    """Rows another worker produced: its arena (or, with `slots` None, exactly the rows, gathered
    already) and their positions in the batch."""

    source: torch.Tensor
    slots: torch.Tensor | None
    positions: torch.Tensor


class Inline(NamedTuple):
    """A task's external values: their positions in the batch and the rows; `whole` when they are
    every row of the input, in order (a chain's tokens, none of them padding), so that they are the
    input as they are."""

    positions: torch.Tensor
    rows: torch.Tensor
    whole: bool = False


class InputRows(NamedTuple):
    """One cell input resolved to tensors (common.task.TaskInput on the arenas' device)."""

    arena: torch.Tensor
    slots: torch.Tensor
    segments: torch.Tensor | None
    remote: list[RemoteInput]
    inline: Inline | None


class TensorCopy(NamedTuple):
    """A download resolved to tensors (common.task.SlotCopy): device rows copied to io rows."""

    arena: torch.Tensor
    slots: torch.Tensor
    io_arena: torch.Tensor
    io_slots: torch.Tensor


@dataclass
class IssuedTask:
    """A task with its arenas and slot lists resolved to tensors, ready for the stream."""

    task_id: int
    cell: nn.Module
    inputs: list[InputRows]
    outputs: list[tuple[torch.Tensor, torch.Tensor]]
    downloads: list[TensorCopy]


PeerArenas = dict[tuple[int, int], torch.Tensor]  # (worker id, arena id) -> tensor


class KernelClock:
    """Wall seconds the cells' forward calls have taken, summed: how much of its time a worker's kernels are
    busy, which tells a worker starved by the control plane from one saturated by compute. Only a backend
    whose cells run on the calling thread (the CPU) can time them so; a device runs them asynchronously."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def call(self, cell: nn.Module, *args: Any) -> Any:
        """`cell(*args)`, its wall time added to the total: two clock reads a step, whatever its lanes."""
        began = time.perf_counter()
        try:
            return cell(*args)
        finally:
            self.seconds += time.perf_counter() - began


def resolve(
    task: TaskMessage, tensors: list[torch.Tensor], cells: list[nn.Module], peers: PeerArenas
) -> list[IssuedTask]:
    """Turn a task message into tensors, a step each: the issuer's share of the work, done off the stream.

    A multi-step task is resolved once for all its steps: every slot list of every step becomes one
    index tensor, split into a view per list."""
    steps = task.steps()
    arrays = []
    for step in steps:
        arrays += [array for entry in step.inputs for array in slot_arrays(TaskInput(*entry))]
        arrays += [slots for _, slots in step.outputs]
        arrays += [array for _, slots, _, io_slots in step.downloads for array in (slots, io_slots)]
    views = index_views(arrays)
    cell = cells[task.cell_index]
    return [
        IssuedTask(
            step.task_id,
            cell,
            [input_rows(TaskInput(*entry), tensors, peers, views) for entry in step.inputs],
            [(arena_of(tensors, arena), next(views)) for arena, _ in step.outputs],
            [
                TensorCopy(arena_of(tensors, a), next(views), arena_of(tensors, io), next(views))
                for a, _, io, _ in step.downloads
            ],
        )
        for step in steps
    ]


def index_views(arrays: list[np.ndarray]) -> Iterator[torch.Tensor]:
    """Index arrays as tensors: one copy into one tensor, then a view of each, in order."""
    return iter(torch.from_numpy(np.concatenate(arrays)).split([len(array) for array in arrays]) if arrays else ())


def slot_arrays(entry: TaskInput) -> list[np.ndarray]:
    """A task input's index arrays, in the order `input_rows` takes their views."""
    arrays = [entry.slots]
    if entry.segments is not None:
        arrays.append(entry.segments)
    for _, _, rows, at in entry.remote or ():
        arrays += [rows, at]
    if entry.values is not None:
        arrays.append(entry.values[0])
    return arrays


def input_rows(
    entry: TaskInput, tensors: list[torch.Tensor], peers: PeerArenas, views: Iterator[torch.Tensor]
) -> InputRows:
    """A task input on host tensors, its index arrays the next of `views` (`slot_arrays`' order)."""
    arena = arena_of(tensors, entry.arena)
    slots = next(views)
    segments = None if entry.segments is None else next(views)
    remote = []
    for peer, peer_arena, _, _ in entry.remote or ():
        if (peer, peer_arena) not in peers:
            raise KeyError(f"arena {peer_arena} of worker {peer} is not open here")
        remote.append(RemoteInput(peers[(peer, peer_arena)], next(views), next(views)))
    inline = None
    if entry.values is not None:
        positions, data = entry.values
        rows = inline_rows(data, arena)
        if len(rows) != len(positions) or len(data) != rows[:1].nbytes * len(rows):
            raise ValueError(f"{len(data)} bytes of inline values for {len(positions)} rows of {arena[0].nbytes} bytes")
        whole = len(positions) == len(entry.slots) and bool((positions == np.arange(len(positions))).all())
        inline = Inline(next(views), rows, whole)
    return InputRows(arena, slots, segments, remote, inline)


def arena_of(tensors: list[torch.Tensor], arena_id: int) -> torch.Tensor:
    if not 0 <= arena_id < len(tensors):
        raise KeyError(f"no arena {arena_id} on this worker")
    return tensors[arena_id]


def inline_rows(data: bytes, arena: torch.Tensor) -> torch.Tensor:
    """External values sent in the task, as rows shaped like the arena's (on the host)."""
    return torch.frombuffer(bytearray(data), dtype=arena.dtype).view(-1, *arena.shape[1:])


def run_task(task: IssuedTask, clock: KernelClock | None = None) -> None:
    """Gather, compute, scatter: the body of every task on every backend; `clock`, if given, times the cell.

    Every tensor must already be on the arenas' device: nothing here moves data between
    devices, so a misplaced index fails loudly instead of costing a hidden copy.
    """
    args = gather(task.inputs)
    scatter(task, task.cell(*args) if clock is None else clock.call(task.cell, *args))


def run_steps(steps: list[IssuedTask], clock: KernelClock | None = None) -> None:
    """A task's steps in order."""
    for step in steps:
        run_task(step, clock)


def gather(inputs: list[InputRows], into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The cell's arguments: each input's rows (own arena, then peers' and inline rows over them),
    each followed by its segments if ragged. With `into`, the rows of input i are written into
    `into[i]` (a captured cell's static input, which must keep its size and address) instead."""
    batch = []
    for i, (arena, slots, segments, remote, inline) in enumerate(inputs):
        if into is None and inline is not None and inline.whole and not remote:
            batch.append(inline.rows)
            continue
        if into is None:
            rows = arena.index_select(0, slots)
        else:
            rows = into[i]
            if segments is not None:
                raise ValueError(f"input {i} is ragged; a captured cell takes a fixed number of rows")
            if slots.shape[0] != rows.shape[0]:
                raise ValueError(f"input {i} has {slots.shape[0]} rows; its static input holds {rows.shape[0]}")
            torch.index_select(arena, 0, slots, out=rows)
        for source, source_slots, positions in remote:  # values another worker produced (its task has completed)
            rows.index_copy_(0, positions, source if source_slots is None else source.index_select(0, source_slots))
        if inline is not None:  # the requests' own inputs
            rows.index_copy_(0, inline.positions, inline.rows)
        batch.append(rows)
        if segments is not None:
            batch.append(segments)
    return batch


def scatter(task: IssuedTask, results: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
    """Write the cell's results to their slots, then copy the task's downloads."""
    if isinstance(results, torch.Tensor):
        results = (results,)
    for (arena, slots), value in zip(task.outputs, results):
        arena.index_copy_(0, slots, value)
    for src, src_slots, dst, dst_slots in task.downloads:
        dst.index_copy_(0, dst_slots, src.index_select(0, src_slots))
