"""TOML configuration: server addresses, devices, scheduler policy and the models served.

Every mistake is reported as a ConfigError naming the file, the table and the key,
so that a typo fails at start-up instead of being silently ignored. The [server], [tracing],
[http] and [grpc] tables are read in their own modules (server_config.py, tracing_config.py,
frontdoor_config.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchmaker.common.config_values import ConfigError, check_keys, positive_int, string, subtable
from batchmaker.common.frontdoor_config import GrpcConfig, HttpConfig, parse_door_tables
from batchmaker.common.server_config import ServerConfig, parse_server
from batchmaker.common.tracing_config import TracingConfig, parse_tracing

DEFAULT_CONFIG = "configs/default.toml"
POLICIES = ("cellular", "padded", "graph")
AFFINITIES = ("subgraph", "request")
RUNNING_BATCH = ("auto", "manager", "worker")
VERSION_MARK = "@"  # a model's later versions are served internally as models named "NAME@2", "NAME@3", ...


@dataclass(frozen=True)
class CellTypeConfig:
    """Scheduling settings of one cell type: the paper's Bsizes and priority."""

    batch_sizes: tuple[int, ...]
    priority: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    builder: str
    weights: Path
    params: dict[str, Any]
    default_cell: CellTypeConfig
    cells: dict[str, CellTypeConfig]
    # The file the table was read from (its folder is on the builder's import path): where, not what, so not compared.
    config_path: Path | None = field(default=None, compare=False)

    def cell_config(self, cell_type: str) -> CellTypeConfig:
        return self.cells.get(cell_type, self.default_cell)


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "cellular"
    affinity: str = "subgraph"
    max_tasks_to_submit: int = 5
    idle_tasks: int = 4  # deep enough that the worker never waits for a busy event loop
    bucket_width: int = 10  # padded policy: requests whose lengths fall in one bucket of this width batch together
    max_group_requests: int = 0  # padded and graph policies: requests per batch; 0: the model's largest batch size
    # consecutive waves of the same lanes one task may run (a lone sentence: one task); 1: single steps only
    max_steps_per_task: int = 64
    max_join_delay_us: int = 2000  # a multi-step task's expected duration at a light load (manager.batching.join_delay)
    latency_target_ms: int = 100  # the latency wanted under load: a fifth of it bounds a multi-step task's duration
    # who decides each step: "manager" (tasks) or "worker" (requests routed whole); "auto": resolve_running_batch
    running_batch: str = "auto"


