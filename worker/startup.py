"""A worker's start: the models' cells built on its device, its backend warmed up, and what builds its running
batch when the manager routes requests whole."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from batchmaker.common.config import ConfigError, ModelConfig
from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.models.base import build_planner
from batchmaker.common.server_config import ServerConfig
from batchmaker.worker.backend import Backend
from batchmaker.worker.chain_runs import ChainBounds
from batchmaker.worker.held_requests import HeldRequests
from batchmaker.worker.loading import build_cells

log = logging.getLogger("batchmaker.worker")

EXIT_CONFIG_ERROR = 2
EXIT_STARTUP_FAILED = 3  # building the backend or warming it up failed (a device or model fault, not the config)


def make_backend(
    device: str,
    specs: list[CellTypeSpec],
    cells: list[torch.nn.Module],
    kinds: list[ValueKind],
    rows: int,
    io_rows: int,
    cuda_graphs: bool = False,
    cross_gpu_reads: str = "always",
) -> Backend:
    """The backend of `device`; `cuda_graphs` and `cross_gpu_reads` apply to GPU workers only."""
    if device == "cpu":
        from batchmaker.worker.cpu import CpuBackend

        if cuda_graphs:  # devices = "auto" on a machine without GPUs
            log.warning("cuda_graphs is set but this worker runs on the CPU: its cells run eagerly")
        return CpuBackend(cells, specs, kinds, rows, io_rows)
    if device.startswith("cuda"):
        from batchmaker.worker.cuda import CudaBackend

        return CudaBackend(device, cells, specs, kinds, rows, io_rows, cuda_graphs, cross_gpu_reads)
    raise ConfigError(f"unknown device {device!r}; use cpu or cuda:N")


def start(
    device: str, index: int, models: list[ModelConfig], server: ServerConfig
) -> tuple[Backend, list[str], Callable[[ChainBounds], HeldRequests]] | int:
    """The warmed-up backend serving `models`, with its cell types' keys and what builds its running batch (for a
    manager that routes requests whole); or the exit status when it cannot start."""
    try:
        specs, cells, kinds = build_cells(models, device)
        backend = make_backend(
            device, specs, cells, kinds, server.arena_rows, server.io_rows, server.cuda_graphs, server.cross_gpu_reads
        )
        try:
            backend.warm_up()
        except BaseException:
            backend.close()  # its shared memory, which would otherwise outlive the worker
            raise
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG_ERROR
    except Exception:  # a device that cannot run the cells: say so once, with the cause, and stop
        log.exception("worker %d could not start on %s", index, device)
        return EXIT_STARTUP_FAILED
    planners = {model.name: build_planner(model) for model in models}
    rows = server.arena_rows

    def make_held(chains: ChainBounds) -> HeldRequests:
        return HeldRequests(planners, specs, cells, kinds, rows, device, backend.kernel_clock(), chains)

    return backend, [spec.key for spec in specs], make_held
