"""The manager's worker pool on real sockets, with workers played by raw sockets: which host a
worker is on decides whose arenas it is told of, whether its pid is trusted, and whether its
results arrive in shared memory or in its notices."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import SMALL_LSTM, wait_until, write_config

from batchmaker.common.addresses import completion_address
from batchmaker.common.notice import CompletionNotice, encode_notice
from batchmaker.common.protocol import decode, encode
from batchmaker.common.server_config import ServerConfig
from batchmaker.common.shm import SharedArray
from batchmaker.manager.batching.worker_handle import WorkerHandle
from batchmaker.manager.loop.server import load_models
from batchmaker.manager.loop.worker_pool import WorkerPool
from batchmaker.worker.backend import arena_ids

ROWS = 64
SUPERVISOR_TOKEN = b"supervisor-secret"


class Pool:
    """A WorkerPool on an ipc address, and raw sockets that play its workers and the supervisor."""

    def __init__(self, tmp_path: Path):
        _, specs, self.kinds = load_models(write_config(tmp_path, SMALL_LSTM))
        self.cells = [spec.key for spec in specs]
        self.address = f"ipc://{tmp_path}/workers"
        self.pool = WorkerPool(self.address, specs, self.kinds, ServerConfig(), SUPERVISOR_TOKEN)
        self.context = zmq.Context()
        self.pushes = self.context.socket(zmq.PUSH)
        self.pushes.connect(completion_address(self.address))
        self.sockets: list[zmq.Socket] = [self.pushes]
        self.shared: list[SharedArray] = []
        self.state = next(kind for kind in self.kinds if kind.dtype == "float32")

    def arenas(self, local: bool) -> list[dict[str, Any]]:
        """Arenas as a worker announces them; a local worker's io arenas are real shared memory."""
        arenas = []
        for kind, (device_id, io_id) in arena_ids(self.kinds).items():
            arenas.append({"id": device_id, "kind": kind.key, "space": "device", "rows": ROWS, "shm": None})
            shm = None
            if local:
                self.shared.append(SharedArray(kind.dtype, (ROWS, *kind.shape)))
                shm = self.shared[-1].name
            arenas.append({"id": io_id, "kind": kind.key, "space": "io", "rows": ROWS, "shm": shm})
        return arenas

    def dealer(self) -> zmq.Socket:
        socket = self.context.socket(zmq.DEALER)
        socket.connect(self.address)
        self.sockets.append(socket)
        return socket

    def register(self, host: str | None, pid: int = 1, arenas: list[dict[str, Any]] | None = None):
        """Register a worker; returns its socket and the manager's reply."""
        socket = self.dealer()
        message = {"op": "register", "index": 0, "pid": pid, "device": "cpu", "cells": self.cells}
        message["arenas"] = self.arenas(host == self.pool.host) if arenas is None else arenas
        if host is not None:
            message["host"] = host
        socket.send(encode(message))
        return socket, decode(self.reply(socket, b"registered"))

    def reply(self, socket: zmq.Socket, kind: bytes) -> bytes:
        """The next message to `socket`, serving the pool's control socket meanwhile; it must be of `kind`."""

        def arrived() -> bool:
            self.pool.control_messages()
            return bool(socket.poll(10))

        wait_until(arrived, f"a {kind!r} message")
        got, payload = socket.recv_multipart()
        assert got == kind, (got, payload)
        return payload

    def handle(self, reply: dict[str, Any]) -> WorkerHandle:
        return self.pool.workers[reply["worker_id"]]

    def notices(self, notice: CompletionNotice, signed: bool = True) -> list[tuple[WorkerHandle, CompletionNotice]]:
        """Push a notice (with its worker's key, when `signed`) and return what the pool takes."""
        if signed:
            notice = dataclasses.replace(notice, key=self.pool.workers[notice.worker_id].notice_key)
        return self.push(encode_notice(notice))

    def push(self, frame: bytes) -> list[tuple[WorkerHandle, CompletionNotice]]:
        self.pushes.send(frame)
        assert self.pool.completions.poll(10_000)
        return list(self.pool.notices())

    def exits(self, message: dict[str, Any]) -> list:
        """Send `message` on the control socket and return the exits the pool reads off it."""
        pool_dropped = self.pool.dropped_messages
        self.dealer().send(encode(message))
        exited: list = []

        def read() -> bool:
            exited.extend(self.pool.control_messages()[1])
            return bool(exited) or self.pool.dropped_messages > pool_dropped

        wait_until(read, "the message being read")
        return exited

    def close(self) -> None:
        self.pool.close()
        for socket in self.sockets:
            socket.close(linger=0)
        self.context.term()
        for shared in self.shared:
            shared.close()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    made = Pool(tmp_path)
    yield made
    made.close()


