"""Plans: a request's cell graph compiled into arrays the manager schedules without a Python object per cell.

A model's unfold function describes one request as a CellGraph (docs/models.md). The manager runs
a *plan* of it instead, built once per graph shape (models cache plans of chains by length):

* **Lanes.** The nodes of one cell type form a lane (the paper's subgraph, the unit queued per cell
  type and pinned to a worker). A lane's nodes are stored contiguously, by depth.
* **Waves.** A node's depth is the longest path to it from a node without producers. The nodes of
  one lane and one depth form a wave: they do not depend on each other, so they run in one task.
  A node may be issued once every node of smaller depth in its request has been issued: on one
  worker the stream is FIFO, so its inputs are computed before it runs. `need[n]` counts the
  request's nodes of smaller depth, so readiness is `issued >= need[n]`, one comparison per lane.
* **Registers.** Values live in per-request registers, one arena row each. A register is reused
  once every reader of its last value has been issued before the new writer (a smaller depth), or
  in place when the writer is the value's only remaining reader (a task gathers its inputs before
  it writes): a chain's recurrent state takes one row per layer and state, overwritten each step.
  Results and watched values are copied to the host by the task that computes them, so they do
  not hold a register either.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchmaker.common.graph import CellGraph, CellTypeSpec, External, NodeOutput, Ragged, ValueKind, Zero, node_sources
from batchmaker.common.lanes import LaneLayout, chain_layout, stacked_after
from batchmaker.common.protocol import INTERNAL, RequestError

ZERO_REF = -1  # an input reading the all-zero row
# An input reading external value e of the port's kind is -2 - e: externals are numbered per kind.


def external_ref(position: int) -> int:
    return -2 - position


@dataclass(frozen=True)
class Plan:
    """A compiled cell graph; immutable, so requests of the same shape share one.

    Arrays are indexed by node in plan order (by lane, then depth). `inputs[n, p]` is a register,
    ZERO_REF or an external reference; a ragged port lists its values in `ragged_refs[s:s+k, p]`
    with s, k = `ragged_start[n]`, `ragged_count[n]`. `copies` maps a node to the outputs the host
    reads: (result name, port) for results, (watch index, port) for watched values.
    """

    lane_cells: tuple[str, ...]  # cell type key of each lane
    lane_bounds: np.ndarray  # [lanes + 1]: lane i holds nodes lane_bounds[i]:lane_bounds[i+1]
    depth: np.ndarray  # [n] int32
    need: np.ndarray  # [n] int32: nodes of the request with a smaller depth
    wave_end: np.ndarray  # [n] int32: one past the last node of this node's wave
    inputs: np.ndarray  # [n, max ports] int32
    outputs: np.ndarray  # [n, max outputs] int32 registers
    ragged_start: np.ndarray  # [n] int32
    ragged_count: np.ndarray  # [n] int32
    ragged_refs: np.ndarray  # [values, max ports] int32 registers
    registers: int  # per-request registers (arena rows), of all kinds
    copies: dict[int, tuple[tuple[str | int, int], ...]]
    has_copies: np.ndarray  # [n] bool
    results: tuple[str, ...]
    watched: int
    padding_need: int | None = None  # for the padded policy: issued nodes once the padding has run
    padded_length: int | None = None
    register_groups: dict[ValueKind, np.ndarray] = field(default_factory=dict)  # the registers of each kind
    lane_layouts: tuple[LaneLayout | None, ...] = ()  # per lane: how a chain's steps read (common.lanes), or None
    cache: dict[Any, Any] = field(default_factory=dict, compare=False)  # forms of the plan the manager derives once

    @property
    def nodes(self) -> int:
        return len(self.depth)


@dataclass
class Unfolded:
    """One request's plan with its own external values (per kind, as arrays) and model state."""

    plan: Plan
    externals: dict[ValueKind, np.ndarray]
    state: Any = None


def _invalid(model: str, problem: str) -> RequestError:
    return RequestError(INTERNAL, f"model {model!r} produced an invalid cell graph: {problem}")


