"""Lanes: the chains of a plan that run as sequences, several steps a task, without a slot list per step.

A plan lane (the nodes of one cell type in a request, common.plan) is a *chain* when it runs one
node per wave and every step reads the same way as the one before:

* a **state** input reads an output of the lane's previous node (the recurrence: an LSTM's h and c,
  a decoder's previous token). Only its first step reads the arena; later steps take the value the
  step before computed, carried on the device;
* a **sequence** input reads one of the request's external values at every step (a chain's tokens
  or vectors, forwards or backwards, padding included): its first step reads as any input's does,
  its later steps' values travel packed in the task;
* a **constant** input reads the same value at every step (the zero row, say).

and no value of it is read outside the lane before its last node, other than by the next step:
only the last step of a task writes the lane's outputs to their registers, for the next task or
for whatever reads the lane's final state (a head, a decoder's first step). Values the host reads
(results, watched values) are copied from the steps that compute them.

A lane of one node (a head, a one-token chain) reads nothing step after step: its layout, `ONE_STEP`,
fits a task of any layout of its cell type, as every lane's first step reads its inputs the same way.

Everything else (a tree's levels, a stacked layer that reads the layer below at every step, a
ragged input) runs as waves of nodes, one slot list per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from batchmaker.common.graph import CellTypeSpec, External, NodeOutput, NodeSpec

STATE, SEQUENCE, CONSTANT = 0, 1, 2  # how a lane's input port reads


class PortRule(NamedTuple):
    """How an input port of a chain lane reads: `mode`, and for a state the output it carries (`source`)."""

    mode: int
    source: int = 0


@dataclass(frozen=True)
class LaneLayout:
    """How a chain lane's steps read their inputs, one rule per input port; lanes of one cell type
    with the same layout run in one lane task."""

    inputs: tuple[PortRule, ...]

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
    if spec.ragged_inputs or any(depth[b] <= depth[a] for a, b in itertools.pairwise(nodes)):
        return None
    if len(nodes) == 1:
        return ONE_STEP
    members = set(nodes)
    rules = []
    for port in range(len(spec.inputs)):
        rule = _port_rule([graph_nodes[node].inputs[port] for node in nodes], nodes, members)
        if rule is None:
            return None
        rules.append(rule)
    for step, node in enumerate(nodes[:-1]):
        following = {nodes[step + 1]}
        if any(not readers.get((node, port), following) <= following for port in range(len(spec.outputs))):
            return None  # read outside the lane mid-way: a stacked layer, per-step attention memory
    return LaneLayout(tuple(rules))


def _port_rule(refs: list[Any], nodes: Sequence[int], members: set[int]) -> PortRule | None:
    """The rule of one input port, from what each step reads on it (`refs`, by step)."""
    first, later = refs[0], refs[1:]
    if all(type(ref) is NodeOutput and ref.node == node for ref, node in zip(later, nodes)):
        ports = {ref.port for ref in later}
        return PortRule(STATE, ports.pop()) if len(ports) == 1 else None
    if all(type(ref) is External for ref in refs):
        return PortRule(SEQUENCE)
    if all(ref == first for ref in later) and not (type(first) is NodeOutput and first.node in members):
        return PortRule(CONSTANT)
    return None
