"""The models a worker builds: at start those of its config (or, when the manager started with others, the
manager's), and while it runs the versions the manager loads and unloads (docs/deploy.md, "Rolling out new
weights")."""

from __future__ import annotations

import logging
from typing import Any

import torch

from batchmaker.common.config import ConfigError, ModelConfig, model_from_wire
from batchmaker.common.graph import CellTypeSpec, ValueKind
from batchmaker.common.models.base import build_model, build_planner, cell_layout
from batchmaker.worker.backend import Backend
from batchmaker.worker.held_requests import HeldRequests

log = logging.getLogger("batchmaker.worker")


def build_cells(
    models: list[ModelConfig], device: str = "cpu"
) -> tuple[list[CellTypeSpec], list[torch.nn.Module], list[ValueKind]]:
    """The models' cell types in the manager's order, with their modules (weights loaded and checked).

    The weights go to `device` before the cells are made, so tables the cells derive from them
    (folded input projections) are computed there."""
    built = [build_model(model_config) for model_config in models]
    specs, kinds = cell_layout(built)
    modules: dict[str, torch.nn.Module] = {}
    target = device if device.startswith("cuda") else "cpu"  # an unknown device is make_backend's to refuse
    for model in built:
        modules.update(model.make_cells({key: value.to(target) for key, value in model.load_weights().items()}))
    for module in modules.values():
        module.eval()
    return specs, [modules[spec.key] for spec in specs], kinds


def load_version(backend: Backend, message: dict[str, Any], held: HeldRequests | None = None) -> str | None:
    """Build the version the manager sent (`load`) and add its cell types (to the running batch's too, `held`, when
    the manager routes requests whole); returns why it could not be, or None. Its weights are read and checked as
    at start, so a file that does not fit is refused with the same words."""
    try:
        model = model_from_wire(message["model"])
        specs, modules, kinds = build_cells([model], backend.device)
        if [spec.key for spec in specs] != message["cells"]:
            raise ValueError(f"its cell types are {[spec.key for spec in specs]}, the manager's {message['cells']}")
        first = message["first_cell"]
        backend.add_cells(first, specs, modules)
        if held is not None:
            placed = backend.cells[1][first : first + len(specs)]  # the modules as the backend placed them
            held.add_model(build_planner(model), specs, placed, kinds)
    except ConfigError as exc:
        return str(exc)
    except Exception as exc:  # a builder's or a device's failure: the load fails, the worker serves on
        log.exception("loading a model failed")
        return f"{type(exc).__name__}: {exc}"
    log.info("loaded %s: cell types %d to %d", model.name, first, first + len(specs) - 1)
    return None


def unload_version(backend: Backend, indices: list[int], held: HeldRequests | None = None) -> None:
    """Let the cell types of a version the manager unloaded go (`unload`), from the running batch too."""
    if held is not None:
        specs, _ = backend.cells
        held.unload([specs[i].key for i in indices if 0 <= i < len(specs) and specs[i] is not None])
    backend.drop_cells(indices)
