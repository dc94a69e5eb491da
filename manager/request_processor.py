"""The request processor: unfolds requests, tracks node dependencies and finishes requests.

Admitting a request turns its cell graph into node records, splits it into
subgraphs (connected nodes of one cell type) and hands the nodes whose inputs are
all external to the scheduler. When the last result of a request has been read
back, the request is answered; nodes it will never need are dropped and their
slots freed.
"""

from __future__ import annotations

from typing import Any, Callable

from common.graph import CellGraph, CellTypeSpec, NodeOutput
from common.protocol import INTERNAL, RequestError
from manager.dispatch import Dispatcher
from manager.scheduler import Scheduler
from manager.state import NodeState, Request, Subgraph, Task

FinishFn = Callable[[Request, RequestError | None], None]


def split_subgraphs(request: Request) -> list[Subgraph]:
    """Union-find over edges between nodes of the same cell type."""
    nodes = request.nodes
    parent = list(range(len(nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for index, node in enumerate(nodes):
        for ref in node.spec.inputs:
            if type(ref) is NodeOutput and nodes[ref.node].spec.cell_type == node.spec.cell_type:
                a, b = find(index), find(ref.node)
                if a != b:
                    parent[a] = b
    by_root: dict[int, Subgraph] = {}
    for index, node in enumerate(nodes):
        root = find(index)
        subgraph = by_root.get(root)
        if subgraph is None:
            subgraph = by_root[root] = Subgraph(node.spec.cell_type, request)
        node.subgraph = subgraph
        subgraph.remaining += 1
    return list(by_root.values())


class RequestProcessor:
    def __init__(self, cell_types: dict[str, CellTypeSpec], scheduler: Scheduler, dispatcher: Dispatcher, finish: FinishFn):
        self._cell_types = cell_types
        self._scheduler = scheduler
        self._dispatcher = dispatcher
        self._finish = finish
        self.active: dict[int, Request] = {}  # by id(request), in arrival order

    def admit(self, client: bytes, request_id: Any, model: Any, graph: CellGraph, arrival: float) -> Request:
        """Track a validated request and queue its first ready nodes."""
        request = Request(client, request_id, model, graph, arrival)
        self._build_nodes(request)
        self.active[id(request)] = request
        for node in request.nodes:
            if node.pending == 0:
                self._scheduler.node_ready(node)
        return request

    def _build_nodes(self, request: Request) -> None:
        graph = request.graph
        try:
            cells = [self._cell_types[spec.cell_type] for spec in graph.nodes]
        except KeyError as exc:
            raise RequestError(INTERNAL, f"model produced a node of unknown cell type {exc}") from None
        nodes = [NodeState(spec, cell, request) for spec, cell in zip(graph.nodes, cells)]
        request.nodes = nodes
        for node in nodes:
            producers: list[NodeState] = []
            for ref in node.spec.inputs:
                if type(ref) is NodeOutput:
                    producer = nodes[ref.node]
                    if producer not in producers:
                        producers.append(producer)
            node.producers = producers
            node.pending = len(producers)
            for producer in producers:
                producer.consumers.append(node)
                producer.live_consumers += 1
        for name, ref in graph.results.items():
            nodes[ref.node].results.append((name, ref.port))
        request.results_pending = len(graph.results)
        request.subgraphs = split_subgraphs(request)

    def task_completed(self, task: Task, error: str | None) -> None:
        """Slots are freed and results read by the dispatcher; here requests progress and finish."""
        self._dispatcher.complete(task)
        self._scheduler.task_completed(task)
        for node in task.nodes:
            request = node.request
            request.in_flight -= 1
            if request.done:
                self._forget_if_drained(request)
                continue
            if error is not None:
                self.fail(request, RequestError(INTERNAL, f"a worker failed to run {task.spec.key}: {error}"))
            elif node.results and len(request.results) == request.results_pending:
                self._complete(request)

    def _complete(self, request: Request) -> None:
        request.done = True
        self._drop_unsubmitted(request)
        self._finish(request, None)
        self._forget_if_drained(request)

    def fail(self, request: Request, error: RequestError) -> None:
        if request.done:
            return
        request.done = True
        self._drop_unsubmitted(request)
        self._finish(request, error)
        self._forget_if_drained(request)

    def _drop_unsubmitted(self, request: Request) -> None:
        """Nodes that will never run release their claim on their producers' outputs."""
        self._scheduler.discard(request.subgraphs)
        for node in request.nodes:
            if node.worker is None:
                for producer in node.producers:
                    if producer.worker is not None:
                        self._dispatcher.release_consumer(producer)

    def _forget_if_drained(self, request: Request) -> None:
        if request.in_flight == 0:
            self.active.pop(id(request), None)

    def earliest_running_arrival(self) -> float | None:
        """Arrival time of the oldest request not yet answered (for the 'leaving' statistic)."""
        for request in self.active.values():
            if not request.done:
                return request.arrival
        return None