def test_registration_without_a_host_or_with_malformed_arenas_is_refused(pool: Pool):
    _, reply = pool.register(None)
    assert reply == {"ok": False, "error": "worker did not say which host it runs on"}
    arenas = pool.arenas(local=False)
    del arenas[0]["rows"]
    _, reply = pool.register("elsewhere", arenas=arenas)
    assert not reply["ok"] and reply["error"].startswith("an arena of None rows was announced")
    arenas = pool.arenas(local=False)
    del arenas[0]["kind"]
    _, reply = pool.register("elsewhere", arenas=arenas)
    assert not reply["ok"] and reply["error"].startswith("malformed arenas in the registration: {")
    assert not pool.pool.workers


@pytest.mark.parametrize("rows", [2**40, 16385, 2, "64", 64.0, True])
def test_announced_arena_rows_out_of_bounds_or_ill_typed_are_refused_before_any_allocation(pool: Pool, rows: Any):
    arenas = pool.arenas(local=False)
    arenas[1]["rows"] = rows
    _, reply = pool.register("elsewhere", arenas=arenas)
    assert not reply["ok"] and "io arenas have at most 16384" in reply["error"], reply
    assert not pool.pool.workers
    _, good = pool.register("elsewhere")
    assert good["ok"]


@pytest.mark.parametrize(
    "field",
    [{"index": "0"}, {"pid": "1"}, {"device": 5}, {"arenas": "many"}, {"arenas": [1, 2]}, {"kernel_busy_us": -1},
     {"kernel_busy_us": 1.5}],
    ids=repr,
)
def test_ill_typed_registrations_are_refused(pool: Pool, field: dict[str, Any]):
    socket = pool.dealer()
    message = {"op": "register", "index": 0, "pid": 1, "device": "cpu", "cells": pool.cells, "host": "elsewhere"}
    message["arenas"] = pool.arenas(local=False)
    socket.send(encode(message | field))
    reply = decode(pool.reply(socket, b"registered"))
    assert not reply["ok"] and not pool.pool.workers


def test_a_worker_claiming_the_managers_host_without_its_shared_memory_is_refused(pool: Pool):
    arenas = pool.arenas(local=False)
    for arena in arenas:
        arena["shm"] = "bm-not-on-this-host"
    _, reply = pool.register(pool.pool.host, arenas=arenas)
    assert not reply["ok"] and "--host-id" in reply["error"] and "shared memory is not here" in reply["error"]
    _, other = pool.register("elsewhere")  # the pool goes on registering workers
    assert other["ok"] and not other["local"]


def test_workers_are_told_only_of_the_arenas_of_their_own_host(pool: Pool):
    first, first_reply = pool.register("host-a")
    other, other_reply = pool.register("host-b")
    third, third_reply = pool.register("host-a")
    assert (first_reply["peers"], other_reply["peers"]) == ({}, {})
    assert list(third_reply["peers"]) == [str(first_reply["worker_id"])]
    assert list(decode(pool.reply(first, b"peers"))) == [str(third_reply["worker_id"])]
    pool.pool.watch({})  # pings every worker: the other host's next message is that ping, not an announcement
    pool.reply(other, b"ping")
    pool.reply(third, b"ping")
    pool.pool.remove(pool.handle(first_reply))
    assert decode(pool.reply(third, b"forget-peer")) == {"worker_id": first_reply["worker_id"]}
    pool.pool.watch({})
    pool.reply(other, b"ping")


