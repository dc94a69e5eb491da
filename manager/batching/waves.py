"""Where a task's nodes sit: consecutive nodes of lanes, the waves of a task's steps, and their rows
among the steps' batches (manager.batching.dispatch resolves them to slots)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np


class Waves(NamedTuple):
    """Consecutive steps of a task, one after the other: step s takes, for each of its `per_step[s]`
    entries i (in order), `counts[i]` nodes from node `first[i]` of the request at `rows[i]`."""

    rows: np.ndarray
    counts: np.ndarray
    first: np.ndarray
    per_step: list[int]

    @staticmethod
    def one(rows: np.ndarray, counts: np.ndarray, first: np.ndarray) -> Waves:
        return Waves(rows, counts, first, [len(rows)])

    @staticmethod
    def joined(steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Waves:
        """Steps given one by one, as (rows, counts, first)."""
        if not steps:
            empty = np.zeros(0, np.int64)
            return Waves(empty, empty, empty, [])
        rows, counts, first = (np.concatenate(column) for column in zip(*steps))
        return Waves(rows, counts, first, [len(step[0]) for step in steps])

    def step_nodes(self) -> list[int]:
        if len(self.per_step) == 1:
            return [int(self.counts.sum())]
        starts = np.cumsum(self.per_step) - self.per_step
        return np.add.reduceat(self.counts, starts).tolist()


class Layout:
    """Where a task's nodes sit among its steps' rows: steps one after the other, each padded to its
    batch size, a node's `position` counting the padding of the steps before it."""

    def __init__(self, step_nodes: list[int], step_sizes: list[int]):
        self.steps = len(step_sizes)
        self.rows = sum(step_sizes)
        self.offset = np.cumsum(step_sizes) - step_sizes  # each step's first row
        if self.steps == 1:
            self.step_of = np.zeros(step_nodes[0], np.int64)
            self.position = np.arange(step_nodes[0])
            self.node_rows: slice | np.ndarray = slice(0, step_nodes[0])  # `position`, as cheap an index as can be
        else:
            padding_before = self.offset - (np.cumsum(step_nodes) - step_nodes)
            self.step_of = np.repeat(np.arange(self.steps), step_nodes)
            self.position = self.node_rows = np.arange(len(self.step_of)) + padding_before[self.step_of]
        self._bounds = list(zip(self.offset.tolist(), np.cumsum(step_sizes).tolist()))

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def one_step(nodes: int, size: int) -> Layout:
        """The layout of one step of `nodes` nodes padded to `size` rows, made once per pair: its arrays
        are shared, read-only."""
        layout = Layout([nodes], [size])
        for array in (layout.offset, layout.step_of, layout.position):
            array.flags.writeable = False
        return layout

    def split(self, rows: np.ndarray) -> list[np.ndarray]:
        """A view of `rows` (a value per row of every step) per step."""
        return [rows] if self.steps == 1 else [rows[start:end] for start, end in self._bounds]

    def by_step(self, nodes: np.ndarray) -> Iterator[tuple[int, slice]]:
        """For ascending node indices, the steps that hold any, with the part of `nodes` in each."""
        bounds = np.searchsorted(self.step_of[nodes], np.arange(self.steps + 1))
        for step in range(self.steps):
            if bounds[step] < bounds[step + 1]:
                yield step, slice(int(bounds[step]), int(bounds[step + 1]))


class Reads:
    """Which slot, on which worker, a node's input register holds when the node's step runs.

    Read before the task's outputs are written to the registers: a register an earlier step of the
    same task writes holds that step's value, at the register's row on this worker; any other holds
    the value it had before the task (a step reads its inputs before it writes, so a register
    written in place by the same step reads its old value)."""

    def __init__(self, registers: dict[str, np.ndarray], out_where: list[np.ndarray], layout: Layout, worker_id: int):
        self._registers = registers
        self._worker_id = worker_id
        self._step_of = layout.step_of
        self._written = None
        if layout.steps > 1 and out_where:
            where = np.concatenate(out_where)
            written, inverse = np.unique(where, return_inverse=True)
            first_step = np.full(len(written), layout.steps, np.int64)
            np.minimum.at(first_step, inverse, np.tile(layout.step_of, len(out_where)))
            self._written = (written, first_step)

    def at(self, where: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The slots and owning workers of registers `where` read by the task's nodes `nodes`."""
        registers = self._registers
        slots, owners = registers["slot"][where], registers["worker"][where]
        if self._written is not None and len(where):
            written, first_step = self._written
            index = np.minimum(np.searchsorted(written, where), len(written) - 1)
            earlier = (written[index] == where) & (first_step[index] < self._step_of[nodes])
            if earlier.any():
                slots[earlier] = registers["write"][where[earlier]]
                owners[earlier] = self._worker_id
        return slots, owners
