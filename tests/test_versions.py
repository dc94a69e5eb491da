"""The table of model versions on its own, with the planners the manager builds: which version a request
goes to, how a load ends as its workers answer, are lost or never come, and how versions change state as loads
end in any order; and a failed load's cell types leaving the batching core."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import SMALL_LSTM, write_config

from batchmaker.common.models.base import build_planner
from batchmaker.common.protocol import BAD_REQUEST, SESSION_LOST, UNKNOWN_MODEL, RequestError
from batchmaker.manager.batching.versions import DRAINING, FAILED, LOADING, READY, UNLOADED, Versions


@pytest.fixture
def versions(tmp_path: Path) -> Versions:
    config = write_config(tmp_path, SMALL_LSTM)
    return Versions({"lstm": build_planner(config.models["lstm"])})


def load(
    versions: Versions,
    first_cell: int = 1,
    workers: frozenset[int] = frozenset({0, 1}),
    now: float = 0.0,
    wait_s: float = 60.0,
):
    """A new version of lstm from its first version's table, loading on `workers` from `now` (with none, it waits
    `wait_s` for one)."""
    version = versions.next_version("lstm", versions.by_internal["lstm"].config, build_planner)
    versions.begin(version, first_cell, set(workers), now, wait_s)
    return version


def test_a_version_that_loads_after_a_newer_one_never_serves(versions: Versions):
    second, third = load(versions, 1), load(versions, 2)
    assert (second.internal, third.internal) == ("lstm@2", "lstm@3")
    assert [spec.key for spec in third.planner.cell_types.values()] == ["lstm@3/layer0"]
    assert versions.ready(third) == [versions.by_internal["lstm"]]
    assert versions.ready(second) == []
    states = {v.number: v.state for v in versions.by_internal.values()}
    assert states == {1: DRAINING, 2: DRAINING, 3: READY}
    assert versions.resolve("lstm", None, None) is third.planner


def test_requests_go_to_the_version_they_name_else_their_sessions_else_the_newest(versions: Versions):
    first = versions.by_internal["lstm"]
    second = load(versions, 1)
    assert versions.resolve("lstm", None, None) is first.planner  # version 2 is still loading
    with pytest.raises(RequestError) as loading:
        versions.resolve("lstm", 2, None)
    assert loading.value.code == UNKNOWN_MODEL
    assert loading.value.message == "model 'lstm' has no ready version 2; ready: 1"
    versions.ready(second)
    assert versions.resolve("lstm", None, None) is second.planner
    assert versions.resolve("lstm", None, "lstm") is first.planner  # a session that started on version 1
    assert versions.resolve("lstm", 2, "lstm") is second.planner  # named: the session's check refuses it later
    for model, version, code in [("gru", None, UNKNOWN_MODEL), (5, None, BAD_REQUEST), ("lstm", True, BAD_REQUEST)]:
        with pytest.raises(RequestError) as refused:
            versions.resolve(model, version, None)
        assert refused.value.code == code


def test_a_model_cannot_be_unloaded_while_a_version_of_it_loads(versions: Versions):
    second = load(versions, 1)
    with pytest.raises(RequestError) as refused:
        versions.unload("lstm")
    assert refused.value.code == BAD_REQUEST and "version 2 of model 'lstm' is loading" in refused.value.message
    assert second.state == LOADING and versions.by_internal["lstm"].state == READY
    versions.ready(second)
    assert [v.number for v in versions.unload("lstm")] == [1, 2]
    with pytest.raises(RequestError) as gone:
        versions.resolve("lstm", None, "lstm")
    assert gone.value.code == UNKNOWN_MODEL
    versions.by_internal["lstm"].retire(UNLOADED)
    versions.ready(load(versions, 2))  # the model loaded again: a session of its version 1 is lost
    with pytest.raises(RequestError) as lost:
        versions.resolve("lstm", None, "lstm")
    assert lost.value.code == SESSION_LOST and "version 1 of model 'lstm' was unloaded" in lost.value.message
    assert versions.resolve("lstm", None, None).name == "lstm@3"


def test_a_load_ends_once_every_worker_asked_has_answered_and_serves_if_one_that_built_it_remains(versions: Versions):
    version = load(versions)
    assert version.outcome(0.0) is None
    version.built_on(0)
    assert version.outcome(0.0) is None  # worker 1 has not answered
    version.worker_lost(1, "silent for 3.0 s")
    assert version.outcome(0.0) == (READY, "")
    other = load(versions)
    other.built_on(0)
    other.worker_lost(0, "process exited with status -9")  # it built it, then went: it has it no more
    assert other.outcome(0.0) is None
    other.ask(2)  # a worker that registered meanwhile
    other.built_on(1)
    assert other.outcome(0.0) is None
    other.built_on(2)
    assert other.outcome(0.0) == (READY, "")


def test_a_load_whose_workers_were_all_lost_fails_naming_them(versions: Versions):
    version = load(versions)
    version.worker_lost(7, "silent for 3.0 s")  # not one of its workers: nothing changes
    assert version.outcome(0.0) is None and version.lost == {}
    version.worker_lost(0, "process exited with status -9")
    version.built_on(1)
    version.worker_lost(1, "silent for 3.0 s")
    why = (
        "worker 0 was lost before the load ended (process exited with status -9); "
        "worker 1 was lost before the load ended (silent for 3.0 s); no worker left has it"
    )
    assert version.outcome(0.0) == (FAILED, why)


def test_a_load_with_no_worker_waits_for_one_until_its_wait_runs_out(versions: Versions):
    alone = load(versions, workers=frozenset(), now=100.0)
    assert alone.outcome(100.0) is None and alone.outcome(159.9) is None
    assert alone.outcome(160.0) == (FAILED, "no worker registered to load it within 60 s ([server] load_wait_ms)")
    joined = load(versions, workers=frozenset(), now=100.0)
    joined.ask(3)  # a worker registered in time: its answer decides, however long it takes
    assert joined.outcome(500.0) is None
    joined.built_on(3)
    assert joined.outcome(500.0) == (READY, "")
    refused = load(versions, workers=frozenset(), now=100.0, wait_s=0.0)  # load_wait_ms = 0: a load needs a worker now
    assert refused.outcome(100.0) == (FAILED, "no worker registered to load it within 0 s ([server] load_wait_ms)")


def test_a_failed_loads_cell_types_leave_the_scheduler_and_their_indices_are_never_given_again(make_harness):
    h = make_harness(SMALL_LSTM)
    config = h.models["lstm"].config
    second, third = (
        list(build_planner(dataclasses.replace(config, name=f"lstm@{n}")).cell_types.values()) for n in (2, 3)
    )
    assert h.core.add_cell_types(second) == 1
    assert list(h.scheduler.queues) == ["lstm/layer0", "lstm@2/layer0"]
    h.core.remove_cell_types(second)
    h.core.workers_changed()  # the warm-up capacity is figured over the cell types left
    assert list(h.scheduler.queues) == ["lstm/layer0"]
    assert h.core.add_cell_types(third) == 2  # a worker that loaded version 2 holds index 1 until it drops it
    assert h.scheduler.queues["lstm@3/layer0"].index == 2
    h.admit("lstm", {"tokens": [1, 2]})
    assert [queue.spec.key for queue in h.scheduler.choose_cell_types()] == ["lstm/layer0"]
    h.run_on_cpu()
    assert [error for _, error in h.finished] == [None]
