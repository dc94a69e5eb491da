"""Attacks by a client without credentials, thrown at a served config.

Each attack must be refused cheaply, must leave the event loop responsive (a health probe sent
right behind it is answered within the probe's timeout), must leave the manager's memory bounded,
and must leave well-formed requests beside it answered correctly. Cheapness is asserted by counting
the entries a check reads, never by the clock.
"""

from __future__ import annotations

import socket
import struct

import msgpack
import psutil
import pytest
from conftest import SMALL_LSTM, SMALL_SEQ2SEQ, CountingList, start_server, stop_server, write_config
from test_hardening import RawSocket, check_good_request

from batchmaker.clients import Client
from batchmaker.common.auth import generate_keypair
from batchmaker.common.models import build_model
from batchmaker.common.models.base import PlanCache, token_ids
from batchmaker.common.models.tree import parse_tree
from batchmaker.common.protocol import INVALID_INPUT, RequestError

PROBE_TIMEOUT_MS = 10_000  # what a liveness probe would allow; a stalled loop misses it
RSS_BOUND = 64 << 20  # growth of the manager's memory over all the attacks of a test


def manager_rss(server) -> int:
    return psutil.Process(server.supervisor.manager.pid).memory_info().rss


def answers(raw: RawSocket, count: int) -> dict:
    """The next `count` replies by id, each within the probe's timeout."""
    replies = {}
    for _ in range(count):
        assert raw.socket.poll(PROBE_TIMEOUT_MS), f"no reply within {PROBE_TIMEOUT_MS} ms; got {replies}"
        reply = msgpack.unpackb(raw.socket.recv(), raw=False, strict_map_key=False)
        replies[reply["id"]] = reply
    return replies


def assert_probe_and_good_request_beside(raw: RawSocket, served, attack: bytes, attack_id: str) -> dict:
    """Send the attack, then a health probe, at once; both answered; then a good request answered right."""
    _, model, state = served
    raw.socket.send(attack)
    raw.socket.send(msgpack.packb({"id": "probe", "op": "health"}))
    replies = answers(raw, 2)
    assert replies["probe"]["ok"] and replies["probe"]["status"] == "ready", replies
    check_good_request(raw, model, state, [5, 6, 7, 8])
    return replies[attack_id]


# -- tensor maps ------------------------------------------------------------------------------------


def test_a_shape_of_many_huge_dimensions_is_invalid_input_and_the_loop_stays_responsive(fuzz_server):
    raw = RawSocket(fuzz_server[0].address)
    before = manager_rss(fuzz_server[0])
    for count in (5_000, 40_000):
        tokens = {"dtype": "int64", "shape": [2**64 - 1] * count, "data": b"\x00" * 8}
        attack = msgpack.packb({"id": "crafted", "model": "lstm", "inputs": {"tokens": tokens}})
        refusal = assert_probe_and_good_request_beside(raw, fuzz_server, attack, "crafted")
        assert refusal["error"]["code"] == INVALID_INPUT, refusal
        assert len(refusal["error"]["message"]) < 200, refusal
    assert manager_rss(fuzz_server[0]) - before < RSS_BOUND


# -- lengths before scans -----------------------------------------------------------------------------


def test_a_token_list_over_the_length_limit_is_refused_before_it_is_scanned():
    tokens = CountingList([1] * 100_000)
    with pytest.raises(RequestError) as excinfo:
        token_ids({"tokens": tokens}, "tokens", vocab_size=10, max_length=400)
    assert excinfo.value.code == INVALID_INPUT and "at most 400" in excinfo.value.message
    assert tokens.read == 0


@pytest.mark.parametrize("key", ["tokens", "parents"])
def test_a_tree_over_the_node_limit_is_refused_before_it_is_scanned(key: str):
    tree = {"tokens": [1, 2, 3], "parents": [-1, 0, 0], key: CountingList([1] * 100_000)}
    with pytest.raises(RequestError) as excinfo:
        parse_tree({"tree": tree}, vocab_size=10, max_nodes=500, binary=False)
    assert excinfo.value.code == INVALID_INPUT and "at most 500" in excinfo.value.message
    assert tree[key].read == 0