def compile_graph(graph: CellGraph, cell_types: dict[str, CellTypeSpec], model: str) -> Unfolded:
    """Check a cell graph and compile it into a plan with its externals.

    Raises RequestError (INTERNAL) for a graph the model should not have produced."""
    nodes = graph.nodes
    count = len(nodes)
    specs: list[CellTypeSpec] = []
    producers: list[list[int]] = []
    external_kind: dict[int, ValueKind] = {}
    for index, node in enumerate(nodes):
        spec = cell_types.get(node.cell_type)
        if spec is None:
            raise _invalid(model, f"node {index} has unknown cell type {node.cell_type!r}")
        if len(node.inputs) != len(spec.inputs):
            raise _invalid(model, f"node {index} gives {len(node.inputs)} inputs to {spec.key}")
        sources: list[int] = []
        for port, ref in enumerate(node.inputs):
            ragged = type(ref) is Ragged
            if ragged != (port in spec.ragged_inputs):
                raise _invalid(model, f"node {index} input {port}: ragged values go to ragged inputs only")
            refs = ref.refs if ragged else (ref,) if type(ref) is NodeOutput else ()
            for source in refs:
                if not 0 <= source.node < index:
                    raise _invalid(model, f"node {index} reads node {source.node}, not an earlier node")
                outputs = specs[source.node].outputs
                if not 0 <= source.port < len(outputs) or outputs[source.port] != spec.inputs[port]:
                    raise _invalid(model, f"node {index} input {port} has the wrong kind")
                sources.append(source.node)
            if type(ref) is External:
                if not 0 <= ref.index < len(graph.externals):
                    raise _invalid(model, f"node {index} reads external value {ref.index}, which does not exist")
                known = external_kind.setdefault(ref.index, spec.inputs[port])
                if known != spec.inputs[port]:
                    raise _invalid(model, f"external value {ref.index} feeds inputs of different kinds")
            elif not ragged and type(ref) not in (NodeOutput, Zero):
                raise _invalid(model, f"node {index} input {port} is not a value reference")
        for source in node.after:
            if not 0 <= source < index:
                raise _invalid(model, f"node {index} runs after node {source}, not an earlier node")
            sources.append(source)
        specs.append(spec)
        producers.append(sources)
    if not graph.results and not graph.watch:
        raise _invalid(model, "it has neither results nor watched outputs")
    copies: dict[int, list[tuple[str | int, int]]] = collections.defaultdict(list)
    for key, ref in (*graph.results.items(), *enumerate(graph.watch)):
        if not 0 <= ref.node < count or not 0 <= ref.port < len(specs[ref.node].outputs):
            raise _invalid(model, f"{key!r} names output {ref.port} of node {ref.node}, which does not exist")
        copies[ref.node].append((key, ref.port))
    if graph.last_padding is not None and not 0 <= graph.last_padding < count:
        raise _invalid(model, f"its padding ends at node {graph.last_padding}, which does not exist")
    return _Compiler(model, graph, specs, producers, external_kind, copies).unfolded()


