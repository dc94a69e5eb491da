"""What the in-process stage benchmarks (bench.stages, bench.stages_running) share: a served model's config for
one CPU worker, and a cell that times its own forward calls."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from batchmaker.bench.run import ROOT
from batchmaker.common.config import Config, load_config
from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.models import init_missing_weights
from batchmaker.common.models.base import Planner
from batchmaker.manager.loop.server import load_models
from batchmaker.worker.main import load_cells

Stage = Callable[[str], AbstractContextManager[None]]  # times what runs within it as the named stage
Served = tuple[Config, dict[str, Planner], list[CellTypeSpec], list[ValueKind], list[torch.nn.Module]]

ROWS = 65536  # arena rows: every request of a workload fits at once


def stage_config(model: str, hidden: int, batch: int) -> str:
    """A config serving `model` at `hidden` units, batches up to `batch`, every request admitted."""
    sizes = [size for size in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if size <= batch]
    vocab = "vocab_size = 8737\nnum_classes = 5" if model == "treelstm" else "vocab_size = 8192\nmax_length = 400"
    return f"""
[server]
arena_rows = {ROWS}
io_rows = {ROWS}
max_queue_delay_ms = 0  # every request admitted: a refusal would leave it unanswered here

[scheduler]
max_tasks_to_submit = 64
idle_tasks = 64

[models.{model}]
builder = "batchmaker.common.models.{model}:build"
weights = "{ROOT / "weights"}/stages-{model}-h{hidden}.pt"
{vocab}
hidden_size = {hidden}
batch_sizes = {sizes}
"""


class TimedCell(torch.nn.Module):
    """A cell whose forward calls add their seconds to `clock["cell"]`."""

    def __init__(self, cell: torch.nn.Module, clock: dict[str, float]):
        super().__init__()
        self.cell = cell
        self.clock = clock

    def forward(self, *args: torch.Tensor) -> Any:
        began = time.perf_counter()
        out = self.cell(*args)
        self.clock["cell"] += time.perf_counter() - began
        return out


def stage_timer(clock: dict[str, float]) -> Stage:
    """`stage(what)`: a context whose wall seconds are added to `clock[what]`."""

    @contextmanager
    def stage(what: str) -> Iterator[None]:
        began = time.perf_counter()
        yield
        clock[what] += time.perf_counter() - began

    return stage


@contextmanager
def served_model(model: str, hidden: int, batch: int) -> Iterator[Served]:
    """The config of `stage_config` (weights made once), the model's planners, cell types and kinds of value as the
    manager loads them, and its cells as a worker builds them."""
    with tempfile.TemporaryDirectory(prefix="batchmaker-stages-") as tmp:
        path = Path(tmp) / "stages.toml"
        path.write_text(stage_config(model, hidden, batch))
        config = load_config(path)
        init_missing_weights(config)
        planners, specs, kinds = load_models(config)
        _, cells, _ = load_cells(config)
        yield config, planners, specs, kinds, cells
