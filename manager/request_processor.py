"""The request processor: unfolds requests, tracks node dependencies and finishes requests.

Admitting a request turns its cell graph into node records, splits it into
subgraphs (connected nodes of one cell type) and hands the nodes whose inputs are
all external to the scheduler. When the last result of a request has been read
back, the request is answered; nodes it will never need are dropped and their
slots freed.
"""

from __future__ import annotations

from typing import Any, Callable

from common.graph import CellGraph, CellTypeSpec, External, NodeOutput, Ragged
from common.protocol import INTERNAL, RequestError
from manager.dispatch import Dispatcher
from manager.policies import CellularPolicy
from manager.scheduler import Scheduler
from manager.state import Group, NodeState, Request, Subgraph, Task
from manager.workers import WorkerHandle

FinishFn = Callable[[Request, RequestError | None], None]


def split_subgraphs(request: Request) -> list[Subgraph]:
    """Group connected nodes of one cell type. Nodes come in topological order, so one pass
    suffices: a node joins its same-type producers' subgraph, merging them if there are several."""
    members: dict[Subgraph, list[NodeState]] = {}
    for node in request.nodes:
        joined: list[Subgraph] = []
        for producer in node.producers:
            if producer.cell is node.cell and producer.subgraph not in joined:
                joined.append(producer.subgraph)
        if not joined:
            subgraph = Subgraph(node.cell.key, request)
            members[subgraph] = [node]
        else:
            subgraph = joined[0] if len(joined) == 1 else max(joined, key=lambda s: len(members[s]))
            group = members[subgraph]
            for other in joined:
                if other is not subgraph:
                    for moved in members.pop(other):
                        moved.subgraph = subgraph
                        group.append(moved)
            group.append(node)
        node.subgraph = subgraph
    for subgraph, group in members.items():
        subgraph.remaining = len(group)
    return list(members)


def _ends_padding(node: NodeState) -> bool:
    last = node.request.graph.last_padding
    return last is not None and node.request.nodes[last] is node


def _invalid(request: Request, problem: str) -> RequestError:
    return RequestError(INTERNAL, f"model {request.model.name!r} produced an invalid cell graph: {problem}")