@dataclass(frozen=True)
class Config:
    path: Path
    server: ServerConfig = field(default_factory=ServerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    models: dict[str, ModelConfig] = field(default_factory=dict)
    tracing: TracingConfig | None = None  # None: no [tracing] table, no spans
    http: HttpConfig | None = None  # the Open Inference Protocol front door's listeners; None: off
    grpc: GrpcConfig | None = None


def load_config(path: str | Path) -> Config:
    """Read and check a configuration file."""
    path = Path(path).resolve()
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(raw, path)


def parse_config(raw: dict[str, Any], path: Path) -> Config:
    unknown = set(raw) - {"server", "scheduler", "models", "tracing", "http", "grpc"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown table(s) {sorted(unknown)}; expected server, scheduler, models, tracing, http, grpc"
        )
    server = parse_server(subtable(raw, "server", path), path)
    scheduler = _parse_scheduler(subtable(raw, "scheduler", path), path)
    models_raw = subtable(raw, "models", path)
    if not models_raw:
        raise ConfigError(f"{path}: no [models.NAME] table; at least one model must be served")
    for name in models_raw:
        if VERSION_MARK in name:
            raise ConfigError(f"{path}: [models.{name}] a model's name must not contain {VERSION_MARK!r}")
    models = {name: _parse_model(name, subtable(models_raw, name, path, f"models.{name}"), path) for name in models_raw}
    tracing = parse_tracing(subtable(raw, "tracing", path), path) if "tracing" in raw else None
    http, grpc = parse_door_tables(raw, path)
    return Config(path=path, server=server, scheduler=scheduler, models=models, tracing=tracing, http=http, grpc=grpc)


def _parse_scheduler(table: dict[str, Any], path: Path) -> SchedulerConfig:
    defaults = SchedulerConfig()
    check_keys(table, set(SchedulerConfig.__dataclass_fields__), "scheduler", path)
    policy = table.get("policy", defaults.policy)
    if policy not in POLICIES:
        raise ConfigError(f"{path}: [scheduler] policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    affinity = table.get("affinity", defaults.affinity)
    if affinity not in AFFINITIES:
        raise ConfigError(f"{path}: [scheduler] affinity must be one of {', '.join(AFFINITIES)}, got {affinity!r}")
    return SchedulerConfig(
        policy=policy,
        affinity=affinity,
        max_tasks_to_submit=positive_int(table, "max_tasks_to_submit", defaults.max_tasks_to_submit, "scheduler", path),
        idle_tasks=positive_int(table, "idle_tasks", defaults.idle_tasks, "scheduler", path, minimum=0),
        bucket_width=positive_int(table, "bucket_width", defaults.bucket_width, "scheduler", path),
        max_group_requests=positive_int(
            table, "max_group_requests", defaults.max_group_requests, "scheduler", path, minimum=0
        ),
        max_steps_per_task=positive_int(table, "max_steps_per_task", defaults.max_steps_per_task, "scheduler", path),
        max_join_delay_us=positive_int(table, "max_join_delay_us", defaults.max_join_delay_us, "scheduler", path),
        latency_target_ms=positive_int(table, "latency_target_ms", defaults.latency_target_ms, "scheduler", path),
        running_batch=_running_batch(table, policy, path),
    )


def _running_batch(table: dict[str, Any], policy: str, path: Path) -> str:
    """Who decides each step of the running batch: the manager (tasks) or the workers (requests routed whole)."""
    return checked_running_batch(table.get("running_batch", SchedulerConfig.running_batch), policy, f"{path}: ")


def checked_running_batch(value: Any, policy: str, where: str = "") -> str:
    if value not in RUNNING_BATCH:
        raise ConfigError(f"{where}[scheduler] running_batch must be one of {', '.join(RUNNING_BATCH)}, got {value!r}")
    if value == "worker" and policy != "cellular":
        raise ConfigError(
            f"{where}[scheduler] running_batch = \"worker\" runs the cellular policy; the {policy} policy's batches "
            "are formed by the manager: use running_batch = \"manager\" with it"
        )
    return value


def _parse_cell(table: dict[str, Any], where: str, path: Path, default: CellTypeConfig | None) -> CellTypeConfig:
    if "batch_sizes" not in table and default is None:
        close = difflib.get_close_matches("batch_sizes", [str(key) for key in table], n=1)
        typo = f" ({close[0]!r} is there: a typo?)" if close else ""
        raise ConfigError(
            f"{path}: [{where}] batch_sizes is required{typo}: the batch sizes its cells run at, "
            "e.g. batch_sizes = [1, 2, 4, 8, 16, 32, 64]"
        )
    sizes = table.get("batch_sizes", default.batch_sizes if default else None)
    if (
        not isinstance(sizes, (list, tuple))
        or not sizes
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
    ):
        raise ConfigError(f"{path}: [{where}] batch_sizes must be a non-empty list of positive integers, got {sizes!r}")
    priority = table.get("priority", default.priority if default else 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ConfigError(f"{path}: [{where}] priority must be an integer, got {priority!r}")
    return CellTypeConfig(batch_sizes=tuple(sorted(set(sizes))), priority=priority)


def _parse_model(name: str, table: dict[str, Any], path: Path) -> ModelConfig:
    where = f"models.{name}"
    builder = string(table, "builder", None, where, path)
    if ":" not in builder:
        raise ConfigError(f"{path}: [{where}] builder must look like \"package.module:function\", got {builder!r}")
    weights = Path(string(table, "weights", None, where, path))
    if not weights.is_absolute():
        weights = (path.parent / weights).resolve()
    default_cell = _parse_cell(table, where, path, None)
    cells_raw = subtable(table, "cells", path, f"{where}.cells")
    cells = {}
    for cell_name, cell_table in cells_raw.items():
        cell_where = f"{where}.cells.{cell_name}"
        if not isinstance(cell_table, dict):
            raise ConfigError(f"{path}: [{cell_where}] must be a table")
        check_keys(cell_table, {"batch_sizes", "priority"}, cell_where, path)
        cells[cell_name] = _parse_cell(cell_table, cell_where, path, default_cell)
    params = {k: v for k, v in table.items() if k not in {"builder", "weights", "batch_sizes", "priority", "cells"}}
    return ModelConfig(
        name=name, builder=builder, weights=weights, params=params, default_cell=default_cell, cells=cells,
        config_path=path,
    )


def with_policy(config: Config, policy: str) -> Config:
    """The config with its scheduler policy replaced (`batchmaker serve --policy`)."""
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    checked_running_batch(config.scheduler.running_batch, policy)
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, policy=policy))


def with_running_batch(config: Config, running_batch: str) -> Config:
    """The config with who decides each step replaced (`batchmaker serve --running-batch`)."""
    checked_running_batch(running_batch, config.scheduler.policy)
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, running_batch=running_batch))


