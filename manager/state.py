"""Run-time records of the manager: requests, nodes, subgraphs and batched tasks.

Plain classes with __slots__: the scheduler touches these tens of thousands of
times a second, so attribute access must stay cheap.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import numpy as np

from common.graph import CellGraph, CellTypeSpec, NodeSpec

if TYPE_CHECKING:
    from common.models.base import Model
    from manager.workers import WorkerHandle


class Subgraph:
    """Connected nodes of one cell type in one request: the unit that is queued and pinned (paper section 4.3)."""

    __slots__ = ("cell_key", "request", "ready", "remaining", "pinned_worker", "running_tasks", "queued")

    def __init__(self, cell_key: str, request: Request):
        self.cell_key = cell_key
        self.request = request
        self.ready: collections.deque[NodeState] = collections.deque()
        self.remaining = 0  # nodes not yet submitted
        self.pinned_worker: WorkerHandle | None = None
        self.running_tasks = 0  # submitted tasks holding nodes of this subgraph, not yet completed
        self.queued = False


NO_COPIES: list = []  # shared and never appended to


class NodeState:
    """One cell invocation of one request, from unfold to the freeing of its output slots."""

    __slots__ = (
        "spec",
        "cell",
        "request",
        "subgraph",
        "pending",
        "consumers",
        "producers",
        "live_consumers",
        "copies",
        "worker",
        "out_slots",
        "completed",
        "depth",
    )

    def __init__(self, spec: NodeSpec, cell: CellTypeSpec, request: Request):
        self.spec = spec
        self.cell = cell
        self.request = request
        self.subgraph: Subgraph | None = None
        self.pending = 0  # producers not yet submitted
        self.consumers: list[NodeState] = []
        self.producers: list[NodeState] = []  # distinct producer nodes
        self.live_consumers = 0  # consumers that have not completed (or been dropped)
        # Outputs copied back to the host: (result name, port) for results, (index in graph.watch, port) for watched
        self.copies: list[tuple[str | int, int]] = NO_COPIES  # replaced by a list for the few nodes read back
        self.worker: WorkerHandle | None = None
        self.out_slots: tuple[int, ...] = ()
        self.completed = False
        self.depth = 0  # longest path from a node without producers (agenda-based batching only)


class Request:
    __slots__ = (
        "client",
        "request_id",
        "model",
        "inputs",
        "graph",
        "deadline",
        "nodes",
        "subgraphs",
        "arrival",
        "started",
        "worker",
        "results",
        "results_pending",
        "in_flight",
        "done",
        "group",
        "answer_held",
        "dropped",
    )

    def __init__(self, client: bytes, request_id: Any, model: Model, inputs: Any, graph: CellGraph, arrival: float):
        self.client = client
        self.request_id = request_id
        self.model = model
        self.inputs = inputs  # kept to replay the request from scratch if its worker dies
        self.graph = graph
        self.deadline: float | None = None
        self.nodes: list[NodeState] = []
        self.subgraphs: list[Subgraph] = []
        self.arrival = arrival
        self.started: float | None = None  # first submission
        self.worker: WorkerHandle | None = None  # where its values live
        self.results: dict[str, np.ndarray] = {}
        self.results_pending = 0
        self.in_flight = 0  # submitted nodes not yet completed
        self.done = False  # replied to (answer or error); remaining nodes are dropped
        self.group: Group | None = None  # the batch a baseline policy runs it in; None under cellular
        self.answer_held = False  # answer known, held until the rest of its group ends
        self.dropped = False  # its unsubmitted nodes were dropped: they will never run


class Group:
    """Requests a baseline policy (padded or graph) runs as one batch and answers together."""

    __slots__ = ("members", "unanswered")

    def __init__(self, members: list[Request]):
        self.members = members
        self.unanswered = len(members)  # members whose answer is neither known nor replaced by an error

    def padding_done(self) -> bool:
        return all(
            m.done or m.graph.last_padding is None or m.nodes[m.graph.last_padding].completed for m in self.members
        )


class Task:
    """A batched task: nodes of one cell type sent together to one worker."""

    __slots__ = ("task_id", "spec", "nodes", "worker", "batch_size", "results", "submitted")

    def __init__(self, task_id: int, spec: CellTypeSpec, nodes: list[NodeState], worker: WorkerHandle, batch_size: int):
        self.task_id = task_id
        self.spec = spec
        self.nodes = nodes
        self.worker = worker
        self.batch_size = batch_size
        # Host copies to read at completion: (node, result name or watch index, kind, io slot)
        self.results: list[tuple[NodeState, str | int, Any, int]] = []
        self.submitted = 0.0
