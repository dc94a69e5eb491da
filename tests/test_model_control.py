"""Models loaded, reloaded and unloaded while a real server serves a steady load through the project's client, with
the manager deciding each step and with the workers running their own batches."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path
from typing import Any, Self

import numpy as np
import pytest
from conftest import SMALL_LSTM, start_server, stop_server, wait_until, with_faults, write_config
from test_raw_protocol import RawClient

from batchmaker.clients import AsyncClient, Client, ServerError
from batchmaker.common.config import Config
from batchmaker.common.models import build_model
from batchmaker.common.models.base import save_weights
from batchmaker.common.protocol import BAD_REQUEST, INVALID_INPUT, UNKNOWN_MODEL, map_to_tensor

TOLERANCE = 1e-5
RUNNING_BATCH = pytest.mark.parametrize("running_batch", ["manager", "worker"])  # who decides each step


def weights_file(config: Config, name: str, seed: int) -> Path:
    """Other weights for the config's LSTM, as retraining would give."""
    model = build_model(config.models["lstm"])
    path = config.path.parent / name
    save_weights(model.init_weights(seed), path)
    return path


def reference(config: Config, weights: Path) -> Any:
    """The unbatched reference of the config's LSTM on `weights`: tokens (and a session's state) -> outputs."""
    model = build_model(config.models["lstm"])
    state = model.load_weights() if weights == config.models["lstm"].weights else _read(weights)
    return lambda inputs: model.reference(state, inputs)


def _read(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, weights_only=True)


def assert_matches(outputs: dict[str, Any], expected: dict[str, Any]) -> None:
    for name in ("h", "c"):
        np.testing.assert_allclose(outputs[name], expected[name], atol=TOLERANCE, rtol=0)


def versions(client: Client, model: str = "lstm") -> dict[int, str]:
    listing = client.models()
    entries = listing["models"][model]["versions"] if model in listing["models"] else listing["unloaded"][model]
    return {entry["version"]: entry["state"] for entry in entries}