def resolve_running_batch(config: Config, devices: list[str]) -> Config:
    """The config with `running_batch = "auto"` made definite for the devices its workers run on: the workers decide
    the steps of the cellular policy on two CPU workers or more (each runs its own batch, where the manager's steps
    gain nothing from a second worker); the manager decides them for one CPU worker (its per-step work runs on a
    core of its own beside the worker's cells), on GPUs (its tasks reach the stream ahead of time) and for the
    baseline policies."""
    if config.scheduler.running_batch != "auto":
        return config
    cpus = config.scheduler.policy == "cellular" and len(devices) > 1 and all(device == "cpu" for device in devices)
    return with_running_batch(config, "worker" if cpus else "manager")


def with_door_addresses(config: Config, http: str | None, grpc: str | None) -> Config:
    """The config with the front door's listeners set (`batchmaker serve --http ADDRESS --grpc ADDRESS`)."""
    given = {name: {"address": address} for name, address in (("http", http), ("grpc", grpc)) if address is not None}
    parsed = parse_door_tables(given, config.path)
    changes = {}
    for name, table in zip(("http", "grpc"), parsed):
        if table is not None:
            old = getattr(config, name)
            changes[name] = table if old is None else dataclasses.replace(old, address=table.address)
    return dataclasses.replace(config, **changes)


def with_metrics_address(config: Config, address: str) -> Config:
    """The config with its metrics address replaced (`batchmaker serve --metrics-address`)."""
    if address and ":" not in address:
        raise ConfigError(f'--metrics-address must look like "127.0.0.1:9100" (or "" for none), got {address!r}')
    return dataclasses.replace(config, server=dataclasses.replace(config.server, metrics_address=address))


def model_to_wire(model: ModelConfig) -> dict[str, Any]:
    """A model's table as the manager sends it to workers that load it at run time (msgpack-ready)."""
    def cell(settings: CellTypeConfig) -> dict[str, Any]:
        return {"batch_sizes": list(settings.batch_sizes), "priority": settings.priority}

    return {
        "name": model.name, "builder": model.builder, "weights": str(model.weights), "params": model.params,
        "default_cell": cell(model.default_cell), "cells": {name: cell(c) for name, c in model.cells.items()},
        "config_path": None if model.config_path is None else str(model.config_path),
    }  # fmt: skip


def model_from_wire(wire: dict[str, Any]) -> ModelConfig:
    """The inverse of `model_to_wire`."""
    def cell(settings: dict[str, Any]) -> CellTypeConfig:
        return CellTypeConfig(tuple(settings["batch_sizes"]), settings["priority"])

    return ModelConfig(
        name=wire["name"], builder=wire["builder"], weights=Path(wire["weights"]), params=wire["params"],
        default_cell=cell(wire["default_cell"]), cells={name: cell(c) for name, c in wire["cells"].items()},
        config_path=None if wire["config_path"] is None else Path(wire["config_path"]),
    )  # fmt: skip
