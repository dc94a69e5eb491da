"""Cell-graph types shared by models, the manager and the workers.

A model's unfold function turns one request into a CellGraph: nodes (one cell
invocation each) whose inputs are outputs of other nodes, external values taken
from the request, or the all-zero row (an initial state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


class ValueKind(NamedTuple):
    """What one arena row holds: a dtype and a per-row shape (the batch dimension excluded)."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


class Stop(NamedTuple):
    """When a lane of a cell type is done before its last step: once output `port` has produced
    `value` (a decoder's end-of-sequence token). The worker decides it on the device: from then on the
    lane's carried outputs repeat their values of that step, so its later tokens are `value` too."""

    port: int
    value: int


@dataclass(frozen=True)
class CellTypeSpec:
    """A cell type: what it reads and writes, and how the scheduler batches it.

    `key` is "model/cell" and names the cell type across processes.
    """

    key: str
    inputs: tuple[ValueKind, ...]
    outputs: tuple[ValueKind, ...]
    batch_sizes: tuple[int, ...]
    priority: int
    # Input ports that take any number of values per node (e.g. a Child-Sum node's children).
    # The cell receives such a port as two arguments: the flat rows, and for each row the
    # index of the batch row (node) it belongs to.
    ragged_inputs: frozenset[int] = frozenset()
    stop: Stop | None = None

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def min_batch(self) -> int:
        return self.batch_sizes[0]

    def padded_size(self, n: int) -> int:
        """The smallest supported batch size that holds n nodes."""
        for size in self.batch_sizes:
            if size >= n:
                return size
        raise ValueError(f"{n} nodes exceed the largest batch size {self.max_batch} of {self.key}")

    def padded_sizes(self, counts: np.ndarray) -> list[int]:
        """`padded_size` of each count (every count at most `max_batch`), in one search."""
        return np.asarray(self.batch_sizes)[np.searchsorted(self.batch_sizes, counts)].tolist()


# References and node specs are named tuples: requests unfold into thousands of them a second.


class NodeOutput(NamedTuple):
    """Output `port` of node `node` (an index into CellGraph.nodes; always an earlier node)."""

    node: int
    port: int = 0


class External(NamedTuple):
    """Value `index` of CellGraph.externals, sent inline in the task message (see common/task.py)."""

    index: int


class Zero(NamedTuple):
    """The all-zero row of an arena: an initial recurrent state."""


class Ragged(NamedTuple):
    """The value of a ragged input port: any number (zero included) of node outputs."""

    refs: tuple[NodeOutput, ...]


ZERO = Zero()
ValueRef = NodeOutput | External | Zero | Ragged


def node_sources(inputs: tuple[ValueRef, ...]) -> list[NodeOutput]:
    """The node outputs among a node's inputs, ragged ones included."""
    found: list[NodeOutput] = []
    for ref in inputs:
        if type(ref) is NodeOutput:
            found.append(ref)
        elif type(ref) is Ragged:
            found.extend(ref.refs)
    return found


class NodeSpec(NamedTuple):
    cell_type: str
    inputs: tuple[ValueRef, ...]
    after: tuple[int, ...] = ()  # earlier nodes this one must run after without reading them


@dataclass
class CellGraph:
    """One request's unfolded computation.

    `externals` holds one row per External reference, already shaped and typed
    as the consuming input's ValueKind. `results` names the node outputs that
    are copied back to the host and form the reply. `watch` lists node outputs
    the model observes as they complete (Model.observe), to end a request whose
    length is only known at run time, such as a decoder emitting EOS; `state`
    is the model's own record of what it observed. Graphs padded for the padded
    policy set `padded_length` (the request's bucket) and `last_padding`, the node
    that ends the padding, which the request's answer waits for.
    """

    nodes: list[NodeSpec] = field(default_factory=list)
    externals: list[Any] = field(default_factory=list)  # arrays, or numbers for scalar kinds
    results: dict[str, NodeOutput] = field(default_factory=dict)
    watch: list[NodeOutput] = field(default_factory=list)
    state: Any = None
    padded_length: int | None = None
    last_padding: int | None = None

    def add_node(self, cell_type: str, *inputs: ValueRef, after: tuple[int, ...] = ()) -> int:
        self.nodes.append(NodeSpec(cell_type, tuple(inputs), after))
        return len(self.nodes) - 1

    def add_external(self, value: np.ndarray) -> External:
        self.externals.append(value)
        return External(len(self.externals) - 1)