def report_peers(pool: Pool, socket: zmq.Socket, report: dict[str, Any], taken: Callable[[], bool]) -> None:
    """Send a worker's report of the peers it opened, and serve the pool until `taken` says it was read
    (a ping sent after the report may come back first: the two travel in opposite directions)."""
    dropped = pool.pool.dropped_messages

    def read() -> bool:
        pool.pool.control_messages()
        return taken()

    socket.send(encode({"op": "peers", **report}))
    wait_until(read, "the peers report being read")
    assert pool.pool.dropped_messages == dropped


def test_a_worker_is_given_requests_from_a_peer_only_once_it_says_it_can_read_its_arenas(pool: Pool):
    """Placement (manager/batching/scheduler.py) moves a request to a worker only from the workers not in its
    `unread` set: every worker of its host until it reports having opened their arenas."""
    first, first_reply = pool.register("host-a")
    second, second_reply = pool.register("host-a")
    pool.register("host-b")
    a, b = pool.handle(first_reply), pool.handle(second_reply)
    assert (a.unread, b.unread) == ({b.worker_id}, {a.worker_id})
    pool.reply(first, b"peers")
    unreadable = {"readable": [], "unreadable": {str(a.worker_id): "no peer access"}}
    report_peers(pool, second, unreadable, lambda: b.unreadable == {a.worker_id: "no peer access"})
    report_peers(pool, first, {"readable": [b.worker_id], "unreadable": {}}, lambda: not a.unread)
    assert (a.unread, b.unread) == (set(), {a.worker_id})
    pool.pool.remove(a)
    assert (b.unread, b.unreadable) == (set(), {})


@pytest.mark.parametrize(
    "report", [{"readable": "all", "unreadable": {}}, {"readable": [], "unreadable": ["1"]}, {"readable": []}]
)
def test_a_malformed_peers_report_is_dropped_and_changes_nothing(pool: Pool, report: dict[str, Any]):
    first, first_reply = pool.register("host-a")
    _, second_reply = pool.register("host-a")
    dropped = pool.pool.dropped_messages
    first.send(encode({"op": "peers", **report}))
    wait_until(
        lambda: pool.pool.control_messages() and pool.pool.dropped_messages > dropped, "the report being dropped"
    )
    assert pool.handle(first_reply).unread == {second_reply["worker_id"]}


def test_a_peers_report_from_a_socket_that_never_registered_is_dropped(pool: Pool):
    dropped = pool.pool.dropped_messages
    pool.dealer().send(encode({"op": "peers", "readable": [0], "unreadable": {}}))
    wait_until(
        lambda: pool.pool.control_messages() and pool.pool.dropped_messages > dropped, "the report being dropped"
    )


def test_a_registration_brings_the_workers_kernel_time_so_far_its_warm_ups(pool: Pool):
    socket = pool.dealer()
    message = {"op": "register", "index": 0, "pid": 1, "device": "cpu", "cells": pool.cells, "host": "elsewhere"}
    socket.send(encode(message | {"arenas": pool.arenas(local=False), "kernel_busy_us": 1234}))
    reply = decode(pool.reply(socket, b"registered"))
    assert reply["ok"] and pool.pool.workers[reply["worker_id"]].kernel_busy_us == 1234
    _, untimed = pool.register("elsewhere")  # a GPU worker's kernels are not timed: it says nil, or nothing
    assert pool.pool.workers[untimed["worker_id"]].kernel_busy_us is None


