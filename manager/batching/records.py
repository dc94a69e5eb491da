"""Run-time records of the manager: requests and batched tasks.

A request is one Python object for its whole life, whatever its number of cells: what the
scheduler reads per batch lives in the RequestTable's columns (manager.batching.request_table) at its `row`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import numpy as np

from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.plan import Unfolded
from batchmaker.common.task import LaneTaskMessage, TaskMessage

if TYPE_CHECKING:
    from batchmaker.common.models.base import Planner


class Lifecycle(enum.Enum):
    """Where a request is between admission and being forgotten.

    RUNNING: admitted, its answer not yet known (under a baseline policy its cells wait until its group
    starts). HELD: its answer is known and waits for the rest of its group (baselines). DONE: answered
    (or failed, or replaced by a replay); tasks still in flight finish and its rows are freed when the
    last one completes, after which the request is forgotten. The request processor
    (manager.batching.request_processor) alone moves a request from one to the next.
    """

    RUNNING = "running"
    HELD = "held"
    DONE = "done"


class Request:
    __slots__ = (
        "client",
        "request_id",
        "model",
        "inputs",
        "unfolded",
        "deadline",
        "arrival",
        "row",
        "lifecycle",
        "results",
        "results_pending",
        "rows",
        "group",
        "failures",
        "priority",
        "stream",
        "streamed_rows",
        "restarted",
    )

    def __init__(
        self, client: bytes, request_id: Any, model: Planner, inputs: Any, unfolded: Unfolded, arrival: float,
        deadline: float | None = None, priority: int = 0, stream: bool = False,
    ):  # fmt: skip
        """`deadline`: a perf_counter time, or None for none; `priority`: higher is served first within a cell
        type's queue (manager.batching.scheduler); `stream`: the client asked for partial replies."""
        self.client = client
        self.request_id = request_id
        self.model = model
        self.inputs = inputs  # kept to replay the request from scratch if its worker dies
        self.unfolded = unfolded
        self.deadline = deadline
        self.arrival = arrival
        self.row = -1  # in the RequestTable
        self.lifecycle = Lifecycle.RUNNING
        self.results: dict[str, np.ndarray] = {}
        self.results_pending = len(unfolded.plan.results)
        # Arena rows it holds, per worker id and kind (its registers' rows there)
        self.rows: dict[int, dict[ValueKind, np.ndarray]] = {}
        self.group: Group | None = None  # the batch a baseline policy runs it in; None under cellular
        self.failures = 0  # workers lost while it had values there (replays so far)
        self.priority = priority
        self.stream = stream
        self.streamed_rows = 0  # rows of its outputs sent in partial replies
        self.restarted = False  # it started over after partials were sent: its next partial says so

    @property
    def done(self) -> bool:
        return self.lifecycle is Lifecycle.DONE


class Group:
    """Requests a baseline policy (padded or graph) runs as one batch and answers together."""

    __slots__ = ("members", "unanswered")

    def __init__(self, members: list[Request]):
        self.members = members
        self.unanswered = len(members)  # members whose answer is neither known nor replaced by an error


class Task:
    """A batched task: waves of one cell type from several requests, sent together to one worker.

    `rows` are the request rows it holds nodes of (each once) and `counts` how many nodes of each;
    `reads` are the host copies to take at completion: (request, result name or watch index, kind, io slot).
    A multi-step task runs several consecutive waves of the same lanes: `step_nodes` and `step_sizes`
    hold each step's nodes and padded batch size, and `batch_size` the rows of all its steps.
    """

    __slots__ = (
        "task_id",
        "spec",
        "worker_id",
        "batch_size",
        "rows",
        "counts",
        "reads",
        "submitted",
        "message",
        "joining",
        "steps",
        "step_nodes",
        "step_sizes",
        "lanes",
    )

    def __init__(self, task_id: int, spec: CellTypeSpec, worker_id: int, rows: np.ndarray, counts: np.ndarray):
        self.task_id = task_id
        self.spec = spec
        self.worker_id = worker_id  # the worker it is sent to
        self.batch_size = 0
        self.rows = rows
        self.counts = counts
        self.reads: list[tuple[Request, str | int, ValueKind, int]] = []
        self.submitted = 0.0
        self.message: TaskMessage | LaneTaskMessage | None = None  # what the worker is sent, encoded as it is
        self.joining = False  # it mixes requests already running with requests starting (for stats)
        self.steps: list[Any] = []  # each step's common.task.TaskStep, until the message is made
        self.step_nodes: list[int] = []
        self.step_sizes: list[int] = []

    @property
    def nodes(self) -> int:
        return int(self.counts.sum())