class _Compiler:
    """Depths, lanes, waves and registers of a checked graph."""

    def __init__(self, model, graph, specs, producers, external_kind, copies):
        self.model = model
        self.graph = graph
        self.specs: list[CellTypeSpec] = specs
        depth = _depths(producers)
        edges = stacked_after(graph.nodes, depth)  # stacked chains run a layer after the one below
        if edges:
            for node, source in edges:
                producers[node].append(source)
            depth = _depths(producers)
        self.depth = depth
        # Plan order: lanes in order of first appearance, nodes by depth within a lane.
        lane_of: dict[str, int] = {}
        for spec in specs:
            lane_of.setdefault(spec.key, len(lane_of))
        self.lane_cells = tuple(lane_of)
        self.order = sorted(range(len(specs)), key=lambda i: (lane_of[specs[i].key], depth[i], i))
        self.position = [0] * len(specs)
        for position, index in enumerate(self.order):
            self.position[index] = position
        self.lane_of = lane_of
        self.external_kind = external_kind
        self.copies = copies
        self.readers: dict[tuple[int, int], set[int]] = collections.defaultdict(set)  # node output -> its readers
        for index, node in enumerate(graph.nodes):
            for source in node_sources(node.inputs):
                self.readers[(source.node, source.port)].add(index)

    def unfolded(self) -> Unfolded:
        graph, specs, depth, order = self.graph, self.specs, self.depth, self.order
        count = len(specs)
        registers, register_kinds = self._registers()
        ports = max((len(s.inputs) for s in specs), default=0)
        outs = max((len(s.outputs) for s in specs), default=0)
        inputs = np.full((count, ports), ZERO_REF, np.int32)
        outputs = np.zeros((count, outs), np.int32)
        ragged_start = np.zeros(count, np.int32)
        ragged_count = np.zeros(count, np.int32)
        ragged_rows: list[list[int]] = []
        # Externals are numbered per kind in the order nodes (in plan order) read them.
        external_position: dict[int, int] = {}
        per_kind: dict[ValueKind, list[Any]] = {}
        for position, index in enumerate(order):
            node, spec = graph.nodes[index], specs[index]
            outputs[position, : len(spec.outputs)] = registers[index]
            width = None
            for port, ref in enumerate(node.inputs):
                kind_of_ref = type(ref)
                if kind_of_ref is NodeOutput:
                    inputs[position, port] = registers[ref.node][ref.port]
                elif kind_of_ref is External:
                    at = external_position.get(ref.index)
                    if at is None:
                        values = per_kind.setdefault(self.external_kind[ref.index], [])
                        at = external_position[ref.index] = len(values)
                        values.append(graph.externals[ref.index])
                    inputs[position, port] = external_ref(at)
                elif kind_of_ref is Ragged:
                    if width is None:
                        width = len(ref.refs)
                        ragged_start[position] = len(ragged_rows)
                        ragged_count[position] = width
                        ragged_rows.extend([ZERO_REF] * ports for _ in range(width))
                    elif width != len(ref.refs):
                        raise _invalid(self.model, "the ragged inputs of one node differ in length")
                    start = ragged_start[position]
                    for offset, child in enumerate(ref.refs):
                        ragged_rows[start + offset][port] = registers[child.node][child.port]
        depths = np.array([depth[i] for i in order], np.int32)
        lane_bounds = self._lane_bounds(order)
        lanes = [(key, int(end)) for key, end in zip(self.lane_cells, lane_bounds[1:])]
        groups = {
            kind: np.array([r for r, k in enumerate(register_kinds) if k == kind], np.int64)
            for kind in dict.fromkeys(register_kinds)
        }
        ragged = (ragged_start, ragged_count, np.array(ragged_rows, np.int32).reshape(-1, ports))
        plan = plan_of(
            lanes, depths, inputs, outputs, ragged, groups,
            {self.position[node]: tuple(entries) for node, entries in self.copies.items()},
            results=tuple(graph.results),
            watched=len(graph.watch),
            last_padding=None if graph.last_padding is None else depth[graph.last_padding],
            padded_length=graph.padded_length,
            lane_layouts=self._lane_layouts(order, lane_bounds),
        )
        externals = {
            kind: np.asarray(values, dtype=kind.dtype).reshape(-1, *kind.shape) for kind, values in per_kind.items()
        }
        return Unfolded(plan, externals, graph.state)

    def _lane_layouts(self, order: list[int], bounds: np.ndarray) -> tuple[LaneLayout | None, ...]:
        """Each lane's layout if it is a chain (common.lanes), else None."""
        nodes = self.graph.nodes
        return tuple(
            chain_layout(order[start:end], nodes, self.specs[order[start]], self.depth, self.readers)
            for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist())
        )

    def _lane_bounds(self, order: list[int]) -> np.ndarray:
        bounds = [0]
        lane = 0
        for position, index in enumerate(order):
            this = self.lane_of[self.specs[index].key]
            while lane < this:
                bounds.append(position)
                lane += 1
        bounds.append(len(order))
        return np.array(bounds, np.int32)

    def _registers(self) -> tuple[list[tuple[int, ...]], tuple[ValueKind, ...]]:
        """Give every node output a register, reusing registers whose value nobody reads any more.

        Nodes are visited by depth. A value whose readers all sit at depths below d frees its
        register for writers of depth d (they are issued after every reader); a value whose only
        remaining reader is the writer itself (a chain's state) is overwritten in place; a value
        nobody reads (a result, copied by its own task) frees its register after its own depth."""
        graph, specs, depth, readers = self.graph, self.specs, self.depth, self.readers
        # Per value, its readers' largest depth and the reader alone at that depth (-1 if several):
        # a writer may overwrite a value in place when it is that reader. Found once per value, as
        # a value may have many readers (a decoder step attending over every encoder output).
        last_read: dict[tuple[int, int], tuple[int, int]] = {}
        for value, nodes in readers.items():
            deepest = max(depth[r] for r in nodes)
            there = [r for r in nodes if depth[r] == deepest]
            last_read[value] = (deepest, there[0] if len(there) == 1 else -1)
        kinds: list[ValueKind] = []
        free: dict[ValueKind, list[int]] = collections.defaultdict(list)
        release_at: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # depth -> values
        overwritten: set[tuple[int, int]] = set()
        registers: list[tuple[int, ...]] = [()] * len(specs)

        def kind_of(value: tuple[int, int]) -> ValueKind:
            return specs[value[0]].outputs[value[1]]

        current = -1
        for index in sorted(range(len(specs)), key=lambda i: (depth[i], i)):
            if depth[index] != current:
                for level in range(current + 1, depth[index] + 1):
                    for value in release_at.pop(level, ()):
                        if value not in overwritten:
                            free[kind_of(value)].append(registers[value[0]][value[1]])
                current = depth[index]
            in_place: dict[ValueKind, list[tuple[int, int]]] = collections.defaultdict(list)
            for source in dict.fromkeys(node_sources(graph.nodes[index].inputs)):
                value = (source.node, source.port)
                if last_read[value][1] == index:  # every other reader has a smaller depth
                    in_place[kind_of(value)].append(value)
            assigned = []
            for port, kind in enumerate(specs[index].outputs):
                if in_place[kind]:
                    value = in_place[kind].pop(0)
                    overwritten.add(value)
                    register = registers[value[0]][value[1]]
                elif free[kind]:
                    register = free[kind].pop()
                else:
                    register = len(kinds)
                    kinds.append(kind)
                assigned.append(register)
                last = last_read.get((index, port), (current, -1))[0]
                release_at[last + 1].append((index, port))
            registers[index] = tuple(assigned)
        return registers, tuple(kinds)


