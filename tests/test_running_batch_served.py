"""A real server whose workers run their own batches (`[scheduler] running_batch = "worker"`): requests routed
whole (with their priorities, streams and sessions) answer as their references, errors come back as the manager's
own would, and cancels, deadlines and a lost worker end or replay routed requests, each with one reply.

Nothing here is timed: the tests wait for what the server reports."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any, Self

import numpy as np
import pytest
import zmq
from conftest import SMALL_LSTM, start_server, stop_server, wait_until, write_config
from test_running_batch import MODELS, mixed_requests

from batchmaker.bench.verify import differences
from batchmaker.common.config import with_running_batch
from batchmaker.common.models import build_model
from batchmaker.common.protocol import BAD_REQUEST, DEADLINE_EXCEEDED, INVALID_INPUT, decode, encode

SCHEDULER = 'running_batch = "worker"'


class Raw:
    """A DEALER socket that keeps every reply, so that a missing or doubled one shows."""

    def __init__(self, address: str):
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.replies: dict[Any, list[dict[str, Any]]] = {}

    def send(self, message: dict[str, Any]) -> None:
        self.socket.send(encode(message))

    def collect(self, ids: list[Any]) -> dict[Any, dict[str, Any]]:
        """Receive until each of `ids` has a reply; every reply to one of them, by id."""
        while not all(i in self.replies for i in ids):
            assert self.socket.poll(60_000), "the server stopped answering"
            reply = decode(self.socket.recv())
            self.replies.setdefault(reply["id"], []).append(reply)
        return {i: self.replies[i][0] for i in ids}

    def close(self) -> None:
        self.socket.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    config = write_config(tmp_path_factory.mktemp("routed"), MODELS, scheduler=SCHEDULER)
    running = start_server(config, workers=2)
    models = {name: build_model(model) for name, model in config.models.items()}
    weights = {name: model.load_weights() for name, model in models.items()}
    yield running, models, weights
    stop_server(running)


def check(models, weights, sent: dict[int, tuple[str, dict]], replies: dict[int, dict]) -> None:
    for request_id, (model, inputs) in sent.items():
        reply = replies[request_id]
        assert reply["ok"], reply
        worst, problem = differences(models[model].reference(weights[model], inputs), decode_outputs(reply["outputs"]))
        assert problem is None and worst < 1e-5, (model, problem, worst)


def decode_outputs(outputs: dict[str, Any]) -> dict[str, Any]:
    from batchmaker.common.protocol import decode_outputs as decoded

    return decoded(outputs)


def test_routed_requests_answer_as_their_references(server):
    running, models, weights = server
    raw = Raw(running.address)
    try:
        sent = dict(enumerate(mixed_requests(40, seed=11)))
        for request_id, (model, inputs) in sent.items():
            raw.send({"id": request_id, "model": model, "inputs": inputs})
        check(models, weights, sent, raw.collect(list(sent)))
        assert all(len(replies) == 1 for replies in raw.replies.values())
        with running.client() as client:
            stats = wait_until(lambda: (s := client.stats())["routed"]["requests_in_flight"] == 0 and s, "idle")
        assert stats["requests"]["ok"] >= len(sent)
        assert stats["ready_nodes"] == {} or not any(stats["ready_nodes"].values())  # the core ran none of them
    finally:
        raw.close()


def test_errors_come_back_as_the_managers_own(server):
    running, _, _ = server
    raw = Raw(running.address)
    try:
        raw.send({"id": "bad-token", "model": "lstm", "inputs": {"tokens": [10**6]}})
        raw.send({"id": "no-inputs", "model": "lstm"})
        raw.send({"id": "misspelt", "model": "lstm", "inputs": {"token": [1]}})
        raw.send({"id": "no-model", "model": "nope", "inputs": {"tokens": [1]}})
        raw.send({"id": "expired", "model": "lstm", "inputs": {"tokens": [1, 2]}, "deadline_ms": 0})
        replies = raw.collect(["bad-token", "no-inputs", "misspelt", "no-model", "expired"])
        assert replies["bad-token"]["error"]["code"] == INVALID_INPUT
        assert replies["no-inputs"]["error"]["code"] == BAD_REQUEST
        assert replies["misspelt"]["error"]["code"] == INVALID_INPUT
        assert not replies["no-model"]["ok"]
        assert replies["expired"]["error"]["code"] == DEADLINE_EXCEEDED
    finally:
        raw.close()


class StoppedWorkers:
    """The server's workers stopped (SIGSTOP), so that what they hold stays in flight, until `resume` or the end."""

    def __init__(self, running: Any):
        self._pids = [slot.process.pid for slot in running.supervisor.slots]

    def __enter__(self) -> Self:
        for pid in self._pids:
            os.kill(pid, signal.SIGSTOP)
        return self

    def resume(self) -> None:
        for pid in self._pids:
            os.kill(pid, signal.SIGCONT)

    def __exit__(self, *_: object) -> None:
        self.resume()


