"""Production hardening with a live server: fuzzing, overload, metrics, CurveZMQ authentication."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from conftest import SMALL_LSTM, free_port, start_server, stop_server, wait_idle, wait_until, write_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from batchmaker.clients import AsyncClient, Client, ServerError
from batchmaker.common.auth import generate_keypair
from batchmaker.common.protocol import ERROR_CODES

# -- fuzzing -------------------------------------------------------------------------------------


class RawSocket:
    def __init__(self, address: str):
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def exchange(self, frame: bytes) -> dict:
        self.socket.send(frame)
        assert self.socket.poll(10_000), "the server did not answer"
        return msgpack.unpackb(self.socket.recv(), raw=False, strict_map_key=False)


def check_good_request(raw: RawSocket, model, state, tokens: list[int]) -> None:
    reply = raw.exchange(msgpack.packb({"id": "good", "model": "lstm", "inputs": {"tokens": tokens}}))
    assert reply["ok"], reply
    h = np.frombuffer(reply["outputs"]["h"]["data"], dtype="<f4")
    assert np.abs(h - model.reference(state, {"tokens": tokens})["h"]).max() <= 1e-5


def assert_answered(reply: dict) -> None:
    assert reply.get("ok") is True or reply["error"]["code"] in ERROR_CODES, reply


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
    max_leaves=20,
)
request_maps = st.fixed_dictionaries(
    {},
    optional={
        "id": values,
        "op": st.sampled_from(["infer", "models", "health", "stats", "cancel", "bogus"]) | values,
        "model": st.sampled_from(["lstm", "nope"]) | values,
        "inputs": st.fixed_dictionaries(
            {}, optional={"tokens": values | st.lists(st.integers(-5, 1100), max_size=300)}
        )
        | values,
        "deadline_ms": values,
        "priority": values,
        "target": values,
    },
)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(frame=st.binary(max_size=300))
def test_fuzz_random_bytes(fuzz_server, frame: bytes):
    server, _model, _state = fuzz_server
    raw = _raw(server)
    assert_answered(raw.exchange(frame))


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(message=request_maps)
def test_fuzz_random_request_maps(fuzz_server, message: dict):
    server, _model, _state = fuzz_server
    raw = _raw(server)
    assert_answered(raw.exchange(msgpack.packb(message)))


_sockets: dict[str, RawSocket] = {}


def _raw(server) -> RawSocket:
    if server.address not in _sockets:
        _sockets[server.address] = RawSocket(server.address)
    return _sockets[server.address]


def test_after_fuzzing_the_server_serves_correctly_and_holds_no_slot(fuzz_server):
    server, model, state = fuzz_server
    raw = _raw(server)
    rng = np.random.default_rng(0)
    for _ in range(20):
        check_good_request(raw, model, state, rng.integers(0, 1000, size=int(rng.integers(1, 100))).tolist())
    with server.client() as client:
        stats = wait_idle(client)
        assert client.health()["status"] == "ready"
    assert stats["workers"]["0"]["slots_in_use"] == 0


# -- overload ------------------------------------------------------------------------------------


def test_overload_refuses_beyond_the_admission_limit_ahead_of_the_queue_and_recovers(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM, server="max_queued_requests = 48")
    server = start_server(config, workers=1)
    try:
        rng = np.random.default_rng(1)
        requests = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.integers(20, 60, size=400)]

        async def flood() -> tuple[list[tuple[int, object]], list[int]]:
            """All requests at once; returns (order of arrival of the reply, reply) in sending order, and the
            number of requests in flight the manager reported while they were being answered."""
            async with (
                AsyncClient(server.address, timeout=120, max_retries=0) as client,
                AsyncClient(server.address) as observer,
            ):
                arrivals = 0

                async def one(tokens) -> tuple[int, object]:
                    nonlocal arrivals
                    try:
                        reply = await client.infer("lstm", {"tokens": tokens})
                    except ServerError as exc:
                        reply = exc
                    arrivals += 1
                    return arrivals, reply

                pending = [asyncio.create_task(one(tokens)) for tokens in requests]
                in_flight = []
                while not all(task.done() for task in pending):
                    in_flight.append((await observer.stats())["requests_in_flight"])
                return await asyncio.gather(*pending), in_flight

        results, in_flight = asyncio.run(flood())
        accepted = [(i, arrival) for i, (arrival, r) in enumerate(results) if not isinstance(r, ServerError)]
        refused = [(i, arrival) for i, (arrival, r) in enumerate(results) if isinstance(r, ServerError)]
        assert all(r.code == "OVERLOADED" for _, r in results if isinstance(r, ServerError))
        assert accepted and refused
        print(f"{len(accepted)} accepted, {len(refused)} refused; in flight at most {max(in_flight)}")
        # Queueing is bounded by the admission limit.
        assert max(in_flight) <= 48
        # Refusals skip the queue: each is answered while a request sent before it was accepted and still unanswered.
        for sent, arrival in refused:
            assert any(a_sent < sent and a_arrival > arrival for a_sent, a_arrival in accepted), (sent, arrival)
        with server.client(timeout=60) as client:
            assert client.infer("lstm", {"tokens": requests[0]}).outputs["h"].shape == (64,)  # recovered
            assert wait_idle(client)["workers"]["0"]["slots_in_use"] == 0
    finally:
        stop_server(server)


# -- metrics -------------------------------------------------------------------------------------


def scrape(port: int) -> dict[str, dict]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


LOAD = 2000  # requests of 50 tokens: enough work that scrapes taken meanwhile see some of it


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_metrics_are_scraped_during_load(tmp_path: Path, running_batch: str):
    port = free_port()
    # Workers stopped while the load starts keep its work in flight until a scrape has seen it: long timeouts, so
    # that they are not written off meanwhile.
    server_table = f'metrics_address = "127.0.0.1:{port}"\nheartbeat_timeout_ms = 120000\nhang_timeout_ms = 120000'
    config = write_config(tmp_path, SMALL_LSTM, server=server_table, scheduler=f'running_batch = "{running_batch}"')
    server = start_server(config, workers=2)
    workers = [slot.process.pid for slot in server.supervisor.slots]
    try:
        rng = np.random.default_rng(2)

        async def load():
            async with AsyncClient(server.address, timeout=60) as client:
                for pid in workers:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    tasks = [
                        client.infer("lstm", {"tokens": rng.integers(0, 1000, size=50).tolist()}) for _ in range(LOAD)
                    ]
                    answers = asyncio.gather(*tasks)
                    busy_seen = False
                    for _ in range(600):  # scraped while the load is held, until work shows
                        during = await asyncio.get_running_loop().run_in_executor(None, scrape, port)
                        if busy_seen := busy(during) > 0:
                            break
                        await asyncio.sleep(0.05)
                finally:
                    for pid in workers:
                        os.kill(pid, signal.SIGCONT)
                return await answers, busy_seen

        _, busy_seen = asyncio.run(load())
        with Client(server.address) as client:
            with pytest.raises(ServerError):
                client.infer("nope", {"tokens": [1]})
            wait_idle(client)
            # The gauges catch up with the last completion notices in their own time.
            after = wait_until(lambda: _settled(scrape(port)), "the metrics settling after the load")
            steps = sum(client.stats()["batch_sizes"]["lstm/layer0"].values())

        assert after["batchmaker_requests_total"][(("model", "lstm"), ("outcome", "ok"))] == LOAD
        assert after["batchmaker_requests_total"][(("model", "-"), ("outcome", "UNKNOWN_MODEL"))] == 1
        assert after["batchmaker_request_latency_seconds_count"][(("model", "lstm"),)] == LOAD
        assert after["batchmaker_request_queue_seconds_count"][(("model", "lstm"),)] == LOAD
        batch_count = after["batchmaker_batch_size_count"][(("cell_type", "lstm/layer0"),)]
        batch_sum = after["batchmaker_batch_size_sum"][(("cell_type", "lstm/layer0"),)]
        # Each step of a task is a batch; a multi-step task runs several.
        assert batch_sum == LOAD * 50 and batch_count == steps
        tasks = after["batchmaker_tasks_total"][(("cell_type", "lstm/layer0"),)]
        assert 0 < tasks <= steps if running_batch == "manager" else tasks == 0  # the workers decided every step
        assert batch_sum / batch_count > 1.5
        for gauge in ("batchmaker_worker_tasks_in_flight", "batchmaker_worker_requests_in_flight"):
            assert set(after[gauge]) == {(("worker", "0"),), (("worker", "1"),)}
        assert all(v > 0 for v in after["batchmaker_arena_rows_capacity"].values())
        assert all(v == 0 for v in after["batchmaker_arena_rows_in_use"].values())
        assert after["batchmaker_worker_restarts_total"][()] == 0
        assert (("cell_type", "lstm/layer0"),) in after["batchmaker_queue_depth_nodes"]
        assert busy_seen, "mid-load, no scrape showed work queued or running"
    finally:
        stop_server(server)


def busy(samples: dict[str, dict]) -> float:
    """Tasks and requests in flight plus arena rows in use, over all workers."""
    names = "batchmaker_worker_tasks_in_flight", "batchmaker_worker_requests_in_flight", "batchmaker_arena_rows_in_use"
    return sum(sum(samples[name].values()) for name in names)


def _settled(samples: dict[str, dict]) -> dict[str, dict] | None:
    """The samples once they count every request (the load's and one refused) and show nothing running, else None."""
    counted = sum(samples.get("batchmaker_requests_total", {}).values()) == LOAD + 1
    return samples if counted and busy(samples) == 0 else None


# -- authentication ------------------------------------------------------------------------------


def test_curve_serves_allowed_clients_only(tmp_path: Path):
    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    generate_keypair(keys, "server")
    client_public, client_secret = generate_keypair(keys, "client")
    _, stranger_secret = generate_keypair(keys, "stranger")
    (allowed / "client.key").write_bytes(client_public.read_bytes())
    curve = f"""
[server.curve]
secret_key = "{keys / 'server.key_secret'}"
allowed_clients = "{allowed}"
"""
    config = write_config(tmp_path, SMALL_LSTM, server=curve)
    server = start_server(config, workers=1)
    try:
        server_public = keys / "server.key"
        with Client(server.address, timeout=10, curve=(client_secret, server_public)) as client:
            assert client.infer("lstm", {"tokens": [1, 2, 3]}).outputs["h"].shape == (64,)
            before = client.stats()
        stranger = Client(server.address, timeout=1, curve=(stranger_secret, server_public))
        with stranger, pytest.raises(TimeoutError):
            stranger.infer("lstm", {"tokens": [1, 2, 3]})
        with Client(server.address, timeout=1) as anonymous, pytest.raises(TimeoutError):
            anonymous.infer("lstm", {"tokens": [1, 2, 3]})
        with Client(server.address, timeout=10, curve=(client_secret, server_public)) as client:
            # Only this stats call arrived since: the refused clients' requests never reached the manager.
            after = client.stats()
            assert after["requests"]["received"] == before["requests"]["received"]
            assert after["control_calls"]["stats"] == before["control_calls"]["stats"] + 1
    finally:
        stop_server(server)
