"""Models loaded, unloaded and reloaded while the server runs (the `load`, `unload` and `reload` ops, SIGHUP).

A load makes a new version of a model (manager.batching.versions): its planner is built and its cell types
added here first, so that a model that cannot be served is refused before anything changes; then every live
worker, and every worker that registers while it loads, is told to build it and load its weights, which checks
them as the start-up preflight does. The version serves once every worker asked has answered and one that loaded
it is still registered: a version never serves with no worker able to run it, which would leave the old version
draining and every worker that joins failing the load. A worker that cannot load it fails the load with its
reason; a worker lost meanwhile only leaves it (with none left that has it, the load fails); with no worker
registered, the load waits `[server] load_wait_ms` for one. A load that fails takes its cell types away again,
and the versions before it serve on. A version replaced or unloaded drains: once no request in flight (nor, after
a reload, a live session) uses it, the workers drop its weights. Every reply to a load waits for the load's outcome.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchmaker.common.config import Config, ConfigError, ModelConfig, load_config, model_to_wire
from batchmaker.common.models.base import build_planner, cell_layout
from batchmaker.common.protocol import BAD_REQUEST, RequestError, echo
from batchmaker.manager.batching.core import BatchingCore
from batchmaker.manager.batching.routed import RoutedRequests
from batchmaker.manager.batching.versions import FAILED, LIVE, LOADING, READY, UNLOADED, Version
from batchmaker.manager.batching.worker_handle import WorkerHandle
from batchmaker.manager.loop.frontend import Incoming
from batchmaker.manager.loop.worker_pool import WorkerPool

log = logging.getLogger("batchmaker.manager")

Reply = Callable[[Incoming, "dict[str, Any] | RequestError"], None]


@dataclass
class _Waiter:
    """A call whose reply waits for loads to end: what it says when they have."""

    incoming: Incoming | None  # None: a SIGHUP, whose outcome is logged
    loading: set[str]  # internal names of the versions still loading
    answer: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class ModelControl:
    def __init__(
        self,
        config: Config,
        core: BatchingCore,
        routed: RoutedRequests,
        pool: WorkerPool,
        reply: Reply,
        reread: Callable[[], Config],
        served: Callable[[str], None],
    ):
        """`routed`: the requests routed whole to workers, which hold versions in use as the core's do; `reply`
        answers a call once its loads are done; `reread` reads the config file again; `served` is told of each model
        that serves a new version (the metrics label its requests from then on)."""
        self._config = config
        self._core = core
        self._routed = routed
        self._versions = core.versions
        self._pool = pool
        self._reply = reply
        self._reread = reread
        self._served = served
        self._waiters: list[_Waiter] = []
        self._stamps = {name: _stamp(model.weights) for name, model in config.models.items()}

    # -- ops -----------------------------------------------------------------------------------
    def load(self, incoming: Incoming) -> None:
        """`{"op": "load", "model": NAME, "weights": PATH, "config": FILE}`: a new version of NAME."""
        message = incoming.message
        name = _model_name(message, "load")
        config_file, weights = (_optional_path(message, key) for key in ("config", "weights"))
        if config_file is not None:
            model = _model_in(config_file, name)
        elif (newest := self._newest_config(name)) is not None:
            model = newest
        else:
            raise RequestError(
                BAD_REQUEST, f"no model named {echo(name)} was served here: send 'config', a file with its table"
            )
        if weights is not None:
            model = dataclasses.replace(model, weights=weights)
        version = self._start(self._prepare(name, model))
        self._wait(incoming, [version], {"model": name, "version": version.number})

    def unload(self, incoming: Incoming) -> dict[str, Any]:
        """`{"op": "unload", "model": NAME}`: NAME serves nothing new; its versions drain."""
        name = _model_name(incoming.message, "unload")
        versions = self._versions.unload(name)
        log.info("unloading model %s (versions %s)", name, ", ".join(str(v.number) for v in versions))
        return {"model": name, "draining": [v.number for v in versions]}

    def reload(self, incoming: Incoming | None) -> None:
        """`{"op": "reload"}` or SIGHUP: read the config file again and apply its models' changes."""
        try:
            new = self._reread()
        except ConfigError as exc:
            raise RequestError(BAD_REQUEST, f"the config was not reloaded: {exc}") from None
        fixed = _fixed_changes(self._config, new)
        if fixed:
            raise RequestError(
                BAD_REQUEST, f"the config was not reloaded: {', '.join(fixed)} cannot change while the server runs; "
                "restart it to apply them, or put them back",
            )  # fmt: skip
        served = set(self._versions.served)
        changed = [name for name, model in new.models.items() if name not in served or self._changed(name, model)]
        removed = sorted(served - set(new.models))
        prepared = [self._prepare(name, new.models[name]) for name in changed]  # any refusal comes before a change
        for name in removed:
            self._versions.check_unload(name)
        started = [self._start(version) for version in prepared]
        for name in removed:
            self._versions.unload(name)
        self._config = new
        answer = {"loaded": {v.model: v.number for v in started}, "unloaded": removed}
        log.info("config reloaded: loading %s, unloading %s", changed or "nothing", removed or "nothing")
        self._wait(incoming, started, answer)

    # -- loads ---------------------------------------------------------------------------------
    def _prepare(self, name: str, model: ModelConfig) -> Version:
        """A new version of `name`, checked as far as the manager can (RequestError if it cannot be served)."""
        if self._config.scheduler.policy != "cellular":
            raise RequestError(
                BAD_REQUEST,
                f"models load at run time under the cellular policy only, not {self._config.scheduler.policy!r}",
            )
        try:
            version = self._versions.next_version(name, model, build_planner)
        except ConfigError as exc:
            raise RequestError(BAD_REQUEST, str(exc)) from None
        self._core.check_cell_types(cell_layout([version.planner])[0])
        return version

    def _start(self, version: Version) -> Version:
        """Load a prepared version on every worker; it serves once they have answered (`Version.outcome`)."""
        first = self._core.add_cell_types(cell_layout([version.planner])[0])
        wait_s = self._config.server.load_wait_ms / 1e3
        self._versions.begin(version, first, set(self._core.workers), time.monotonic(), wait_s)
        self._stamps[version.internal] = _stamp(version.config.weights)
        for worker in self._core.workers.values():
            self._send(worker, version)
        log.info("loading version %d of model %s from %s", version.number, version.model, version.config.weights)
        if not self._core.workers:
            log.warning("no worker is registered to load version %d of model %s: it waits up to %g s for one",
                        version.number, version.model, wait_s)  # fmt: skip
        return version

    def _send(self, worker: WorkerHandle, version: Version) -> None:
        keys = [spec.key for spec in cell_layout([version.planner])[0]]
        self._pool.load(worker, model_to_wire(version.config), version.first_cell, keys)

    def loaded(self, worker: WorkerHandle, internal: str, error: str | None) -> None:
        """A worker's answer to a load."""
        version = self._versions.by_internal.get(internal)
        if version is None or version.state not in LIVE:
            return
        if version.state != LOADING:
            if error is not None:  # a worker that joined could not load a serving version
                log.error("worker %d cannot load %s (%s); stopping it", worker.worker_id, internal, error)
                self._pool.stop(worker)
            return
        if error is not None:
            self._fail(version, f"worker {worker.worker_id} could not load it: {error}")
            return
        version.built_on(worker.worker_id)
        self._settle(version)

    def worker_joined(self, worker: WorkerHandle) -> None:
        """A worker registered with the models the manager started with: it loads every later version, those
        still loading included (their loads wait for it), and drops what no longer serves, before it runs any
        task."""
        for version in self._versions.by_internal.values():
            if version.first_cell >= len(self._pool.start_cells) and version.state in LIVE:
                self._send(worker, version)
                if version.state == LOADING:
                    version.ask(worker.worker_id)
            elif version.first_cell < len(self._pool.start_cells) and version.state not in LIVE:
                self._pool.unload(worker, version.cell_indices)

    def worker_gone(self, worker: WorkerHandle, why: str) -> None:
        """A worker was lost: the loads it took part in go on without it."""
        for version in self._versions.loading():
            version.worker_lost(worker.worker_id, why)
            self._settle(version)

    def _settle(self, version: Version) -> None:
        """End a load whose outcome is known."""
        outcome = version.outcome(time.monotonic())
        if outcome is None:
            return
        state, reason = outcome
        if state == READY:
            self._ready(version)
        else:
            self._fail(version, reason)

    def _ready(self, version: Version) -> None:
        for older in self._versions.ready(version):
            log.info("version %d of model %s drains: version %d serves", older.number, older.model, version.number)
        log.info("version %d of model %s loaded (%s)", version.number, version.model, version.state)
        self._served(version.model)
        self._ended(version, None)

    def _fail(self, version: Version, reason: str) -> None:
        """The load failed: the workers that loaded it drop it and its cell types leave; its entry stays, failed,
        with why."""
        version.retire(FAILED, reason)
        log.error("version %d of model %s failed to load: %s", version.number, version.model, reason)
        self._drop(version)
        self._core.remove_cell_types(cell_layout([version.planner])[0])
        del self._stamps[version.internal]
        self._ended(version, reason)

    def _ended(self, version: Version, failure: str | None) -> None:
        """Answer the calls that waited for this load, once nothing else they wait for is loading."""
        for waiter in list(self._waiters):
            if version.internal not in waiter.loading:
                continue
            waiter.loading.discard(version.internal)
            if failure is not None:
                waiter.failures.append(f"version {version.number} of model {version.model!r}: {failure}")
            if not waiter.loading:
                self._waiters.remove(waiter)
                self._answer(waiter)

    def _wait(self, incoming: Incoming | None, versions: list[Version], answer: dict[str, Any]) -> None:
        waiter = _Waiter(incoming, {v.internal for v in versions}, answer)
        if waiter.loading:
            self._waiters.append(waiter)
        else:
            self._answer(waiter)

    def _answer(self, waiter: _Waiter) -> None:
        if waiter.incoming is None:
            return
        if waiter.failures:
            self._reply(waiter.incoming, RequestError(BAD_REQUEST, "; ".join(waiter.failures)))
        else:
            self._reply(waiter.incoming, waiter.answer)

    # -- every watch interval --------------------------------------------------------------------
    def watch(self) -> None:
        """A load that waited too long for a worker fails; a draining version that nothing uses any more leaves
        the workers."""
        for version in self._versions.loading():
            self._settle(version)
        for version, by_sessions in self._versions.draining():
            if not self._core.in_use(version.planner, by_sessions) and not self._routed.uses(version.planner):
                version.retire(UNLOADED)
                self._drop(version)
                log.info("version %d of model %s unloaded", version.number, version.model)

    def _drop(self, version: Version) -> None:
        for worker in self._core.workers.values():
            self._pool.unload(worker, version.cell_indices)

    # -- helpers -------------------------------------------------------------------------------
    def _newest_config(self, name: str) -> ModelConfig | None:
        """The table of the newest version of `name` that loaded, under the model's own name."""
        versions = [v for v in self._versions.by_internal.values() if v.model == name and v.state != FAILED]
        return dataclasses.replace(versions[-1].config, name=name) if versions else None

    def _changed(self, name: str, model: ModelConfig) -> bool:
        """Whether the config's table of a served model differs from its newest version's, or its weights file
        was rewritten since that version loaded."""
        newest = [v for v in self._versions.by_internal.values() if v.model == name and v.state == READY][-1]
        rewritten = self._stamps[newest.internal] != _stamp(model.weights)
        return rewritten or dataclasses.replace(newest.config, name=name) != model


