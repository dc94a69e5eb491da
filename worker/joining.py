"""Rows for requests joining a running batch together (worker.running_batch): how many of them the arenas have
room for, and one take of rows per kind of value for them all, laid out as their plans' templates say
(worker.node_columns), so that joining costs array operations per kind, not per request."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from batchmaker.common.graph import ValueKind
from batchmaker.common.plan import Unfolded
from batchmaker.common.slots import ZERO_SLOT
from batchmaker.worker.cell_types import CellTypes
from batchmaker.worker.node_columns import JoiningRows, Template

Rows = np.ndarray  # arena rows, int64
Observe = Callable[[Unfolded, int, np.ndarray], bool]  # a model's `observe`: True once the request is complete
ZERO_ROW = np.full(1, ZERO_SLOT, np.int64)  # first among a joining request's rows (worker.node_columns)
Copies = dict[ValueKind, list[tuple[Rows, np.ndarray]]]  # per kind: the rows external values go to, and the values


class Joining(NamedTuple):
    """A planned request to admit: `key` names it, `observe` sees its watched values in order."""

    key: Any
    unfolded: Unfolded
    observe: Observe | None = None
    priority: int = 0


class Taken(NamedTuple):
    """The rows taken for requests joining: those their nodes read and write (`rows`), every row each holds per kind
    (given back when it leaves), and their external values with the rows they go to."""

    rows: JoiningRows
    held: list[dict[ValueKind, Rows]]
    copies: Copies


def wanted(unfolded: Unfolded) -> Iterator[tuple[ValueKind, int]]:
    """The rows a request takes, per kind: its registers', then its external values'."""
    for kind, registers in unfolded.plan.register_groups.items():
        yield kind, len(registers)
    for kind, values in unfolded.externals.items():
        yield kind, len(values)


def fitting(types: CellTypes, requests: Iterable[Unfolded]) -> int:
    """How many of the planned requests, taken in order, the arenas of `types` have free rows for together."""
    free = {kind: allocator.available for kind, allocator in types.free.items()}
    fit = 0
    for unfolded in requests:
        for kind, count in wanted(unfolded):
            free[kind] -= count
        if min(free.values()) < 0:
            break
        fit += 1
    return fit


def take_rows(types: CellTypes, joining: Sequence[Joining], templates: list[Template]) -> Taken:
    """Rows of `types`' arenas for the requests' registers and external values, one take per kind for them all
    (callers ask `fitting` first and copy the external values in). Python per request and kind, arrays per kind."""
    counts: dict[ValueKind, int] = {}
    for request in joining:
        for kind, count in wanted(request.unfolded):
            counts[kind] = counts.get(kind, 0) + count
    taken = {kind: types.free[kind].take(count) for kind, count in counts.items()}
    used = dict.fromkeys(taken, 0)  # per kind: how many of the rows taken went to the requests so far

    def take(kind: ValueKind, count: int) -> Rows:
        rows = taken[kind][used[kind] : used[kind] + count]
        used[kind] += count
        return rows

    pieces: list[Rows] = []  # every request's rows in turn
    starts, held, size = [], [], 0
    copies: Copies = {}
    bases = []  # (request, kind index, where its values of the kind start after those of its first kind)
    for number, (request, template) in enumerate(zip(joining, templates)):
        unfolded, first = request.unfolded, dict(used)
        groups = unfolded.plan.register_groups
        rows = [ZERO_ROW, *(take(kind, len(groups[kind])) for kind in template.register_kinds)]
        base = 0
        for kind in sorted(unfolded.externals, key=types.kind_index.__getitem__):
            values = unfolded.externals[kind]
            rows.append(take(kind, len(values)))
            copies.setdefault(kind, []).append((rows[-1], values))
            if base:
                bases.append((number, types.kind_index[kind], base))
            base += len(values)
        held.append({kind: taken[kind][first[kind] : used[kind]] for kind in taken if used[kind] > first[kind]})
        starts.append(size)
        size += sum(len(piece) for piece in rows)
        pieces += rows
    external_bases = None
    if bases:
        external_bases = np.zeros((len(joining), len(types.kind_index)), np.int64)
        for number, kind, base in bases:
            external_bases[number, kind] = base
    return Taken(JoiningRows(np.concatenate(pieces), starts, external_bases), held, copies)