def test_the_registration_reply_says_whether_requests_are_routed_whole_with_the_bounds_of_chain_runs(pool: Pool):
    assert pool.register("host-a")[1]["running_batch"] is None
    pool.pool._running_batch = {"max_steps": 16, "max_join_delay_us": 500}
    assert pool.register("host-a")[1]["running_batch"] == {"max_steps": 16, "max_join_delay_us": 500}


def test_answers_of_a_worker_come_back_per_message_and_malformed_ones_are_dropped(pool: Pool):
    worker, reply = pool.register("host-a")
    answers: list = []
    batch, partials = [[1, {"h": 1}, None, 40], [2, None, ["INTERNAL", "x"], 0]], [[3, {"tokens": 1}]]
    ran = {"lstm/layer0": {64: 3, 5: 1}}
    worker.send(encode({"op": "answers", "answers": batch, "ran": ran, "kernel_busy_us": 900}))
    worker.send(encode({"op": "answers", "answers": [], "partials": partials, "ran": {}, "kernel_busy_us": 700}))
    wait_until(lambda: answers.extend(pool.pool.control_messages().answers) or len(answers) == 2, "the answers")
    assert [(each.worker.worker_id, each.answers, each.partials, each.ran) for each in answers] == [
        (reply["worker_id"], batch, [], ran),
        (reply["worker_id"], [], partials, {}),
    ]
    assert answers[0].worker.kernel_busy_us == 900  # the running batch's kernel time: the largest is the latest
    dropped = pool.pool.dropped_messages
    worker.send(encode({"op": "answers", "answers": [], "ran": {}, "kernel_busy_us": "a while"}))
    worker.send(encode({"op": "answers", "answers": [], "ran": {}, "kernel_busy_us": -1}))
    worker.send(encode({"op": "answers", "answers": "all"}))
    worker.send(encode({"op": "answers"}))
    worker.send(encode({"op": "answers", "answers": [], "ran": {"lstm/layer0": {"64": 3}}}))
    worker.send(encode({"op": "answers", "answers": [], "partials": "some"}))
    pool.dealer().send(encode({"op": "answers", "answers": []}))  # from a socket that never registered
    wait_until(lambda: pool.pool.control_messages() and pool.pool.dropped_messages == dropped + 7, "the drops")


def test_only_a_worker_of_this_host_is_written_off_by_pid(pool: Pool):
    """The supervisor reports exited processes of the manager's host by pid; the same pid on another
    host is another process."""
    _, local = pool.register(pool.pool.host, pid=4242)
    _, remote = pool.register("elsewhere", pid=4242)
    assert local["local"] and not remote["local"]
    exited = pool.exits({"op": "worker_exited", "pid": 4242, "status": -9, "token": SUPERVISOR_TOKEN})
    assert [worker.worker_id for worker, _ in exited] == [local["worker_id"]]


@pytest.mark.parametrize("token", [None, b"", b"guessed", "supervisor-secret"], ids=repr)
def test_worker_exited_without_the_supervisors_token_is_dropped(pool: Pool, token: Any):
    _, local = pool.register(pool.pool.host, pid=4242)
    message = {"op": "worker_exited", "pid": 4242, "status": -9}
    if token is not None:
        message["token"] = token
    assert pool.exits(message) == []
    assert pool.pool.dropped_messages == 1 and local["worker_id"] in pool.pool.workers


def test_a_readiness_check_is_handed_to_the_caller_and_answered_with_what_it_gives(pool: Pool):
    checker = pool.dealer()
    checker.send(encode({"op": "health"}))
    checks: list[bytes] = []
    wait_until(lambda: checks.extend(pool.pool.control_messages().health_checks) or checks, "the check being read")
    assert len(checks) == 1 and not checker.poll(0)  # the pool does not answer it itself
    pool.pool.answer_health(checks[0], {"status": "degraded", "workers": []})
    assert decode(pool.reply(checker, b"health")) == {"status": "degraded", "workers": []}