def _model_name(message: dict[str, Any], op: str) -> str:
    name = message.get("model")
    if not isinstance(name, str) or not name:
        raise RequestError(BAD_REQUEST, f"{op} lacks 'model' (the name of a model), got {echo(name)}")
    return name


def _optional_path(message: dict[str, Any], key: str) -> Path | None:
    value = message.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(BAD_REQUEST, f"'{key}' must be a path (a string), got {echo(value)}")
    return Path(value).resolve()


def _model_in(config_file: Path, name: str) -> ModelConfig:
    try:
        models = load_config(config_file).models
    except ConfigError as exc:
        raise RequestError(BAD_REQUEST, str(exc)) from None
    if name not in models:
        raise RequestError(BAD_REQUEST, f"{config_file} has no [models.{name}] table; it has {', '.join(models)}")
    return models[name]


def _fixed_changes(old: Config, new: Config) -> list[str]:
    """The settings that differ between two configs and cannot change at run time: every one but the models."""
    tracing = ["[tracing]"] if old.tracing != new.tracing else []
    return [
        f"[{table}] {item.name}"
        for table in ("server", "scheduler")
        for item in dataclasses.fields(getattr(old, table))
        if getattr(getattr(old, table), item.name) != getattr(getattr(new, table), item.name)
    ] + tracing


def _stamp(path: Path) -> tuple[int, int] | None:
    """A weights file's modification time and size: a file rewritten in place is a change."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size
