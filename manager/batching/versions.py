"""The served models' versions: which one serves a request, and the state of each.

Each version is a model of its own inside the server: version 1 keeps the model's name, a later one is built
under `NAME@N`, so its cell types (`lstm@2/layer0`) are its own and the cells of two versions never batch
together. Nothing past admission needs to know about versions: a request is admitted to one version's planner
and keeps it, through replays after a worker loss, until it is answered. This table is the one owner of the
versions' states (docs/deploy.md, "Rolling out new weights").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchmaker.common.config import VERSION_MARK, ModelConfig
from batchmaker.common.models.base import Planner
from batchmaker.common.protocol import BAD_REQUEST, SESSION_LOST, UNKNOWN_MODEL, RequestError, echo

LOADING = "loading"  # the workers are loading its weights; no request goes to it yet
READY = "ready"  # serves requests; the newest ready version serves those that name none
DRAINING = "draining"  # a newer one is ready, or the model is being unloaded: it finishes what it started
UNLOADED = "unloaded"  # nothing uses it any more; its weights have left the workers
FAILED = "failed"  # its load failed (`reason` says why); the versions before it serve on
LIVE = (LOADING, READY, DRAINING)  # states whose cells the workers hold


def internal_name(model: str, number: int) -> str:
    return model if number == 1 else f"{model}{VERSION_MARK}{number}"


def served_name(internal: str) -> str:
    """The name clients use for a version's model (the name metrics and logs show)."""
    return internal.partition(VERSION_MARK)[0]


@dataclass
class Version:
    model: str
    number: int
    config: ModelConfig  # named after the version (`internal_name`): what workers build
    planner: Planner
    state: str = LOADING
    reason: str | None = None  # why it failed
    first_cell: int = 0  # the index of its first cell type in the manager's and the workers' order
    # While it loads: the workers asked to load it that have not answered, the registered ones that loaded it,
    # those lost meanwhile (with why), when it began, and how long it waits for a worker while it has none to ask.
    waiting_on: set[int] = field(default_factory=set)
    built: set[int] = field(default_factory=set)
    lost: dict[int, str] = field(default_factory=dict)
    started: float = 0.0
    wait_s: float = 0.0

    @property
    def internal(self) -> str:
        return self.config.name

    def ask(self, worker_id: int) -> None:
        """A worker was sent the load: the version waits for its answer."""
        self.waiting_on.add(worker_id)

    def built_on(self, worker_id: int) -> None:
        self.waiting_on.discard(worker_id)
        self.built.add(worker_id)

    def worker_lost(self, worker_id: int, why: str) -> None:
        """A worker was lost: one that was loading it, or had, no longer counts as having it."""
        if worker_id in self.waiting_on or worker_id in self.built:
            self.lost[worker_id] = why
        self.waiting_on.discard(worker_id)
        self.built.discard(worker_id)

    def outcome(self, now: float) -> tuple[str, str] | None:
        """How the load ended, (READY, "") or (FAILED, why), once it has; None while it waits. It serves only once
        every worker asked has answered and one that loaded it is still registered, so that it never serves with
        no worker able to run it; with every such worker lost, it fails. A load with no worker to ask waits
        `wait_s` for one to register."""
        if self.waiting_on:
            return None
        if self.built:
            return READY, ""
        if self.lost:
            lost = [f"worker {worker} was lost before the load ended ({why})" for worker, why in self.lost.items()]
            return FAILED, f"{'; '.join(lost)}; no worker left has it"
        if now - self.started >= self.wait_s:
            return FAILED, f"no worker registered to load it within {self.wait_s:g} s ([server] load_wait_ms)"
        return None

    def retire(self, state: str, reason: str | None = None) -> None:
        """It serves no more (unloaded, or its load failed): the plans it cached go with it, since nothing will
        plan with it again and a server reloaded many times would otherwise keep every version's."""
        self.state, self.reason = state, reason
        self.planner.plan_cache = None

    @property
    def cell_indices(self) -> list[int]:
        return list(range(self.first_cell, self.first_cell + len(self.planner.cell_types)))


