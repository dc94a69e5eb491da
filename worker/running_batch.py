"""The running batch: the requests a worker holds, run step by step, requests joining and leaving between steps.

Every step the worker decides what runs next, as the paper's Algorithm 1: it picks a cell type (one with a full
batch of ready nodes, else any with ready nodes, the higher priority first) and runs up to its largest batch of
ready nodes of that type, from every request held: those of requests of a higher `priority` first, then the
oldest, and a request passed over `STARVED` steps in a row for higher-priority ones before every other (the
protocol's Priority, as the batching core's tasks take their lanes). A request admitted between two steps joins
the next step of its cell types, the requests of a message together (`admit_many`: an array operation a column
for them all, not one per request); a request whose last node ran, or whose model saw its end in a watched value (a
decoder's EOS), leaves at once with its results. The decision costs a few array operations over the nodes held,
whatever the number of requests: the nodes of every request held are rows of flat arrays (their cell type, how
many nodes of their request must run first, the arena rows each input reads and each output writes), so Python
runs per step, and per node only for the nodes whose outputs the host reads (results, watched values). When the
chosen nodes go on as chains (an LSTM's steps), the step runs several waves of them at once (worker.chain_runs,
worker.step_runner), so that this cost is paid once for them all.

A request's values live in rows of the running batch's own arenas, one per kind of value: its registers (a plan
reuses them: common.plan) and its external values (copied in when it joins; the rows of the requests joining
together taken, and their values copied, a kind at a time: worker.joining). A node is ready once every node of its
request at a smaller depth has run (`need`); a step gathers its inputs before it writes its outputs, which is all
the plan's register reuse asks for.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.plan import Plan, Unfolded
from batchmaker.worker.batched_task import KernelClock
from batchmaker.worker.cell_types import CellTypes
from batchmaker.worker.chain_runs import DEFAULT_BOUNDS, ChainBounds
from batchmaker.worker.joining import Copies, Joining, Observe, Rows, fitting, take_rows
from batchmaker.worker.node_columns import Nodes, Template, joined
from batchmaker.worker.step_runner import StepRunner

STARVED = 8  # steps a request may be passed over for higher-priority ones before it goes first


@dataclass
class Held:
    """One request in the running batch: its plan, its arena rows (per kind) and the results read so far."""

    key: Any
    unfolded: Unfolded
    observe: Observe | None
    rows: dict[ValueKind, np.ndarray]  # every arena row it holds, per kind
    priority: int
    results: dict[str, np.ndarray] = field(default_factory=dict)
    error: str | None = None  # why it ended before its results were all in (its cell or its model failed)


class Finished(NamedTuple):
    """A request that left the running batch: with all its results, or with the error that ended it."""

    key: Any
    unfolded: Unfolded
    results: dict[str, np.ndarray]
    error: str | None


class RunningBatch:
    """The requests a worker holds, their nodes' rows and values, and the step that runs the next batch."""

    def __init__(
        self, specs: list[CellTypeSpec], cells: list[nn.Module], kinds: list[ValueKind], rows: int,
        device: str = "cpu", clock: KernelClock | None = None, chains: ChainBounds = DEFAULT_BOUNDS,
    ):  # fmt: skip
        """`rows` per kind of value, on `device` (the cells' own); `clock`, if given, times the cells' calls;
        `chains`: how long a chain run may be."""
        self.types = CellTypes(rows, torch.device(device))
        self.types.add(specs, cells, kinds)
        self.nodes = Nodes(*self.types.widths)
        self._runner = StepRunner(self.types, self.nodes, torch.device(device), clock)
        self.chains = chains
        self._wave_s: dict[int, float] = {}  # per cell type: the measured seconds of a wave, a moving average
        self._chaining: set[int] = set()  # the cell types some request held so far runs chains of
        self._held: list[Held | None] = []
        self._done = np.zeros(0, np.int64)  # nodes run, per request slot
        self._total = np.zeros(0, np.int64)  # nodes, per request slot
        self._passes = np.zeros(0, np.int64)  # steps in a row that passed it over for higher priorities, per slot
        self._prioritized = 0  # requests held with a priority other than 0: steps order their nodes by it
        self._free_slots: list[int] = []
        self._slot_of: dict[Any, int] = {}
        self._read = np.zeros(0, np.int64)  # the request slots whose values the last step read, a slot a node
        self.steps = 0  # run so far
        self._ran: collections.Counter[tuple[int, int]] = collections.Counter()  # steps by (cell, batch) since taken
        self.dead = 0  # rows of the node arrays whose nodes ran or were dropped (until the next compaction)

    @property
    def requests(self) -> int:
        return len(self._slot_of)

    def get(self, key: Any) -> Held:
        return self._held[self._slot_of[key]]

    def updated(self) -> list[Any]:
        """The requests still held whose results or watched values the last step read (their outputs grew)."""
        read = np.unique(self._read).tolist()
        return [held.key for slot in read if (held := self._held[slot]) is not None]

    def add_cell_types(self, specs: list[CellTypeSpec], cells: list[nn.Module], kinds: list[ValueKind]) -> None:
        """A version the manager loaded while the batch runs: its requests may join from now on."""
        self.types.add(specs, cells, kinds)
        self.nodes.widen(*self.types.widths)

    # -- joining ---------------------------------------------------------------------------------
    def fitting(self, requests: Iterable[Unfolded]) -> int:
        """How many of the planned requests, taken in order, the arenas have rows for together (their registers
        and external values): those may be admitted at once. Stops at the first that does not fit."""
        return fitting(self.types, requests)

    def admit_many(self, joining: Sequence[Joining]) -> None:
        """Hold planned requests, all at once (callers admit only what `fitting` says fits): their values get rows,
        their nodes join the next steps of their cell types. An array operation a column for them all, so that
        joining costs per message, not per request."""
        if not joining:
            return
        templates = [self._template(request.unfolded.plan) for request in joining]
        rows, held_rows, copies = take_rows(self.types, joining, templates)
        self._copy_in(copies)
        slots = self._slots(len(joining))
        self.nodes.append(templates, slots, [request.priority for request in joining], rows)
        for request, template, slot, held in zip(joining, templates, slots, held_rows):
            self._held[slot] = Held(request.key, request.unfolded, request.observe, held, request.priority)
            self._slot_of[request.key] = slot
            self._chaining |= template.chaining
            self._prioritized += request.priority != 0
            self._done[slot] = self._passes[slot] = 0
            self._total[slot] = template.columns.shape[1]

    def _template(self, plan: Plan) -> Template:
        """What the plan's nodes hold whatever the request, in this batch's columns: made once per plan."""
        template = plan.cache.get(self.types.layout)
        if template is None:
            widths = self.nodes.inputs.shape[1], self.nodes.outputs.shape[1]
            template = Template.of(plan, self.types.specs, self.types.index, self.types.kind_index, *widths)
            plan.cache[self.types.layout] = template
        return template

    def _copy_in(self, copies: Copies) -> None:
        """External values to their rows: one index per kind for all the requests joining."""
        for kind, copied in copies.items():
            rows, values = joined([rows for rows, _ in copied]), joined([values for _, values in copied])
            self.types.arenas[kind][self._runner.tensor(rows)] = self._runner.tensor(np.ascontiguousarray(values))

    def _slots(self, count: int) -> list[int]:
        """Request slots for `count` requests: those given back last first; when too few are, as many more again as
        there are (the per-slot arrays grow once in a while, not at every request)."""
        if len(self._free_slots) < count:
            held = len(self._held)
            more = max(count, held)
            self._held.extend([None] * more)
            self._done, self._total, self._passes = (
                np.concatenate([column, np.zeros(more, np.int64)]) for column in (self._done, self._total, self._passes)
            )
            self._free_slots[:0] = range(held + more - 1, held - 1, -1)  # below those given back: taken after them
        return [self._free_slots.pop() for _ in range(count)]

    def remove(self, key: Any) -> bool:
        """Let a request go before its end (cancelled, or its deadline passed): its nodes never run."""
        slot = self._slot_of.get(key)
        if slot is None:
            return False
        self._leave([slot])
        return True

    # -- running ---------------------------------------------------------------------------------
    def step(self) -> list[Finished]:
        """Run the next batch, several waves of it when its nodes go on as chains (worker.chain_runs); the requests
        it finished (or ended with an error). Nothing runs when nothing is held."""
        nodes = self.nodes
        count = nodes.count
        ready = nodes.pending[:count] & (self._done[nodes.request[:count]] >= nodes.need[:count])
        counts = np.bincount(nodes.cell[:count][ready], minlength=len(self.types.specs))
        if not counts.any():
            return []
        cell = self._choose(counts)
        chosen = np.flatnonzero(ready & (nodes.cell[:count] == cell))
        size = self.types.specs[cell].max_batch
        if len(chosen) > size:
            chosen = self._first(chosen, size)
        chaining = cell in self._chaining
        waves, code = self._runner.waves(chosen, self._chain_steps(cell)) if chaining else ([chosen], 0)
        run = np.concatenate(waves) if len(waves) > 1 else chosen
        ran = np.bincount(nodes.request[run], minlength=len(self._done))  # nodes run, per request slot
        touched = np.flatnonzero(ran)
        if self._prioritized:
            self._passes[touched] = 0  # a request that runs in this step starts counting its passes again
        self.steps += len(waves)
        for rows in waves:
            self._ran[cell, len(rows)] += 1
        copied = [np.flatnonzero(nodes.copied[rows]) for rows in waves]  # the positions of the outputs the host reads
        self._read = np.zeros(0, np.int64)
        began = time.perf_counter() if chaining else 0.0
        try:
            outputs = self._runner.run(cell, waves, code, copied)
        except Exception as exc:  # the cell failed on this batch: its requests end with the error, the rest go on
            for slot in touched.tolist():
                self._held[slot].error = f"{self.types.specs[cell].key} failed: {type(exc).__name__}: {exc}"
            return self._leave(touched.tolist(), finished=True)
        if chaining:
            wave_s = (time.perf_counter() - began) / len(waves)
            self._wave_s[cell] = wave_s if cell not in self._wave_s else 0.8 * self._wave_s[cell] + 0.2 * wave_s
        ended = self._read_copies([rows[at] for rows, at in zip(waves, copied) if len(at)], outputs)
        nodes.pending[run] = False
        self.dead += len(run)
        self._done += ran
        ended += touched[self._done[touched] == self._total[touched]].tolist()
        return self._leave(sorted(set(ended)), finished=True)

    def take_ran(self) -> dict[str, dict[int, int]]:
        """The steps run since the last call: per cell type, how many at each batch size."""
        ran: dict[str, dict[int, int]] = {}
        for (cell, size), steps in self._ran.items():
            ran.setdefault(self.types.specs[cell].key, {})[size] = steps
        self._ran.clear()
        return ran

    def _choose(self, counts: np.ndarray) -> int:
        """Algorithm 1's choice: a cell type with a full batch ready if any, else any with nodes ready; the
        higher priority first, then the lower index."""
        ready = [(cell, count) for cell, count in enumerate(counts.tolist()) if count]  # a few cell types: Python
        specs = self.types.specs
        full = [cell for cell, count in ready if count >= specs[cell].max_batch]
        return max(full or [cell for cell, _ in ready], key=lambda cell: specs[cell].priority)

    def _chain_steps(self, cell: int) -> int:
        """The most waves a chain run of `cell` may take: as many as fit in the join delay at the waves' measured
        cost, within `max_steps` (1 until a wave of it was measured)."""
        wave_s = self._wave_s.get(cell)
        if wave_s is None:
            return 1
        return max(1, min(self.chains.max_steps, int(self.chains.max_join_delay_us * 1e-6 / max(wave_s, 1e-9))))

    def _first(self, ready: np.ndarray, size: int) -> np.ndarray:
        """The `size` nodes of `ready` (ascending: oldest request first) that run: by priority when any request
        held has one, a request passed over `STARVED` times first; the result ascending."""
        if not self._prioritized:
            return ready[:size]
        nodes = self.nodes
        requests, priority = nodes.request[ready], nodes.priority[ready]
        order = np.lexsort((ready, -priority, self._passes[requests] < STARVED))
        chosen, left = np.sort(ready[order[:size]]), order[size:]
        self._passes[requests[left][priority[left] < priority[order[:size]].max()]] += 1
        return chosen

    def _read_copies(self, copied_rows: list[np.ndarray], outputs: list[tuple[torch.Tensor, ...]]) -> list[int]:
        """The results and watched values among the outputs a step read (per wave with any: the node rows whose
        outputs the host reads, and those outputs) to their requests, in the order the nodes ran (Python per copied
        node only), in one copy to the host per output; the request slots whose model saw their end in a watched
        value, whose later nodes' values are not read."""
        if not copied_rows:
            return []
        copied = joined(copied_rows)
        requests = self.nodes.request[copied]
        self._read = requests
        values = [torch.cat(port).cpu().numpy() if len(port) > 1 else port[0].cpu().numpy() for port in zip(*outputs)]
        ended: list[int] = []
        for row, (node, slot) in enumerate(zip(self.nodes.local[copied].tolist(), requests.tolist())):
            if slot in ended:
                continue  # its end was seen at an earlier wave of this run: what its later nodes made is not read
            held = self._held[slot]
            for key, port in held.unfolded.plan.copies[node]:
                value = values[port][row]
                if type(key) is str:
                    held.results[key] = value
                    continue
                try:
                    done = held.observe(held.unfolded, key, value)
                except Exception as exc:  # a model's bug ends its request, never the batch
                    held.error, done = f"{type(exc).__name__} in observe: {exc}", True
                if done and slot not in ended:
                    ended.append(slot)
        return ended

    def _leave(self, slots: list[int], finished: bool = False) -> list[Finished]:
        """Requests give back their rows and slots, their nodes left to run dropped; they go at the next
        compaction. Returns them (`finished`: they are complete)."""
        if not slots:
            return []
        unfinished = [slot for slot in slots if self._done[slot] < self._total[slot]]
        gone = []
        rows: dict[ValueKind, list[Rows]] = {}
        for slot in slots:
            held = self._held[slot]
            self._held[slot] = None
            del self._slot_of[held.key]
            self._free_slots.append(slot)
            self._prioritized -= held.priority != 0
            for kind, taken in held.rows.items():
                rows.setdefault(kind, []).append(taken)
            gone.append(Finished(held.key, held.unfolded, held.results, held.error))
        for kind, given in rows.items():  # one give per kind for all the requests leaving
            self.types.free[kind].give(np.concatenate(given) if len(given) > 1 else given[0])
        nodes = self.nodes
        if unfinished:
            dropped = nodes.pending[: nodes.count] & np.isin(nodes.request[: nodes.count], unfinished)
            nodes.pending[: nodes.count] &= ~dropped
            self.dead += int(dropped.sum())
        if self.dead >= max(nodes.count - self.dead, 256):  # most rows are of nodes that ran or were dropped
            nodes.keep(np.flatnonzero(nodes.pending[: nodes.count]))
            self.dead = 0
        return gone if finished else []
