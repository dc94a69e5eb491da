"""Admission by expected wait on a real server: once its capacity is measured, a flood far beyond
it is refused with OVERLOADED (the message saying the estimated wait), requests whose deadline the
estimate already exceeds get DEADLINE_EXCEEDED at admission, every accepted request is answered
with the reference model's result, and every request gets exactly one reply.

Nothing here is timed: the test waits for what the server reports (its `stats`, its replies)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
from conftest import SMALL_LSTM, start_server, stop_server, wait_until, write_config
from test_running_batch_served import StoppedWorkers

from batchmaker.common.models import build_model

LIMIT_MS = 50
PROBE_DEADLINE_MS = LIMIT_MS // 2  # below any wait the server refuses for
PROBE_EVERY = 25  # one request in this many carries PROBE_DEADLINE_MS
TIMEOUT_MS = 60_000  # only a server that stopped answering waits this long
OVERLOADED_MESSAGE = re.compile(rf"estimated wait (\d+) ms exceeds the server's limit of {LIMIT_MS} ms")
DEADLINE_MESSAGE = re.compile(rf"estimated wait (\d+) ms exceeds the request's deadline_ms {PROBE_DEADLINE_MS}")


class Flood:
    """A raw DEALER socket that sends many requests at once and keeps every reply, so that a
    missing or doubled reply shows (a client library would hide both)."""

    def __init__(self, address: str):
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        for option in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self.socket.setsockopt(option, 0)
        self.socket.connect(address)
        self.sent: dict[int, dict[str, Any]] = {}
        self.replies: dict[Any, list[dict[str, Any]]] = {}
        self._asked = 0

    def send(self, requests: list[dict[str, Any]]) -> None:
        for request in requests:
            request_id = len(self.sent)
            self.sent[request_id] = request
            self.socket.send(msgpack.packb({"id": request_id, "model": "lstm", **request}))

    def _receive(self) -> dict[str, Any]:
        assert self.socket.poll(TIMEOUT_MS), "the server stopped answering"
        reply = msgpack.unpackb(self.socket.recv(), raw=False, strict_map_key=False)
        self.replies.setdefault(reply["id"], []).append(reply)
        return reply

    def collect(self) -> None:
        """Receive until every request sent has a reply."""
        while len(self.replies.keys() & self.sent.keys()) < len(self.sent):
            self._receive()

    def stats(self) -> dict[str, Any]:
        """The server's stats, asked on this socket: every reply the server sent before is in by then."""
        self._asked += 1
        key = f"stats {self._asked}"
        self.socket.send(msgpack.packb({"id": key, "op": "stats"}))
        while (reply := self._receive())["id"] != key:
            pass
        del self.replies[key]
        return reply

    def close(self) -> None:
        self.socket.close()


def lengths(rng: np.random.Generator, count: int) -> list[dict[str, Any]]:
    return [{"inputs": {"tokens": rng.integers(0, 1000, size=int(n)).tolist()}} for n in rng.integers(30, 70, count)]


def check_replies(flood: Flood, config: Any, overloaded: re.Pattern[str]) -> dict[str, int]:
    """Every request sent has exactly one reply: the reference model's answer, OVERLOADED with a message `overloaded`
    matches, or DEADLINE_EXCEEDED for a request with a deadline; returns the count of each outcome."""
    model = build_model(config.models["lstm"])
    state = model.load_weights()
    assert sorted(flood.replies) == sorted(flood.sent), "a reply to a request never sent"
    doubled = [request_id for request_id, replies in flood.replies.items() if len(replies) > 1]
    assert not doubled, f"requests answered more than once: {doubled[:5]}"
    outcomes: dict[str, int] = {}
    for request_id, (reply,) in flood.replies.items():
        request = flood.sent[request_id]
        code = "ok" if reply["ok"] else reply["error"]["code"]
        outcomes[code] = outcomes.get(code, 0) + 1
        if code == "ok":
            expected = model.reference(state, {"tokens": request["inputs"]["tokens"]})
            for name in ("h", "c"):
                got = np.frombuffer(reply["outputs"][name]["data"], dtype="<f4")
                assert np.abs(got - expected[name]).max() <= 1e-5, (request_id, name)
        elif code == "OVERLOADED":
            wait = overloaded.search(reply["error"]["message"])
            assert wait and (wait.group(1) is None or int(wait.group(1)) >= LIMIT_MS), reply  # a quoted wait: over
        elif code == "DEADLINE_EXCEEDED":
            assert request.get("deadline_ms") == PROBE_DEADLINE_MS, reply
        else:
            raise AssertionError(f"unexpected reply {reply}")
    return outcomes