# -- reply amplification ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"model": "m" * 500_000},
        {"op": "o" * 500_000},
        {"model": "lstm", "inputs": {"tokens": [1]}, "deadline_ms": ["d" * 1000] * 400},
        {"model": "lstm", "inputs": {"tokens": {"dtype": "x" * 500_000, "shape": [1], "data": b"\x00"}}},
    ],
    ids=["model", "op", "deadline", "dtype"],
)
def test_a_refusal_is_never_much_larger_than_a_plain_reply(fuzz_server, fields: dict):
    raw = RawSocket(fuzz_server[0].address)
    attack = msgpack.packb({"id": "amplified", **fields})
    refusal = assert_probe_and_good_request_beside(raw, fuzz_server, attack, "amplified")
    assert not refusal["ok"] and len(msgpack.packb(refusal)) < 400, refusal


def test_a_long_string_id_is_refused_and_not_echoed(fuzz_server):
    raw = RawSocket(fuzz_server[0].address)
    reply = raw.exchange(msgpack.packb({"id": "i" * 100_000, "op": "health"}))
    assert reply["id"] is None and reply["error"]["code"] == "BAD_REQUEST" and "256" in reply["error"]["message"]
    assert raw.exchange(msgpack.packb({"id": "i" * 256, "op": "health"}))["ok"]


# -- plan caches ------------------------------------------------------------------------------------------


def test_plan_caches_keep_the_most_recently_used_plans_and_count_misses(tmp_path):
    model = build_model(write_config(tmp_path, SMALL_SEQ2SEQ).models["seq2seq"])
    model.plan_cache = PlanCache(size=4)
    for length in range(1, 41):  # every shape a client can choose: each a miss, the cache stays at 4
        model.plan({"tokens": [1] * length, "max_len": 5})
    assert model.plan_cache.snapshot() == {"plans": 4, "size": 4, "misses": 40}
    for length, misses in ((37, 40), (1, 41), (37, 41), (38, 42)):  # 37 used again outlives 38, unused
        model.plan({"tokens": [1] * length, "max_len": 5})
        assert model.plan_cache.misses == misses, length


def test_stats_report_each_plan_cache(tmp_path):
    """The manager's planners' caches: those of the requests whose steps it decides (the workers plan their own)."""
    server = start_server(write_config(tmp_path, SMALL_LSTM, scheduler='running_batch = "manager"'), workers=1)
    try:
        with server.client() as client:
            client.infer("lstm", {"tokens": [1, 2, 3]})
            caches = client.stats()["plan_caches"]
        assert caches["lstm"]["misses"] >= 1 and caches["lstm"]["plans"] <= caches["lstm"]["size"]
    finally:
        stop_server(server)


# -- unfinished multipart messages ----------------------------------------------------------------------------


def zmtp_flood(address: str, parts: int, part_bytes: int) -> int:
    """Speak ZMTP 3.0 by hand, as no libzmq client would: greet with the NULL mechanism, then send
    `parts` frames of `part_bytes`, each flagged MORE, never the last. Returns the bytes the server took
    before it closed the connection (all of them if it never did)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        try:
            raw.sendall(b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
            ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
            raw.sendall(b"\x04" + bytes([len(ready)]) + ready)
            part = b"\x03" + struct.pack(">Q", part_bytes) + b"x" * part_bytes  # MORE | LONG
            for _ in range(parts):
                raw.sendall(part)
                sent += len(part)
        except OSError:  # reset or broken pipe: the server closed the connection
            pass
    return sent


def test_with_curve_a_hand_written_peer_gets_no_unfinished_frame_buffered(tmp_path):
    """libzmq queues an unfinished message's frames without counting them against the high-water
    mark, and a peer writing the wire protocol by hand can send them to the server (a libzmq client
    keeps them in its own process). With CURVE the handshake fails first: nothing is buffered."""
    keys = tmp_path / "keys"
    generate_keypair(keys, "server")
    client_public, client_secret = generate_keypair(keys, "client")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "client.key").write_bytes(client_public.read_bytes())
    curve = f'[server.curve]\nsecret_key = "{keys / "server.key_secret"}"\nallowed_clients = "{allowed}"\n'
    server = start_server(write_config(tmp_path, SMALL_LSTM, server=curve), workers=1)
    try:
        before = manager_rss(server)
        sent = zmtp_flood(server.address, parts=150, part_bytes=1 << 20)
        assert sent < 150 << 20, "the server read a flood from a peer without a key"
        assert manager_rss(server) - before < RSS_BOUND
        with Client(server.address, timeout=10, curve=(client_secret, keys / "server.key")) as client:
            assert client.health()["status"] == "ready"
            assert client.infer("lstm", {"tokens": [1, 2, 3]}).outputs["h"].shape == (64,)
    finally:
        stop_server(server)