class SteadyLoad:
    """Clients sending requests back to back on a thread of their own until stopped; every reply kept."""

    def __init__(self, address: str, clients: int = 3):
        self.replies: list[tuple[list[int], Any]] = []
        self.failures: list[BaseException] = []
        self._address, self._clients = address, clients
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def seen(self, version: int) -> int:
        return sum(1 for _, reply in list(self.replies) if reply.version == version)

    async def _run(self) -> None:
        async with AsyncClient(self._address, timeout=120) as client:
            await asyncio.gather(*(self._loop(client, seed) for seed in range(self._clients)))

    async def _loop(self, client: AsyncClient, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self._stop.is_set():
            tokens = rng.integers(0, 1000, size=int(rng.integers(1, 40))).tolist()
            try:
                self.replies.append((tokens, await client.infer("lstm", {"tokens": tokens})))
            except Exception as exc:
                self.failures.append(exc)


@RUNNING_BATCH
def test_a_reload_under_load_fails_nothing_and_sessions_finish_on_their_version(tmp_path: Path, running_batch: str):
    config = write_config(tmp_path, SMALL_LSTM, scheduler=f'running_batch = "{running_batch}"')
    old, new = config.models["lstm"].weights, weights_file(config, "lstm-retrained.pt", seed=11)
    references = {1: reference(config, old), 2: reference(config, new)}
    server = start_server(config, workers=2)
    try:
        with server.client() as client, SteadyLoad(server.address) as load:
            first = client.infer("lstm", {"tokens": [5, 6, 7]}, session="kept")
            assert first.version == 1
            wait_until(lambda: load.seen(1) >= 20, "requests served by version 1")
            reply = client.call({"op": "load", "model": "lstm", "weights": str(new)})
            assert reply["ok"] and reply["version"] == 2
            wait_until(lambda: load.seen(2) >= 20, "requests served by version 2")
            assert versions(client) == {1: "draining", 2: "ready"}  # the session still holds version 1
            with pytest.raises(ServerError) as elsewhere:
                client.infer("lstm", {"tokens": [8, 9]}, session="kept", version=2)
            assert elsewhere.value.code == INVALID_INPUT and "belongs to model 'lstm'" in elsewhere.value.message
            second = client.infer("lstm", {"tokens": [8, 9]}, session="kept", session_end=True)
            pinned = client.infer("lstm", {"tokens": [8, 9]}, version=2)
        assert not load.failures
        for tokens, served in load.replies:
            assert_matches(served.outputs, references[served.version]({"tokens": tokens}))
        assert second.version == 1  # started before the reload: it finished on the weights it started with
        assert_matches(second.outputs, references[1]({"tokens": [5, 6, 7, 8, 9]}))
        assert pinned.version == 2
        assert_matches(pinned.outputs, references[2]({"tokens": [8, 9]}))
        with server.client() as client:
            wait_until(lambda: versions(client) == {1: "unloaded", 2: "ready"}, "version 1 unloaded once unused")
            listing = client.models()["models"]["lstm"]
            assert listing["version"] == 2
            with pytest.raises(ServerError) as refused:
                client.infer("lstm", {"tokens": [1]}, version=1)
            assert refused.value.code == UNKNOWN_MODEL and "ready: 2" in refused.value.message
    finally:
        stop_server(server)


@RUNNING_BATCH
def test_unloading_under_load_finishes_what_was_admitted_and_refuses_the_rest(tmp_path: Path, running_batch: str):
    config = write_config(tmp_path, SMALL_LSTM, scheduler=f'running_batch = "{running_batch}"')
    answer = reference(config, config.models["lstm"].weights)
    server = start_server(config, workers=1)
    try:
        raw = RawClient(server.address)  # one socket: the server reads the requests, then the unload, in order
        try:
            for n in range(40):
                raw.send({"id": n, "op": "infer", "model": "lstm", "inputs": {"tokens": [n % 1000] * 150}})
            raw.send({"id": "unload", "op": "unload", "model": "lstm"})
            replies = raw.recv_many(41)
        finally:
            raw.close()
        unloaded = replies.pop("unload")
        assert unloaded["ok"] and unloaded["draining"] == [1]
        for n, reply in replies.items():
            assert reply["ok"] and reply["version"] == 1, reply
            outputs = {name: map_to_tensor(value) for name, value in reply["outputs"].items()}
            assert_matches(outputs, answer({"tokens": [n % 1000] * 150}))
        with server.client() as client:
            with pytest.raises(ServerError) as refused:
                client.infer("lstm", {"tokens": [1]})
            assert refused.value.code == UNKNOWN_MODEL
            wait_until(lambda: versions(client) == {1: "unloaded"}, "the unloaded version leaving the workers")
            with pytest.raises(ServerError) as again:
                client.call({"op": "unload", "model": "lstm"})
            assert again.value.code == UNKNOWN_MODEL
            reloaded = client.call({"op": "load", "model": "lstm"})  # its last table, its weights read again
            assert reloaded["version"] == 2
            tasks = client.stats()["tasks"]
            reply = client.infer("lstm", {"tokens": [3, 4]})
            assert reply.version == 2
            assert_matches(reply.outputs, answer({"tokens": [3, 4]}))
            if running_batch == "worker":  # the version loaded at run time runs in the workers' batches too
                assert client.stats()["tasks"] == tasks
    finally:
        stop_server(server)


def test_weights_that_do_not_fit_are_refused_and_the_old_version_serves_on(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    answer = reference(config, config.models["lstm"].weights)
    (tmp_path / "small").mkdir()
    small = write_config(tmp_path / "small", SMALL_LSTM.replace("hidden_size = 64", "hidden_size = 32")).models["lstm"]
    server = start_server(config, workers=1)
    try:
        with server.client() as client:
            with pytest.raises(ServerError) as refused:
                client.call({"op": "load", "model": "lstm", "weights": str(small.weights)})
            assert refused.value.code == BAD_REQUEST
            assert "version 2 of model 'lstm'" in refused.value.message and "hidden" in refused.value.message
            assert versions(client) == {1: "ready", 2: "failed"}
            reason = client.models()["models"]["lstm"]["versions"][1]["reason"]
            assert str(small.weights) in reason
            reply = client.infer("lstm", {"tokens": [1, 2, 3]})
            assert reply.version == 1
            assert_matches(reply.outputs, answer({"tokens": [1, 2, 3]}))
            for message, words in [
                ({"op": "load"}, "load lacks 'model'"),
                ({"op": "load", "model": "nope"}, "no model named 'nope' was served here"),
                ({"op": "load", "model": "lstm", "weights": 5}, "'weights' must be a path"),
                ({"op": "load", "model": "lstm", "config": str(tmp_path / "none.toml")}, "does not exist"),
                ({"op": "load", "model": "lstm", "colour": 1}, "unknown field 'colour'"),
                ({"op": "infer", "model": "lstm", "inputs": {"tokens": [1]}, "version": "2"}, "'version' must be"),
            ]:
                with pytest.raises(ServerError) as bad:
                    client.call(message)
                assert bad.value.code == BAD_REQUEST and words in bad.value.message
            assert versions(client) == {1: "ready", 2: "failed"}
            small_table = tmp_path / "small" / "config.toml"  # a model of another hidden size: other arenas
            with pytest.raises(ServerError) as unsized:
                client.call({"op": "load", "model": "lstm", "config": str(small_table)})
            assert unsized.value.code == BAD_REQUEST
            assert "value kinds no model of this server had at start" in unsized.value.message
            assert versions(client) == {1: "ready", 2: "failed"}  # refused before anything changed
    finally:
        stop_server(server)


@RUNNING_BATCH
def test_requests_replayed_after_a_worker_loss_replay_on_their_own_version(tmp_path: Path, running_batch: str):
    scheduler = f'running_batch = "{running_batch}"'
    models, server = with_faults(tmp_path, SMALL_LSTM), "hang_timeout_ms = 1500"
    config = write_config(tmp_path, models, server=server, scheduler=scheduler)
    old, new = config.models["lstm"].weights, weights_file(config, "lstm-retrained.pt", seed=13)
    references = {1: reference(config, old), 2: reference(config, new)}
    server = start_server(config, workers=2)
    try:
        with server.client(timeout=120) as client:
            client.infer("lstm", {"tokens": [1, 2]}, session="old")  # a session on version 1
            assert client.call({"op": "load", "model": "lstm", "weights": str(new)})["version"] == 2
            hung = client.health()["workers"][0]["pid"]  # the worker given work first
            os.kill(hung, signal.SIGUSR1)  # its cells stop returning; its heartbeats go on, until it is written off

            async def both_versions() -> list[Any]:
                async with AsyncClient(server.address, timeout=120) as aclient:
                    session = aclient.infer("lstm", {"tokens": [3, 4, 5] * 20}, session="old", session_end=True)
                    fresh = [aclient.infer("lstm", {"tokens": [n] * (20 + n)}) for n in range(30)]
                    return await asyncio.gather(session, *fresh)

            session, *fresh = asyncio.run(both_versions())
            stats = client.stats()
        assert stats["worker_losses"] >= 1 and stats["replayed_requests"] > 0
        assert session.version == 1
        assert_matches(session.outputs, references[1]({"tokens": [1, 2] + [3, 4, 5] * 20}))
        for n, reply in enumerate(fresh):
            assert reply.version == 2
            assert_matches(reply.outputs, references[2]({"tokens": [n] * (20 + n)}))
    finally:
        stop_server(server)