class Versions:
    """Every version of every model ever loaded, by model name and by internal name."""

    def __init__(self, planners: dict[str, Planner]):
        self._by_model: dict[str, list[Version]] = {}
        self.by_internal: dict[str, Version] = {}
        self._unloading: set[str] = set()  # models unloaded as a whole: their versions serve nothing new
        for name, planner in planners.items():
            self._add(Version(name, 1, planner.config, planner, READY))
        keys = sorted(spec.key for planner in planners.values() for spec in planner.cell_types.values())
        for index, key in reversed(list(enumerate(keys))):  # the startup layout: every cell type sorted by key
            self.by_internal[key.partition("/")[0]].first_cell = index

    def _add(self, version: Version) -> None:
        self._by_model.setdefault(version.model, []).append(version)
        self.by_internal[version.internal] = version

    @property
    def served(self) -> list[str]:
        """The models requests may name now."""
        return [name for name in self._by_model if self._ready(name)]

    def _ready(self, model: str) -> list[Version]:
        if model in self._unloading:
            return []
        return [v for v in self._by_model.get(model, []) if v.state == READY]

    def resolve(self, model: Any, version: Any, pinned: str | None) -> Planner:
        """The planner of the version a request goes to: the one it names, else its session's (`pinned`,
        the internal name of the version the session started on), else the newest ready one."""
        if not isinstance(model, str):
            raise RequestError(BAD_REQUEST, "request lacks 'model' (the name of a served model)")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
            raise RequestError(BAD_REQUEST, f"'version' must be an integer >= 1, got {echo(version)}")
        ready = self._ready(model)
        if not ready:
            raise RequestError(UNKNOWN_MODEL, f"no model named {echo(model)}; this server has {', '.join(self.served)}")
        if version is not None:
            chosen = next((v for v in ready if v.number == version), None)
            if chosen is None:
                numbers = ", ".join(str(v.number) for v in ready)
                raise RequestError(UNKNOWN_MODEL, f"model {model!r} has no ready version {version}; ready: {numbers}")
            return chosen.planner
        session = self.by_internal.get(pinned) if pinned is not None else None
        if session is not None and session.model == model:
            if session.state not in (READY, DRAINING):
                raise RequestError(
                    SESSION_LOST, f"the session's version {session.number} of model {model!r} was unloaded; "
                    "start a new session under another name",
                )  # fmt: skip
            return session.planner
        return ready[-1].planner

    def number_of(self, planner: Planner) -> int:
        return self.by_internal[planner.name].number

    def next_version(self, model: str, config: ModelConfig, planner_of: Callable[[ModelConfig], Planner]) -> Version:
        """A new version of `model` (loading), built from `config` under its internal name by `planner_of`."""
        number = 1 + max((v.number for v in self._by_model.get(model, [])), default=0)
        renamed = dataclasses.replace(config, name=internal_name(model, number))
        return Version(model, number, renamed, planner_of(renamed))

    def begin(self, version: Version, first_cell: int, workers: set[int], now: float, wait_s: float) -> None:
        """Start loading `version` on `workers`: its cell types take the indices from `first_cell` on. With no
        worker, it waits `wait_s` from `now` for one to register."""
        version.first_cell, version.waiting_on = first_cell, set(workers)
        version.started, version.wait_s = now, wait_s
        self._add(version)

    def loading(self) -> list[Version]:
        return [v for v in self.by_internal.values() if v.state == LOADING]

    def ready(self, version: Version) -> list[Version]:
        """`version` has loaded: it serves from now on, and the older versions of its model drain (returned),
        unless a newer one loaded first, which it then leaves serving (it drains at once itself)."""
        self._unloading.discard(version.model)
        serving = [v for v in self._by_model[version.model] if v.state == READY]
        if any(v.number > version.number for v in serving):
            version.state = DRAINING
            return []
        version.state = READY
        for each in serving:
            each.state = DRAINING
        return serving

    def unload(self, model: str) -> list[Version]:
        """Stop serving `model`: its versions drain, finishing what they started. Returns them."""
        live = self.check_unload(model)
        self._unloading.add(model)
        for version in live:
            version.state = DRAINING
        return live

    def check_unload(self, model: str) -> list[Version]:
        """The versions an unload of `model` drains; RequestError when it cannot be unloaded now."""
        live = [v for v in self._by_model.get(model, []) if v.state in (READY, DRAINING)]
        if model in self._unloading or not live:
            raise RequestError(UNKNOWN_MODEL, f"no model named {echo(model)}; this server has {', '.join(self.served)}")
        loading = [v.number for v in self._by_model[model] if v.state == LOADING]
        if loading:
            raise RequestError(
                BAD_REQUEST, f"version {loading[0]} of model {model!r} is loading; unload the model once it has loaded"
            )
        return live

    def draining(self) -> list[tuple[Version, bool]]:
        """The draining versions, each with whether its sessions still hold it (they do unless its model is
        being unloaded as a whole, when a session's next request finds no model)."""
        return [(v, v.model not in self._unloading) for v in self.by_internal.values() if v.state == DRAINING]

    def plan_caches(self) -> dict[str, dict[str, int]]:
        """The plan caches of the versions that keep one, by internal name (`stats`)."""
        return {
            internal: version.planner.plan_cache.snapshot()
            for internal, version in self.by_internal.items()
            if version.planner.plan_cache is not None
        }

    def describe(self) -> dict[str, Any]:
        """The `models` reply: each model served (its newest ready version's description, its versions and their
        states), and the versions of those no longer served ("unloaded")."""
        served, unloaded = {}, {}
        for name, versions in self._by_model.items():
            listing = [
                {"version": v.number, "state": v.state, **({"reason": v.reason} if v.reason else {})} for v in versions
            ]
            if not self._ready(name):
                unloaded[name] = listing
                continue
            model = self._ready(name)[-1].planner
            entry = model.describe()
            if model.random_weights:
                entry["random_weights"] = True
            if model.can_stream:
                entry["stream"] = True
            entry["cell_types"] = {
                spec.key: {"batch_sizes": list(spec.batch_sizes), "priority": spec.priority}
                for spec in model.cell_types.values()
            }
            served[name] = {**entry, "version": self.number_of(model), "versions": listing}
        return {"models": served, "unloaded": unloaded}