def test_a_flood_is_refused_by_expected_wait_and_every_request_is_answered_once(tmp_path: Path):
    # The batching core's estimate, from the cells it schedules (the running batch's has a test of its own below).
    manager_steps = 'running_batch = "manager"'
    config = write_config(tmp_path, SMALL_LSTM, server=f"max_queue_delay_ms = {LIMIT_MS}", scheduler=manager_steps)
    rng = np.random.default_rng(7)
    server = start_server(config, workers=1)
    flood = Flood(server.address)
    try:
        # Until the server has measured its capacity on full batches it refuses nothing for the expected wait.
        def measured() -> dict[str, Any] | None:
            flood.send(lengths(rng, 200))
            flood.collect()
            admission = flood.stats()["admission"]
            return admission if admission["cells_per_s"] else None

        capacity = wait_until(measured, "a capacity measured on full batches")["cells_per_s"]

        # Ten times what it runs within the limit, sent at once: the server reads it far faster than it runs it.
        within_limit = capacity * LIMIT_MS / 1e3 / 50  # requests (50 tokens on average)
        requests = lengths(rng, int(10 * within_limit) + 100)
        for request in requests[::PROBE_EVERY]:
            request["deadline_ms"] = PROBE_DEADLINE_MS
        first = len(flood.sent)
        flood.send(requests)
        flood.collect()
        after = flood.stats()
    finally:
        flood.close()
        stop_server(server)

    assert after["requests_in_flight"] == 0
    outcomes = check_replies(flood, config, OVERLOADED_MESSAGE)
    refused_at_admission = [
        int(match.group(1))
        for (reply,) in flood.replies.values()
        if not reply["ok"] and (match := DEADLINE_MESSAGE.search(reply["error"]["message"]))
    ]
    print(f"capacity {capacity:.0f} cells/s, flood of {len(requests)}: {outcomes}; "
          f"{len(refused_at_admission)} refused at admission for their deadline")
    flood_codes = {"ok" if r["ok"] else r["error"]["code"] for i, (r,) in flood.replies.items() if i >= first}
    assert {"ok", "OVERLOADED"} <= flood_codes, outcomes
    assert refused_at_admission and min(refused_at_admission) >= PROBE_DEADLINE_MS, refused_at_admission
    # The server counted what the client saw: nothing was lost on either side.
    assert {code: after["requests"].get(code, 0) for code in outcomes} == outcomes
    assert after["admission"]["cells_per_s"] and after["admission"]["estimated_wait_ms"] == 0


def test_a_cold_server_refuses_a_flood_by_expected_wait_from_its_first_request(tmp_path: Path):
    """Its workers timed their full tasks at warm-up: admission quotes that capacity before any task has run."""
    config = write_config(tmp_path, SMALL_LSTM, server=f"max_queue_delay_ms = {LIMIT_MS}")
    server = start_server(config, workers=1)
    flood = Flood(server.address)
    try:
        cold = flood.stats()
        assert cold["tasks"] == 0 and cold["admission"]["cells_per_s"] == cold["admission"]["warm_up_cells_per_s"] > 0
        within_limit = cold["admission"]["cells_per_s"] * LIMIT_MS / 1e3 / 50  # requests (50 tokens on average)
        flood.send(lengths(np.random.default_rng(8), int(10 * within_limit) + 100))
        flood.collect()
    finally:
        flood.close()
        stop_server(server)
    codes = [reply["error"]["code"] if not reply["ok"] else "ok" for (reply,) in flood.replies.values()]
    assert set(codes) == {"ok", "OVERLOADED"}
    assert codes.count("ok") < len(codes) / 2  # bounded from the start: most of ten times the limit is refused


def test_a_flood_routed_to_running_batches_is_refused_by_expected_wait_before_any_other_check(tmp_path: Path):
    """With the workers running their own batches the wait is the requests in flight over the answer rate; a request
    it refuses is refused before its other fields are read, so a flood's malformed requests are refused alike. The
    workers are stopped while the manager reads the flood, so that the wait it sees is the flood's, however fast
    this machine drains it."""
    config = write_config(
        tmp_path, SMALL_LSTM, server=f"max_queue_delay_ms = {LIMIT_MS}", scheduler='running_batch = "worker"'
    )
    rng = np.random.default_rng(9)
    server = start_server(config, workers=1)
    flood = Flood(server.address)
    try:
        flood.send(lengths(rng, 200))  # answers that measure the rate
        flood.collect()
        requests = lengths(rng, 3000)
        for request in requests[::PROBE_EVERY]:
            request["deadline_ms"] = PROBE_DEADLINE_MS
        malformed = {"inputs": {"words": [1, 2]}}  # an input the model does not have
        first = len(flood.sent)
        with StoppedWorkers(server):  # what is routed stays in flight while the manager reads the flood
            flood.send(requests[:1500] + [malformed] * 200 + requests[1500:])
            flood.stats()  # asked after the flood on its socket: the manager has read all of it
        flood.collect()
        after = flood.stats()
    finally:
        flood.close()
        stop_server(server)
    bad = {request_id for request_id, request in flood.sent.items() if request is malformed}
    bad_codes = {reply["error"]["code"] for request_id, (reply,) in flood.replies.items() if request_id in bad}
    assert "OVERLOADED" in bad_codes and bad_codes <= {"OVERLOADED", "INVALID_INPUT"}, bad_codes
    for request_id in bad:
        flood.sent.pop(request_id)
        flood.replies.pop(request_id)
    unmeasured = r"requests in flight, as many as the workers' running batches hold at once"
    outcomes = check_replies(flood, config, re.compile(f"{OVERLOADED_MESSAGE.pattern}|{unmeasured}"))
    flood_codes = {"ok" if r["ok"] else r["error"]["code"] for i, (r,) in flood.replies.items() if i >= first}
    assert {"ok", "OVERLOADED"} <= flood_codes, outcomes
    assert after["requests_in_flight"] == 0 and after["requests"]["OVERLOADED"] >= outcomes["OVERLOADED"]