def test_a_notice_without_its_workers_key_is_dropped(pool: Pool):
    """The notice socket does not say who sent a message: a peer naming another worker cannot complete its tasks."""
    _, first = pool.register("elsewhere")
    _, second = pool.register("elsewhere")
    forged = CompletionNotice(first["worker_id"], [5], {}, 1, key=second["notice_key"])
    assert pool.notices(forged, signed=False) == []
    assert pool.notices(dataclasses.replace(forged, key=b""), signed=False) == []
    assert pool.pool.dropped_messages == 2
    [(worker, notice)] = pool.notices(forged)
    assert worker.worker_id == first["worker_id"] and notice.task_ids == [5]


MALFORMED_NOTICES = [
    b"\xc1",
    b"",
    encode(5),
    encode([0, b"", [1], {}, 1]),  # five fields: the format before keys
    encode([0, b"", ["x"], {}, 1, []]),
    encode([0, b"", [1], {1: 5}, 1, []]),
    encode([0, b"", [1], {}, 1, [[0, b"\x00" * 3, b""]]]),
    encode([0, "key", [1], {}, 1, []]),
    encode([True, b"", [1], {}, 1, []]),
]


def test_malformed_frames_on_the_worker_sockets_are_dropped_and_the_pool_goes_on(pool: Pool):
    _, reply = pool.register("elsewhere")
    for frame in MALFORMED_NOTICES:
        assert pool.push(frame) == []
    assert pool.pool.dropped_messages == len(MALFORMED_NOTICES)
    for frame in (b"\xc1", encode(5), encode([1, 2])):
        pool.dealer().send(frame)
    pool.dealer().send_multipart([b"a", b"b"])
    dropped = len(MALFORMED_NOTICES) + 4
    wait_until(lambda: pool.pool.control_messages() and pool.pool.dropped_messages == dropped, "the drops")
    [(_, notice)] = pool.notices(CompletionNotice(reply["worker_id"], [5], {}, 1))
    assert notice.task_ids == [5]
    _, again = pool.register("elsewhere")
    assert again["ok"]


def test_rows_in_a_notice_from_another_host_land_where_results_are_read(pool: Pool):
    _, reply = pool.register("elsewhere")
    worker = pool.handle(reply)
    io_arena = worker.io_arena_id[pool.state]
    rows = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
    notice = CompletionNotice(worker.worker_id, [5], {}, 1, [(io_arena, np.array([3, 7]), rows.tobytes())])
    [(got, received)] = pool.notices(notice)
    assert got is worker and received.errors == {}
    np.testing.assert_array_equal(worker.io[pool.state][[3, 7]], rows)
    assert worker.rows_in_notices == 2


@pytest.mark.parametrize(
    ("host", "arena", "slots", "rows", "message"),
    [
        ("elsewhere", None, [ROWS], 1, "out of range"),
        ("elsewhere", None, [2, 3], 1, "bytes for 2 rows"),
        ("elsewhere", 99, [2], 1, "no io arena 99"),
        ("this host", None, [2], 1, "a worker on the manager's host"),
    ],
)
def test_unusable_rows_fail_the_tasks_of_their_notice_and_nothing_else(
    pool: Pool, host: str, arena: int | None, slots: list[int], rows: int, message: str
):
    _, reply = pool.register(pool.pool.host if host == "this host" else host)
    worker = pool.handle(reply)
    data = np.ones((rows, *pool.state.shape), np.float32).tobytes()
    bad = (worker.io_arena_id[pool.state] if arena is None else arena, np.array(slots), data)
    [(_, received)] = pool.notices(CompletionNotice(worker.worker_id, [5, 6], {}, 2, [bad]))
    assert set(received.errors) == {5, 6} and all(message in error for error in received.errors.values())
    assert not worker.io[pool.state].any() and worker.rows_in_notices == 0
    [(_, later)] = pool.notices(CompletionNotice(worker.worker_id, [7], {}, 3, []))
    assert later.errors == {}