def test_a_duplicate_id_in_flight_is_refused(server):
    running, _, _ = server
    raw = Raw(running.address)
    try:
        with StoppedWorkers(running) as stopped:
            with running.client() as client:
                raw.send({"id": "held", "model": "lstm", "inputs": {"tokens": [1, 2, 3]}})
                wait_until(lambda: client.stats()["routed"]["requests_in_flight"] == 1, "the request in flight")
            raw.send({"id": "held", "model": "lstm", "inputs": {"tokens": [1]}})
            [refused] = _all(raw, "held", 1)
            assert refused["error"]["code"] == BAD_REQUEST and "already in flight" in refused["error"]["message"]
            stopped.resume()
            assert _all(raw, "held", 2)[1]["ok"]
    finally:
        raw.close()


def test_one_id_twice_in_a_burst_a_sessions_and_another_is_refused_once(server):
    running, _, _ = server
    manager = running.supervisor.manager
    raw = Raw(running.address)
    os.kill(manager.pid, signal.SIGSTOP)  # both frames wait in its socket and arrive in one burst
    try:
        session = {"session": "twice", "session_end": True}  # taking its session's turn
        raw.send({"id": "twice", "model": "lstm", "inputs": {"tokens": [1, 2]}, **session})
        raw.send({"id": "twice", "model": "lstm", "inputs": {"tokens": [3]}})  # a worker's
    finally:
        os.kill(manager.pid, signal.SIGCONT)
    try:
        refused, answered = sorted(_all(raw, "twice", 2), key=lambda reply: reply["ok"])  # a refusal goes first
        assert answered["ok"], answered
        assert refused["error"]["code"] == BAD_REQUEST and "already in flight" in refused["error"]["message"]
        assert raw.socket.poll(200) == 0  # no third reply
    finally:
        raw.close()


def _all(raw: Raw, request_id: Any, count: int) -> list[dict[str, Any]]:
    while len(raw.replies.get(request_id, [])) < count:
        assert raw.socket.poll(60_000), "the server stopped answering"
        reply = decode(raw.socket.recv())
        raw.replies.setdefault(reply["id"], []).append(reply)
    return raw.replies[request_id]


def test_a_cancel_ends_a_routed_request_with_one_reply(server):
    running, _, _ = server
    raw = Raw(running.address)
    try:
        for i in range(20):
            raw.send({"id": i, "model": "seq2seq", "inputs": {"tokens": list(range(1, 60))}})
        raw.send({"id": "cancel", "op": "cancel", "target": 19})
        replies = raw.collect([*range(20), "cancel"])
        cancelled = replies["cancel"]["cancelled"]
        assert replies[19]["ok"] is (not cancelled)
        if cancelled:
            assert replies[19]["error"]["code"] == "CANCELLED"
        assert all(len(raw.replies[i]) == 1 for i in range(20))
    finally:
        raw.close()


def test_streams_and_sessions_are_routed(server):
    running, models, weights = server
    lstm = models["lstm"]
    with running.client() as client:
        before = client.stats()
        *partials, final = client.stream("seq2seq", {"tokens": [3, 4, 5]})
        expected = models["seq2seq"].reference(weights["seq2seq"], {"tokens": [3, 4, 5]})
        assert differences(expected, final.outputs)[1] is None
        streamed = [p.outputs["tokens"] for p in partials]
        assert np.array_equal(np.concatenate(streamed or [np.zeros(0, np.int64)]), final.outputs["tokens"])
        first = client.infer("lstm", {"tokens": [1, 2]}, session="s")
        second = client.infer("lstm", {"tokens": [3]}, session="s", session_end=True)
        assert (first.session_step, second.session_step) == (1, 2)
        whole = lstm.reference(weights["lstm"], {"tokens": [1, 2, 3]})
        assert np.abs(second.outputs["h"] - whole["h"]).max() < 1e-5
        stats = client.stats()
        assert stats["tasks"] == before["tasks"]  # no task: their workers ran every step
        assert stats["requests"]["ok"] == before["requests"]["ok"] + 3
        assert stats["routed"]["requests_in_flight"] == 0