class RequestProcessor:
    def __init__(
        self,
        cell_types: dict[str, CellTypeSpec],
        scheduler: Scheduler,
        dispatcher: Dispatcher,
        finish: FinishFn,
        policy: CellularPolicy | None = None,
    ):
        self._cell_types = cell_types
        self._policy = policy or CellularPolicy(scheduler)
        self._scheduler = scheduler
        self._dispatcher = dispatcher
        self._finish = finish
        self.active: dict[int, Request] = {}  # by id(request), in arrival order
        self.unsubmitted_nodes = 0  # admitted and not yet submitted to a worker (admission control)

    def admit(
        self, client: bytes, request_id: Any, model: Any, inputs: Any, graph: CellGraph, arrival: float
    ) -> Request:
        """Track a validated request and queue its first ready nodes."""
        request = Request(client, request_id, model, inputs, graph, arrival)
        self._build_nodes(request)
        self.active[id(request)] = request
        self.unsubmitted_nodes += len(request.nodes)
        self._policy.admit(request)
        return request

    def _build_nodes(self, request: Request) -> None:
        """Node records with producer/consumer links, checking the graph a model's unfold produced.

        Runs for every cell of every request: the common cases come first."""
        graph = request.graph
        externals = len(graph.externals)
        nodes: list[NodeState] = []
        for index, spec in enumerate(graph.nodes):
            cell = self._cell_types.get(spec.cell_type)
            if cell is None:
                raise _invalid(request, f"node {index} has unknown cell type {spec.cell_type!r}")
            kinds = cell.inputs
            if len(spec.inputs) != len(kinds):
                raise _invalid(request, f"node {index} gives {len(spec.inputs)} inputs to {cell.key}")
            node = NodeState(spec, cell, request)
            producers = node.producers
            for port, ref in enumerate(spec.inputs):
                ref_type = type(ref)
                if ref_type is NodeOutput:
                    refs: tuple[NodeOutput, ...] = (ref,)
                elif ref_type is External:
                    if not 0 <= ref.index < externals:
                        raise _invalid(request, f"node {index} reads external value {ref.index}, which does not exist")
                    refs = ()
                elif ref_type is Ragged:
                    refs = ref.refs
                else:
                    refs = ()
                if (ref_type is Ragged) != (port in cell.ragged_inputs):
                    raise _invalid(request, f"node {index} input {port}: ragged values go to ragged inputs only")
                for source in refs:
                    if not 0 <= source.node < index:
                        raise _invalid(request, f"node {index} reads node {source.node}, not an earlier node")
                    producer = nodes[source.node]
                    if producer.cell.outputs[source.port] != kinds[port]:
                        raise _invalid(request, f"node {index} input {port} has the wrong kind")
                    if producer not in producers:
                        producers.append(producer)
            for source in spec.after:
                if not 0 <= source < index:
                    raise _invalid(request, f"node {index} runs after node {source}, not an earlier node")
                if nodes[source] not in producers:
                    producers.append(nodes[source])
            node.pending = len(producers)
            for producer in producers:
                producer.consumers.append(node)
                producer.live_consumers += 1
            nodes.append(node)
        request.nodes = nodes
        for key, ref in (*graph.results.items(), *enumerate(graph.watch)):
            if not 0 <= ref.node < len(nodes) or not 0 <= ref.port < len(nodes[ref.node].cell.outputs):
                raise _invalid(request, f"{key!r} names output {ref.port} of node {ref.node}, which does not exist")
            node = nodes[ref.node]
            node.copies = [*node.copies, (key, ref.port)]
        if not graph.results and not graph.watch:
            raise _invalid(request, "it has neither results nor watched outputs")
        if graph.last_padding is not None and not 0 <= graph.last_padding < len(nodes):
            raise _invalid(request, f"its padding ends at node {graph.last_padding}, which does not exist")
        request.results_pending = len(graph.results)
        request.subgraphs = split_subgraphs(request)

    def task_completed(self, task: Task, error: str | None) -> None:
        """Slots are freed and host copies read by the dispatcher; here requests progress and finish."""
        observed = self._dispatcher.complete(task)
        self._scheduler.task_completed(task)
        for node, watch_index, value in observed:
            request = node.request
            if request.done or request.answer_held or error is not None:
                continue
            try:
                finished = request.model.observe(request.graph, watch_index, value)
            except Exception as exc:  # a model bug fails its request, never the manager
                self.fail(request, RequestError(INTERNAL, f"{type(exc).__name__} in {request.model.name}: {exc}"))
                continue
            if finished:
                self._complete(request)
        for node in task.nodes:
            request = node.request
            request.in_flight -= 1
            if request.done:
                self._forget_if_drained(request)
            elif error is not None:
                self.fail(request, RequestError(INTERNAL, f"a worker failed to run {task.spec.key}: {error}"))
            elif node.copies and not request.graph.watch and len(request.results) == request.results_pending:
                self._complete(request)
            elif request.group is not None and request.group.unanswered == 0 and _ends_padding(node):
                self._end_group(request.group)

    def _complete(self, request: Request) -> None:
        """The request's answer is known: reply now, or hold it until the rest of its group ends."""
        group = request.group
        if group is None:
            self._answer(request)
            return
        if request.answer_held:
            return
        request.answer_held = True
        group.unanswered -= 1
        if not self._policy.pads:
            self._drop_unsubmitted(request)
        self._end_group(group)

    def _answer(self, request: Request) -> None:
        request.done = True
        self._drop_unsubmitted(request)
        self._finish(request, None)
        self._forget_if_drained(request)

    def _end_group(self, group: Group) -> None:
        """Answer a group's held members once none is left running and its padding has run."""
        if group.unanswered == 0 and group.padding_done():
            for member in group.members:
                if member.answer_held and not member.done:
                    self._answer(member)

    def _leave_group(self, request: Request) -> None:
        group = request.group
        if group is not None and not request.answer_held:
            group.unanswered -= 1
            self._end_group(group)

    def fail(self, request: Request, error: RequestError) -> None:
        if request.done:
            return
        request.done = True
        self._drop_unsubmitted(request)
        self._finish(request, error)
        self._forget_if_drained(request)
        self._leave_group(request)

    def worker_lost(self, worker: WorkerHandle) -> list[Request]:
        """Write off a dead worker's tasks; return the unanswered requests that had values there.

        Its slots go with it; only claims its in-flight nodes held on other workers' values
        are released here.
        """
        for task in worker.tasks.values():
            self._scheduler.task_completed(task)
            for node in task.nodes:
                node.request.in_flight -= 1
                for producer in node.producers:
                    self._dispatcher.release_consumer(producer)
        worker.tasks.clear()
        return [
            request
            for request in self.active.values()
            if not request.done and any(node.worker is worker for node in request.nodes)
        ]

    def replay(self, request: Request) -> Request:
        """Start a request over from its inputs; the old record is dropped without a reply."""
        request.done = True
        self._drop_unsubmitted(request)
        self._forget_if_drained(request)
        self._leave_group(request)
        graph = self._policy.unfold(request.model, request.inputs)
        replayed = self.admit(request.client, request.request_id, request.model, request.inputs, graph, request.arrival)
        replayed.deadline = request.deadline
        return replayed

    def _drop_unsubmitted(self, request: Request) -> None:
        """Nodes that will never run release their claim on their producers' outputs (once)."""
        if request.dropped:
            return
        request.dropped = True
        self._scheduler.discard(request.subgraphs)
        for node in request.nodes:
            if node.worker is None:
                self.unsubmitted_nodes -= 1
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
