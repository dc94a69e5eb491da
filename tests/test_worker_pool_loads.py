"""The worker pool's part in loads at run time, with workers played by raw sockets: a worker's load answers,
the hang watchdog holding off while a worker loads, and a worker built from another config sent the manager's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import SMALL_LSTM, wait_until, write_config
from test_worker_pool import Pool

from batchmaker.common.config import model_to_wire
from batchmaker.common.protocol import decode, encode
from batchmaker.common.server_config import ServerConfig
from batchmaker.manager.loop.server import load_models
from batchmaker.manager.loop.worker_pool import WorkerPool


@pytest.fixture
def pool(tmp_path: Path):
    made = Pool(tmp_path)
    yield made
    made.close()


def test_a_worker_loading_is_not_taken_for_hung_and_its_answer_is_handed_on(pool: Pool):
    socket, reply = pool.register("elsewhere")  # another host: a hung one is told to stop, never killed by pid
    worker = pool.handle(reply)
    pool.pool.load(worker, {"name": "lstm@2"}, 1, ["lstm@2/layer0"])
    sent = {"model": {"name": "lstm@2"}, "first_cell": 1, "cells": ["lstm@2/layer0"]}
    assert decode(pool.reply(socket, b"load")) == sent
    worker.tasks[1] = object()  # a task waits behind the load
    worker.progress_at -= 3600  # for longer than any hang timeout
    worker.last_seen = time.monotonic()
    assert pool.pool.watch({}) == []
    socket.send(encode({"op": "loaded", "model": "lstm@2", "error": "weights unreadable"}))
    loads: list = []
    wait_until(lambda: loads.extend(pool.pool.control_messages().loads) or loads, "the answer")
    assert loads == [(worker, "lstm@2", "weights unreadable")]
    assert worker.loads_pending == 0 and time.monotonic() - worker.progress_at < 3600
    worker.progress_at -= 3600
    assert [lost for lost, _ in pool.pool.watch({})] == [worker]


def test_a_worker_whose_running_batch_stalls_is_taken_for_hung(pool: Pool):
    socket, reply = pool.register("elsewhere")
    worker = pool.handle(reply)
    worker.last_seen = time.monotonic()  # its heartbeats go on
    assert pool.pool.watch({}) == []
    assert pool.reply(socket, b"ping") == b""
    [(lost, reason)] = pool.pool.watch({worker.worker_id: 12.5})
    assert lost is worker and reason == "hung: its running batch ran no step for 12.5 s"
    assert pool.reply(socket, b"stop") == b""  # on another host: told to stop


@pytest.mark.parametrize("report", [{"model": 5, "error": None}, {"model": "lstm@2", "error": 3}])
def test_a_malformed_load_answer_is_dropped(pool: Pool, report: dict):
    socket, _ = pool.register("elsewhere")
    dropped = pool.pool.dropped_messages
    socket.send(encode({"op": "loaded", **report}))
    wait_until(lambda: not pool.pool.control_messages().loads and pool.pool.dropped_messages > dropped, "the drop")


def test_a_worker_built_from_another_config_is_sent_the_managers_models(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    _, specs, kinds = load_models(config)
    layout = [model_to_wire(model) for model in config.models.values()]
    pool = Pool(tmp_path)
    pool.pool.close()
    pool.pool = WorkerPool(pool.address, specs, kinds, ServerConfig(), b"", layout)
    try:
        socket = pool.dealer()
        socket.send(encode({"op": "register", "index": 0, "pid": 1, "device": "cpu", "cells": ["other/layer0"]}))
        assert decode(pool.reply(socket, b"registered")) == {"ok": False, "models": layout}
        assert pool.pool.workers == {}
    finally:
        pool.close()
