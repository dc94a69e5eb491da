"""Device operations per task on a GPU, counted without one, for every built-in model's cell types.

Runs the CUDA backend's task path (worker/device_tasks.py) on torch's fake tensors, every
tensor on a fake "cuda" device (tests/test_cuda_fake.py), and counts the aten operations
it dispatches, split into the task's phases. Each counted operation is a kernel launch or a
copy on a GPU; views and allocations, which launch nothing, are not counted. Besides these,
every task makes one upload (its slot lists and inline values) and the counter's fill and
copy, and with `[server] cuda_graphs = true` the cell phase of a captured cell is one graph
launch.

A multi-step task runs its steps back to back on the stream; `--steps` counts tasks of k steps
(every step at the same batch, without downloads): launches per task and per step, and per step
with `cuda_graphs`, where each step's cell is one graph launch (a loop of captured single steps).

    python scripts/launch_count.py [--batch 64] [--config configs/all.toml] [--steps 1 16]

Prints Markdown tables (README.md, "Launches per task", shows their output).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

from test_cuda_fake import FakeCalls, all_cells, fake_cuda, fake_tasks, serving_task
from torch.utils._python_dispatch import TorchDispatchMode

from batchmaker.common.task import TaskMessage, TaskStep
from batchmaker.worker.cuda_graphs import capturable

NO_WORK = {"aten::empty", "aten::empty_strided", "aten::lift_fresh"}  # allocations and wrappers: no kernel
TRANSFERS = {"aten::to", "aten::_to_copy"}  # may alias their input (so they are marked views), but move data here


class LaunchCounter(TorchDispatchMode):
    """Counts the aten operations that touch device memory, per phase of the task (set from outside)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = ""
        self.counts: Counter[str] = Counter()
        self.ops: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in TRANSFERS or not (func.is_view or name in NO_WORK or name.startswith("prim::")):
            self.counts[self.phase] += 1
            self.ops[(self.phase, name)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Launches:
    cell_type: str
    inputs: int
    outputs: int
    gather: int
    cell: int
    scatter: int
    downloads: int


def counted_task(task_id: int, cell_index: int, spec, ids, batch: int, downloads: bool) -> TaskMessage:
    """A serving task reading its own arena (tokens inline), downloading every output if `downloads`."""
    task = serving_task(task_id, cell_index, spec, ids, batch)
    inputs = [(a, s, g, None, v) for a, s, g, _, v in task.inputs]
    return TaskMessage(task_id, cell_index, batch, inputs, task.outputs, task.downloads if downloads else [])


def phases(tasks, calls: FakeCalls, cell, task: TaskMessage) -> Counter[str]:
    """Operations of one task: before the cell's forward (gather), inside it (cell), after it (with the
    copies to the host, which the CUDA runtime makes rather than an aten operation)."""
    counter = LaunchCounter()
    copies = calls.downloads
    before = cell.register_forward_pre_hook(lambda *_: setattr(counter, "phase", "cell"))
    after = cell.register_forward_hook(lambda *_: setattr(counter, "phase", "after"))
    try:
        with counter:
            counter.phase = "gather"
            tasks.issue(task)
    finally:
        before.remove()
        after.remove()
    if tasks.finish(task.task_id) is not None:
        raise RuntimeError(f"task {task.task_id} failed")
    counter.counts["after"] += calls.downloads - copies
    return counter.counts


def count_launches(batch: int, config: Path) -> list[Launches]:
    layout = all_cells(config)
    specs, cells, _ = layout
    rows = []
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        for index, spec in enumerate(specs):
            cell = cells[index]  # moved to the fake device in place
            plain = phases(tasks, calls, cell, counted_task(2 * index, index, spec, ids, batch, downloads=False))
            full = phases(tasks, calls, cell, counted_task(2 * index + 1, index, spec, ids, batch, downloads=True))
            if (plain["gather"], plain["cell"]) != (full["gather"], full["cell"]):
                raise RuntimeError(f"{spec.key}: downloads changed the gather or the cell")
            rows.append(
                Launches(
                    spec.key,
                    len(spec.inputs),
                    len(spec.outputs),
                    plain["gather"],
                    plain["cell"],
                    plain["after"],
                    full["after"] - plain["after"],
                )
            )
    return rows


@dataclass
class StepLaunches:
    """Device operations of a task of `steps` steps: all of them, those inside the cell, and uploads."""

    cell_type: str
    steps: int
    total: int
    cell: int
    uploads: int
    capturable: bool  # cuda_graphs captures the cell (not one with ragged inputs, which stays eager)

    @property
    def with_graphs(self) -> int:
        """The same task with `cuda_graphs`: each step's captured cell is one graph launch."""
        return self.total - self.cell + self.steps if self.capturable else self.total


def multi_step_task(task_id: int, cell_index: int, spec, ids, batch: int, steps: int) -> TaskMessage:
    """A task of `steps` steps, each like `counted_task` without downloads."""
    step = counted_task(task_id, cell_index, spec, ids, batch, downloads=False)
    later = tuple(TaskStep(batch, step.inputs, step.outputs, []) for _ in range(steps - 1))
    return TaskMessage(task_id, cell_index, batch, step.inputs, step.outputs, [], later)


def count_step_launches(batch: int, config: Path, steps: int) -> list[StepLaunches]:
    """Launches of a `steps`-step task of every cell type (the uploads are the runtime's, not aten operations)."""
    specs, cells, _ = layout = all_cells(config)
    rows = []
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        for index, spec in enumerate(specs):
            uploads = calls.sent
            # The hooks mark every step's cell, so "cell" counts the cells of all steps, the rest what is around them.
            counts = phases(tasks, calls, cells[index], multi_step_task(index, index, spec, ids, batch, steps))
            total, uploads = sum(counts.values()), calls.sent - uploads
            rows.append(StepLaunches(spec.key, steps, total, counts["cell"], uploads, capturable(spec)))
    return rows


def steps_table(rows: list[StepLaunches]) -> str:
    lines = [
        (
            "| cell type | steps | per task | per step | in the cell, per step | uploads per task "
            "| per step with `cuda_graphs` |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.cell_type}` | {r.steps} | {r.total} | {r.total / r.steps:g} | {r.cell / r.steps:g} | {r.uploads} "
            f"| {r.with_graphs / r.steps:g} |"
        )
    return "\n".join(lines)


def table(rows: list[Launches]) -> str:
    lines = [
        "| cell type | inputs | outputs | gather | cell | scatter | downloads (all outputs) | total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = r.gather + r.cell + r.scatter + r.downloads
        lines.append(
            f"| `{r.cell_type}` | {r.inputs} | {r.outputs} | {r.gather} | {r.cell} | {r.scatter} "
            f"| {r.downloads} | {total} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "all.toml")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 16], metavar="K", help="steps per task to count")
    args = parser.parse_args()
    if min(args.steps) < 1:
        parser.error("--steps must be at least 1")
    print(table(count_launches(args.batch, args.config)))
    print()
    print(steps_table([row for k in args.steps for row in count_step_launches(args.batch, args.config, k)]))


if __name__ == "__main__":
    main()
