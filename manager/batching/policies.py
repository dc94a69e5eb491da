"""Batching policies: cellular batching, and the two baselines benchmarks compare it with.

All three run on the same scheduler, workers and cells, so a comparison measures the
policy and nothing else:

* `cellular` (the product): every request's cells join the running batches at once and
  each request is answered as soon as its own last cell has run.
* `padded` (TensorFlow / MXNet bucketing): requests wait in buckets by padded length
  (multiples of `bucket_width`); whenever a worker has nothing left to run, the next
  non-empty bucket in round-robin order releases up to `max_group_requests` of them as
  one batch, padded to the bucket's length, and the batch is answered when its last
  cell, padding included, has run. No timeout: a batch starts as soon as a worker is free.
* `graph` (DyNet / TensorFlow Fold): whenever a worker has nothing left to run, up to
  `max_group_requests` queued requests of one model are merged into one graph, run with
  agenda-based batching (see manager.batching.agenda) and answered together.

The baselines are in manager.batching.baselines.
"""

from __future__ import annotations

import numpy as np

from batchmaker.common.config import Config, ConfigError
from batchmaker.common.graph import CellTypeSpec
from batchmaker.common.models.base import Planner
from batchmaker.common.plan import Unfolded
from batchmaker.manager.batching.agenda import AgendaScheduler
from batchmaker.manager.batching.baselines import GroupPolicy, PaddedPolicy
from batchmaker.manager.batching.dispatch import Dispatcher
from batchmaker.manager.batching.plan_store import PlanStore
from batchmaker.manager.batching.records import Request, Task
from batchmaker.manager.batching.request_table import RequestTable
from batchmaker.manager.batching.scheduler import Scheduler
from batchmaker.manager.batching.worker_handle import WorkerHandle


class CellularPolicy:
    """Cells of every admitted request are ready for the scheduler at once."""

    holds_answers = False  # each request is answered as soon as its own last cell has run

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def unfold(self, model: Planner, inputs: object) -> Unfolded:
        return model.plan(inputs)

    def admit(self, requests: list[Request]) -> None:
        self.scheduler.release(requests)

    def schedule(self, worker: WorkerHandle) -> list[Task]:
        return self.scheduler.schedule(worker)

    def queued_requests(self) -> int:
        return 0

    def waits_for_group(self, request: Request) -> bool:
        """Whether its cells wait in this policy's queue, not yet released to the scheduler (never here)."""
        return False

    def answers(self, requests: list[Request]) -> tuple[list[Request], list[Request]]:
        """Of requests whose answers became known: those to answer now, and those to hold with their
        cells stopped (none here: each request is answered as soon as its own last cell has run)."""
        return requests, []

    def task_ended(self, rows: np.ndarray) -> list[Request]:
        """Held requests a task's end lets go, of the requests at `rows` (none held here)."""
        return []

    def left(self, request: Request, held: bool) -> list[Request]:
        """Held requests that a request's end (failed or replayed; `held` if it was held) lets go."""
        return []


def make_scheduler(
    config: Config,
    specs: list[CellTypeSpec],
    table: RequestTable,
    store: PlanStore,
    dispatcher: Dispatcher,
    workers: dict[int, WorkerHandle],
) -> Scheduler:
    """The scheduler the configured policy runs on: the graph policy chooses cell types by its
    agenda, one step at a time (its choice after each step is the point of it), and a baseline's
    batch runs on one worker (request affinity)."""
    settings = config.scheduler
    cellular = settings.policy == "cellular"
    graph = settings.policy == "graph"
    return (AgendaScheduler if graph else Scheduler)(
        specs,
        settings.max_tasks_to_submit,
        table,
        store,
        dispatcher,
        workers,
        settings.affinity if cellular else "request",
        1 if graph else settings.max_steps_per_task,
        settings.max_join_delay_us,
        settings.latency_target_ms,
    )


Policy = CellularPolicy | GroupPolicy


def make_policy(config: Config, models: dict[str, Planner], scheduler: Scheduler, table: RequestTable) -> Policy:
    """The configured policy; a baseline's group size defaults to each model's smallest largest
    batch size, so that one step of a group fits one task of every cell type."""
    settings = config.scheduler
    if settings.policy == "cellular":
        return CellularPolicy(scheduler)
    sizes = {
        name: settings.max_group_requests or min(spec.max_batch for spec in model.cell_types.values())
        for name, model in models.items()
    }
    if settings.policy == "graph":
        return GroupPolicy(scheduler, table, sizes)
    check_policy(settings.policy, models)
    return PaddedPolicy(scheduler, table, sizes, settings.bucket_width)


def check_policy(policy: str, models: dict[str, Planner]) -> None:
    """Refuse a policy that cannot serve every model: padding needs sequence models."""
    unpaddable = [name for name, model in models.items() if not model.can_pad]
    if policy == "padded" and unpaddable:
        raise ConfigError(
            f"[scheduler] policy 'padded' needs sequence models; {', '.join(unpaddable)} cannot be padded "
            f"(serve them with policy 'graph' or 'cellular')"
        )