def test_a_request_too_large_for_a_running_batch_runs_in_the_managers_steps(tmp_path: Path):
    """Its tokens take more rows than a worker's arena has (the tests' 4,096): its worker cannot hold it, so the
    manager runs its steps itself, a few lanes at a time, while the requests beside it stay routed."""
    config = write_config(tmp_path, SMALL_LSTM.replace("max_length = 200", "max_length = 10000"), scheduler=SCHEDULER)
    running = start_server(config, workers=2)
    model = build_model(config.models["lstm"])
    weights = model.load_weights()
    rng = random.Random(23)
    sent = {
        "long": ("lstm", {"tokens": rng.choices(range(1, 1000), k=5000)}),
        "longer": ("lstm", {"tokens": rng.choices(range(1, 1000), k=6000)}),
        **{i: ("lstm", {"tokens": rng.choices(range(1, 1000), k=20)}) for i in range(6)},
    }
    raw = Raw(running.address)
    try:
        with running.client() as client:
            for request_id, (name, inputs) in sent.items():
                raw.send({"id": request_id, "model": name, "inputs": inputs, "priority": int(request_id == "long")})
            check({"lstm": model}, {"lstm": weights}, sent, raw.collect(list(sent)))
            stats = wait_until(lambda: (s := client.stats())["routed"]["requests_in_flight"] == 0 and s, "idle")
        assert all(len(replies) == 1 for replies in raw.replies.values())
        assert stats["tasks"] > 0  # the manager's steps ran the two long ones
        assert stats["requests"]["ok"] == len(sent)
        assert sum(w["requests_answered"] for w in stats["workers"].values()) == 6  # the short ones, routed
    finally:
        raw.close()
        stop_server(running)


def test_requests_with_a_priority_are_routed_and_a_bad_priority_refused(server):
    running, models, weights = server
    raw = Raw(running.address)
    try:
        with StoppedWorkers(running) as stopped:
            with running.client() as client:
                raw.send({"id": "urgent", "model": "lstm", "inputs": {"tokens": [1, 2]}, "priority": 5})
                raw.send({"id": "later", "model": "lstm", "inputs": {"tokens": [3]}, "priority": -5})
                wait_until(lambda: client.stats()["routed"]["requests_in_flight"] == 2, "both routed to the workers")
            raw.send({"id": "bad", "model": "lstm", "inputs": {"tokens": [1]}, "priority": "high"})
            assert raw.collect(["bad"])["bad"]["error"]["code"] == BAD_REQUEST
            stopped.resume()
            check(models, weights, {"urgent": ("lstm", {"tokens": [1, 2]}), "later": ("lstm", {"tokens": [3]})},
                  raw.collect(["urgent", "later"]))  # fmt: skip
    finally:
        raw.close()


def test_workers_whose_config_says_otherwise_run_the_batch_the_manager_routes(tmp_path: Path):
    """`batchmaker serve --running-batch worker` on a config that says "manager": the workers read that config,
    and learn at registration that requests come to them whole."""
    config = write_config(tmp_path, MODELS)
    running = start_server(with_running_batch(config, "worker"), workers=1)
    try:
        with running.client() as client:
            reply = client.infer("bin", {"tree": {"tokens": [3, 4, -1], "parents": [2, 2, -1]}})
            stats = client.stats()
        expected = build_model(config.models["bin"])
        weights = expected.load_weights()
        inputs = {"tree": {"tokens": [3, 4, -1], "parents": [2, 2, -1]}}
        assert differences(expected.reference(weights, inputs), reply.outputs)[1] is None
        assert stats["running_batch"] == "worker" and stats["tasks"] == 0  # no task: the worker ran every step
        assert stats["steps"] >= 3 and stats["mean_batch_size"] >= 1  # the leaves, their parent, the classifier
    finally:
        stop_server(running)


def test_a_lost_workers_requests_are_replayed_on_another(tmp_path: Path):
    config = write_config(tmp_path, MODELS, scheduler=SCHEDULER)
    running = start_server(config, workers=2)
    models = {name: build_model(model) for name, model in config.models.items()}
    weights = {name: model.load_weights() for name, model in models.items()}
    raw = Raw(running.address)
    try:
        with running.client() as client:
            worker_ids = sorted(client.stats()["workers"], key=int)
            victim = client.stats()["workers"][worker_ids[0]]["pid"]
            os.kill(victim, signal.SIGSTOP)
            sent = dict(enumerate(mixed_requests(12, seed=random.randrange(1000))))
            for request_id, (model, inputs) in sent.items():
                raw.send({"id": request_id, "model": model, "inputs": inputs})
            on_victim = lambda: client.stats()["routed"]["by_worker"].get(worker_ids[0], 0) > 0
            wait_until(on_victim, "requests on the victim")
            os.kill(victim, signal.SIGKILL)
            check(models, weights, sent, raw.collect(list(sent)))
            assert all(len(replies) == 1 for replies in raw.replies.values())
            assert client.stats()["replayed_requests"] >= 1
    finally:
        raw.close()
        stop_server(running)
