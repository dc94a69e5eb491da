"""Lanes: the chains of a plan that run as sequences, several steps a task, without a slot list per step.

A plan lane (the nodes of one cell type in a request, common.plan) is a *chain* when it runs one
node per wave and every step reads the same way as the one before:

* a **state** input reads an output of the lane's previous node (the recurrence: an LSTM's h and c,
  a decoder's previous token). Only its first step reads the arena; later steps take the value the
  step before computed, carried on the device;
* a **sequence** input reads a value from outside the lane at every step: one of the request's
  external values (a chain's tokens or vectors, forwards or backwards, padding included) or an
  output of another lane (a stacked layer reads the layer below, each direction of a bidirectional
  one). Its later steps' values or rows travel packed in the task;
* a **constant** input reads the same value at every step (the zero row, or the encoder's outputs an
  attention decoder reads on a ragged port at every step).

Every input's first step reads as a single-step task reads it. An output read outside the lane
before its last node (the layer below's h) is written at every step; the others only at the last
step of a task, for the next task or for whatever reads the lane's final state (a head, a decoder's
first step). Values the host reads (results, watched values) are copied from the steps that compute
them. So that a stacked layer's lanes run many steps a task, a chain that reads another chain's
outputs runs after it (`stacked_after`): the layer below first, every step of it, then the layer above.

A lane of one node (a head, a one-token chain) reads nothing step after step: its layout, `ONE_STEP`,
fits a task of any layout of its cell type, as every lane's first step reads its inputs the same way.
Everything else (a tree's levels, a lane reading itself other than at the step before) runs as
waves of nodes, one slot list per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from batchmaker.common.graph import CellTypeSpec, External, NodeOutput, NodeSpec, Ragged, node_sources

STATE, SEQUENCE, CONSTANT = 0, 1, 2  # how a lane's input port reads


class PortRule(NamedTuple):
    """How an input port of a chain lane reads: `mode`, and for a state the output it carries (`source`)."""

    mode: int
    source: int = 0


@dataclass(frozen=True)
class LaneLayout:
    """How a chain lane's steps read their inputs, one rule per input port, and which outputs are written
    at every step (`every_step`); lanes of one cell type with the same layout run in one lane task."""

    inputs: tuple[PortRule, ...]
    every_step: tuple[int, ...] = ()

    def rules(self, ports: int) -> tuple[PortRule, ...]:
        """The rule of each of a cell's `ports` inputs: a one-step lane reads each as a constant."""
        return self.inputs or (PortRule(CONSTANT),) * ports


ONE_STEP = LaneLayout(())  # the layout of a lane of one node


def chain_layout(
    nodes: Sequence[int],
    graph_nodes: Sequence[NodeSpec],
    spec: CellTypeSpec,
    depth: Sequence[int],
    readers: dict[tuple[int, int], set[int]],
) -> LaneLayout | None:
    """The layout of the lane of graph nodes `nodes` (in plan order, all of cell type `spec`), or
    None when it is not a chain. `readers` maps a node output to the nodes that read it."""
    if any(depth[b] <= depth[a] for a, b in itertools.pairwise(nodes)):
        return None
    if len(nodes) == 1:
        return ONE_STEP
    members = set(nodes)
    rules = []
    for port in range(len(spec.inputs)):
        rule = _port_rule([graph_nodes[node].inputs[port] for node in nodes], nodes, members)
        if rule is None or (port in spec.ragged_inputs and rule.mode != CONSTANT):
            return None
        rules.append(rule)
    every_step = tuple(
        port
        for port in range(len(spec.outputs))
        if any(not readers.get((node, port), set()) <= {following} for node, following in itertools.pairwise(nodes))
    )
    return LaneLayout(tuple(rules), every_step)


def _port_rule(refs: list[Any], nodes: Sequence[int], members: set[int]) -> PortRule | None:
    """The rule of one input port, from what each step reads on it (`refs`, by step)."""
    first, later = refs[0], refs[1:]
    if all(type(ref) is NodeOutput and ref.node == node for ref, node in zip(later, nodes)):
        ports = {ref.port for ref in later}
        return PortRule(STATE, ports.pop()) if len(ports) == 1 else None
    if all(ref == first for ref in later):
        outside = type(first) is not NodeOutput or first.node not in members
        inside = type(first) is Ragged and any(ref.node in members for ref in first.refs)
        return PortRule(CONSTANT) if outside and not inside else None
    if all(type(ref) is External or (type(ref) is NodeOutput and ref.node not in members) for ref in refs):
        return PortRule(SEQUENCE)
    return None


def stacked_after(graph_nodes: Sequence[NodeSpec], depth: Sequence[int]) -> list[tuple[int, int]]:
    """(first node of a lane, last node of another lane it reads): for each lane of one node per wave
    that reads a node of another such lane, so that it runs after it. A stacked layer's steps then wait
    for the whole layer below instead of running a step behind it, and both run as lanes of many steps
    a task. Only where the lane read comes before it in the graph (every cell graph's nodes are in an
    order they can run in)."""
    lanes: dict[str, list[int]] = {}
    for node in sorted(range(len(graph_nodes)), key=lambda n: (depth[n], n)):
        lanes.setdefault(graph_nodes[node].cell_type, []).append(node)
    chains = {
        key: nodes for key, nodes in lanes.items() if all(depth[b] > depth[a] for a, b in itertools.pairwise(nodes))
    }
    lane_of = {node: key for key, nodes in chains.items() for node in nodes}
    edges = []
    for key, nodes in chains.items():
        read = {lane_of.get(ref.node) for node in nodes for ref in node_sources(graph_nodes[node].inputs)} - {key, None}
        first = min(nodes)
        edges += [(first, max(chains[other])) for other in read if max(chains[other]) < first]
    return edges

