"""The body of a batched task on tensors, the same on every backend: a task message resolved to
index tensors over the arenas, every step of it at once (`resolve`), then gather, compute, scatter (`run_task`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from batchmaker.common.slots import SCRATCH_SLOT, ZERO_SLOT
from batchmaker.common.task import InlineValues, RemoteRows, TaskMessage, repeats


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
    carried: tuple[tuple[int, int], ...] = ()  # (input, output): rows taken from the previous step's results
    kept: frozenset[int] = frozenset()  # outputs not written to the arena: the next step carries them


PeerArenas = dict[tuple[int, int], torch.Tensor]  # (worker id, arena id) -> tensor


def resolve(
    task: TaskMessage, tensors: list[torch.Tensor], cells: list[nn.Module], peers: PeerArenas, carry: bool = False
) -> list[IssuedTask]:
    """Turn a task message into tensors, a step each: the issuer's share of the work, done off the stream.

    A multi-step task is resolved once for all its steps: every slot list of every step (a list
    steps share, once) becomes one index tensor, split into a view per list, and each input's
    inline values one tensor of rows, split per step, so a step costs the issuer little more than a
    lone task's bookkeeping. With `carry`, steps carry state in the cell's results (`carry_state`):
    for a stream that runs the steps with `run_steps`.
    """
    steps = task.steps()
    arrays = list({id(array): array for step in steps for array in slot_arrays(step)}.values())  # shared ones once
    sizes = [len(array) for array in arrays]
    views = torch.from_numpy(np.concatenate(arrays)).split(sizes) if arrays else ()
    view_of = {id(array): view for array, view in zip(arrays, views)}  # a list repeated has one view
    inline = [_inline_per_step(steps, port, tensors) for port in range(len(task.inputs))]
    cell = cells[task.cell_index]

    def index(slots: np.ndarray) -> torch.Tensor:
        return view_of[id(slots)]

    made: dict[tuple[int, int], InputRows] = {}  # an input of arena rows alone, by port and slot list: once

    def input_rows(
        step: int,
        port: int,
        arena_id: int,
        slots: np.ndarray,
        segments: np.ndarray | None,
        remote: list[RemoteRows] | None,
        values: InlineValues | None,
    ) -> InputRows:  # a TaskInput's fields
        if segments is None and remote is None and values is None:
            key = (port, id(slots))
            rows = made.get(key)
            if rows is None:
                rows = made[key] = InputRows(tensors[arena_id], index(slots), None, [], None)
            return rows
        return InputRows(
            tensors[arena_id],
            index(slots),
            None if segments is None else index(segments),
            [
                RemoteInput(peers[(peer, peer_arena)], index(rows), index(at))
                for peer, peer_arena, rows, at in remote or ()
            ],
            None if values is None else Inline(index(values[0]), inline[port][step], _every_row(values[0], len(slots))),
        )

    outputs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # a list of outputs steps share, once

    def outputs_of(lists: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        resolved = outputs.get(id(lists))
        if resolved is None:
            resolved = outputs[id(lists)] = [(tensors[arena], index(slots)) for arena, slots in lists]
        return resolved

    issued = [
        IssuedTask(
            step.task_id,
            cell,
            [input_rows(number, port, *entry) for port, entry in enumerate(step.inputs)],
            outputs_of(step.outputs),
            [TensorCopy(tensors[a], index(s), tensors[io], index(io_slots)) for a, s, io, io_slots in step.downloads],
        )
        for number, step in enumerate(steps)
    ]
    if carry:
        carry_state(steps, issued)
    return issued


def carry_state(steps: list[TaskMessage], issued: list[IssuedTask]) -> None:
    """Let each step that repeats the one before it (common.task.repeats) take the inputs that step
    writes in place from its results, instead of a scatter to the arena and a gather back.

    An input is carried from an output of the same arena whose rows it reads in the same order
    (a padding row reads the zero row where the output's padding row writes the scratch row: rows
    of a batch are independent, so a padding row may carry anything). The output is then not
    written until the last step, unless the step has downloads, which read the arena: other inputs of
    that arena must read none of its rows, and each output is carried to one input at most."""
    plans: dict[int, tuple[tuple[tuple[int, int], ...], frozenset[int]]] = {}
    for number in range(1, len(steps)):
        previous, step = steps[number - 1], steps[number]
        if not repeats(previous, step):
            continue
        plan = plans.get(id(step.outputs))
        if plan is None:
            plan = plans[id(step.outputs)] = _carry_plan(step)
        carried, kept = plan
        if carried:
            issued[number].carried = carried
            if not previous.downloads:
                issued[number - 1].kept = kept


def _carry_plan(step: TaskMessage) -> tuple[tuple[tuple[int, int], ...], frozenset[int]]:
    """For a step whose inputs are the slots of the step before it: which inputs its outputs carry."""
    carried: list[tuple[int, int]] = []
    for port, entry in enumerate(step.inputs):
        for output, (arena, slots) in enumerate(step.outputs):
            if arena == entry.arena and output not in (o for _, o in carried) and _same_rows(entry.slots, slots):
                carried.append((port, output))
                break
    carried_inputs = {port for port, _ in carried}
    for port, entry in enumerate(step.inputs):  # anything else reading an output's rows needs them in the arena
        if port in carried_inputs:
            continue
        for output, (arena, slots) in enumerate(step.outputs):
            if arena == entry.arena and np.isin(entry.slots, slots[slots != SCRATCH_SLOT]).any():
                return (), frozenset()
    return tuple(carried), frozenset(output for _, output in carried)


def _same_rows(reads: np.ndarray, writes: np.ndarray) -> bool:
    return len(reads) == len(writes) and bool(((reads == writes) | ((writes == SCRATCH_SLOT) & (reads == ZERO_SLOT))).all())


def _every_row(positions: np.ndarray, rows: int) -> bool:
    return len(positions) == rows and bool((positions == np.arange(rows)).all())


def slot_arrays(step: TaskMessage) -> Iterator[np.ndarray]:
    """Every slot list of a step, for `resolve` to make into one index tensor."""
    for _, slots, segments, remote, values in step.inputs:
        yield slots
        if segments is not None:
            yield segments
        for _, _, rows, at in remote or ():
            yield rows
            yield at
        if values is not None:
            yield values[0]
    for _, slots in step.outputs:
        yield slots
    for _, slots, _, io_slots in step.downloads:
        yield slots
        yield io_slots


def _inline_per_step(steps: list[TaskMessage], port: int, tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Input `port`'s inline rows of every step (None where a step has none), made from one buffer."""
    values = [step.inputs[port][4] for step in steps]  # a TaskInput, or a plain tuple of its fields
    present = [entry for entry in values if entry is not None]
    if not present:
        return [None] * len(steps)
    arena = tensors[steps[0].inputs[port][0]]
    row_bytes = arena[0].nbytes
    for positions, data in present:  # one buffer for all steps: a step's rows must not run into the next
        if len(data) != len(positions) * row_bytes:
            raise ValueError(f"input {port} has {len(data)} bytes of inline values for {len(positions)} rows")
    split = iter(inline_rows(b"".join(data for _, data in present), arena).split([len(at) for at, _ in present]))
    return [None if entry is None else next(split) for entry in values]