def _depths(producers: list[list[int]]) -> list[int]:
    """Each node's longest path from a node without producers (producers come before their readers)."""
    depth = [0] * len(producers)
    for index, sources in enumerate(producers):
        if sources:
            depth[index] = 1 + max(depth[s] for s in sources)
    return depth


def plan_of(
    lanes: list[tuple[str, int]],
    depth: np.ndarray,
    inputs: np.ndarray,
    outputs: np.ndarray,
    ragged: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    register_groups: dict[ValueKind, np.ndarray],
    copies: dict[int, tuple[tuple[str | int, int], ...]],
    results: tuple[str, ...],
    watched: int = 0,
    last_padding: int | None = None,
    padded_length: int | None = None,
    lane_layouts: tuple[LaneLayout | None, ...] | None = None,
) -> Plan:
    """A plan from nodes already in plan order (by lane, then by depth within each lane) with their
    registers given: waves, needs and copy flags derived. The compiler and models that build their
    plans with numpy (the TreeLSTMs) both end here. `last_padding` is the depth of the node that
    ends a padded graph's padding. A lane without nodes (a one-word tree has no internal node) is
    left out: queued, it would start at the next lane's first node and run it as its own cell type."""
    count = len(depth)
    kept = [lane[1] > start for lane, start in zip(lanes, [0, *(end for _, end in lanes)])]
    lanes = [lane for lane, keep in zip(lanes, kept) if keep]
    layouts = (None,) * len(lanes) if lane_layouts is None else tuple(l for l, keep in zip(lane_layouts, kept) if keep)
    bounds = np.array([0, *(end for _, end in lanes)], np.int32)
    wave_end = np.empty(count, np.int32)
    for lane in range(len(lanes)):
        start, end = bounds[lane], bounds[lane + 1]
        wave_end[start:end] = start + np.searchsorted(depth[start:end], depth[start:end], side="right")
    has_copies = np.zeros(count, bool)
    has_copies[list(copies)] = True
    ordered = np.sort(depth)
    ragged_start, ragged_count, ragged_refs = ragged or (
        np.zeros(count, np.int32),
        np.zeros(count, np.int32),
        np.zeros((0, inputs.shape[1]), np.int32),
    )
    _check_lengths(count, inputs=inputs, outputs=outputs, ragged_start=ragged_start, ragged_count=ragged_count)
    return Plan(
        lane_cells=tuple(key for key, _ in lanes),
        lane_bounds=bounds,
        depth=depth.astype(np.int32),
        need=np.searchsorted(ordered, depth, side="left").astype(np.int32),
        wave_end=wave_end,
        inputs=inputs,
        outputs=outputs,
        ragged_start=ragged_start,
        ragged_count=ragged_count,
        ragged_refs=ragged_refs,
        registers=sum(len(group) for group in register_groups.values()),
        copies=copies,
        has_copies=has_copies,
        results=results,
        watched=watched,
        padding_need=None if last_padding is None else int(np.searchsorted(ordered, last_padding, side="right")),
        padded_length=padded_length,
        register_groups=register_groups,
        lane_layouts=layouts,
    )


def _check_lengths(count: int, **arrays: np.ndarray) -> None:
    """Every node array of a plan has a row per node: a planner that builds one short fails its request."""
    for name, array in arrays.items():
        if len(array) != count:
            raise ValueError(f"the plan's {name} has {len(array)} rows for {count} nodes")
