"""The table of model versions on its own, with the planners the manager builds: which version a request
goes to, and how versions change state as loads end in any order."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL_LSTM, write_config

from batchmaker.common.models.base import build_planner
from batchmaker.common.protocol import BAD_REQUEST, SESSION_LOST, UNKNOWN_MODEL, RequestError
from batchmaker.manager.batching.versions import DRAINING, LOADING, READY, UNLOADED, Versions


@pytest.fixture
def versions(tmp_path: Path) -> Versions:
    config = write_config(tmp_path, SMALL_LSTM)
    return Versions({"lstm": build_planner(config.models["lstm"])})


def load(versions: Versions, first_cell: int):
    """A new version of lstm from its first version's table, loading on workers 0 and 1."""
    version = versions.next_version("lstm", versions.by_internal["lstm"].config, build_planner)
    versions.begin(version, first_cell, {0, 1})
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