def inline_rows(data: bytes, arena: torch.Tensor) -> torch.Tensor:
    """External values sent in the task, as rows shaped like the arena's (on the host)."""
    return torch.frombuffer(bytearray(data), dtype=arena.dtype).view(-1, *arena.shape[1:])


def run_task(task: IssuedTask) -> None:
    """Gather, compute, scatter: the body of every task on every backend.

    Every tensor must already be on the arenas' device: nothing here moves data between
    devices, so a misplaced index fails loudly instead of costing a hidden copy.
    """
    scatter(task, task.cell(*gather(task.inputs)))


def run_steps(steps: list[IssuedTask]) -> None:
    """A task's steps in order, each taking its carried inputs from the results of the step before."""
    results: tuple[torch.Tensor, ...] = ()
    for step in steps:
        carried = {port: results[output] for port, output in step.carried}
        produced = step.cell(*gather(step.inputs, carried=carried))
        results = (produced,) if isinstance(produced, torch.Tensor) else tuple(produced)
        scatter(step, results)


def gather(
    inputs: list[InputRows], into: list[torch.Tensor] | None = None, carried: dict[int, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The cell's arguments: each input's rows (own arena, then peers' and inline rows over them),
    each followed by its segments if ragged. With `into`, the rows of input i are written into
    `into[i]` (a captured cell's static input, which must keep its size and address) instead; with
    `carried`, input i's rows are `carried[i]` where given (a result of the step before)."""
    batch = []
    for i, (arena, slots, segments, remote, inline) in enumerate(inputs):
        if carried and i in carried:
            rows = carried[i]
        elif into is None and inline is not None and inline.whole and not remote:
            batch.append(inline.rows)
            continue
        elif into is None:
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
    for output, ((arena, slots), value) in enumerate(zip(task.outputs, results)):
        if output not in task.kept:
            arena.index_copy_(0, slots, value)
    for src, src_slots, dst, dst_slots in task.downloads:
        dst.index_copy_(0, dst_slots, src.index_select(0, src_slots))
