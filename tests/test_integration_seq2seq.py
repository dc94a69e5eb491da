"""Seq2Seq end to end: EOS ends a request early, speculative decoder steps are discarded, nothing leaks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_GRU, SMALL_SEQ2SEQ, start_server, stop_server, wait_idle, write_config

from batchmaker.clients import AsyncClient
from batchmaker.common.models import build_model
from batchmaker.common.models.seq2seq import decoding_mismatch

NEAR_TIE = 1e-4


def assert_same_decoding(got: np.ndarray, expected: dict) -> None:
    problem = decoding_mismatch(got, expected, NEAR_TIE)
    assert problem is None, problem


async def load(address: str, per_client: list[list[dict]]) -> list[list]:
    async def client_run(requests: list[dict], seed: int):
        rng = np.random.default_rng(seed)
        async with AsyncClient(address, timeout=120) as client:
            pending = []
            for inputs in requests:
                pending.append(asyncio.create_task(client.infer("seq2seq", inputs)))
                await asyncio.sleep(float(rng.exponential(0.003)))
            return await asyncio.gather(*pending)

    return await asyncio.gather(*(client_run(reqs, seed) for seed, reqs in enumerate(per_client)))


@pytest.mark.parametrize("running_batch", ["manager", "worker"])
def test_seq2seq_decodes_like_the_reference_and_stops_at_eos(tmp_path: Path, running_batch: str):
    config = write_config(tmp_path, SMALL_SEQ2SEQ, scheduler=f'running_batch = "{running_batch}"')
    server = start_server(config, workers=2)
    try:
        rng = np.random.default_rng(11)
        requests = []
        for _ in range(150):
            inputs = {"tokens": rng.integers(0, 1000, size=int(rng.integers(1, 30))).tolist()}
            if rng.random() < 0.3:
                inputs["max_len"] = int(rng.integers(1, 60))
            requests.append(inputs)
        per_client = [requests[i::3] for i in range(3)]
        results = asyncio.run(load(server.address, per_client))

        model = build_model(config.models["seq2seq"])
        state = model.load_weights()
        decoded_lengths, compute_us, executed = [], [], 0
        for requests_of_client, replies in zip(per_client, results):
            for inputs, reply in zip(requests_of_client, replies):
                expected = model.reference(state, inputs)
                tokens = reply.outputs["tokens"]
                assert tokens.dtype == np.int64
                assert_same_decoding(tokens, expected)
                max_len = inputs.get("max_len", len(inputs["tokens"]) + 10)
                stopped_early = len(tokens) < max_len
                decoded_lengths.append((len(tokens), stopped_early))
                compute_us.append((len(tokens), reply.timing["compute_us"]))
                executed += len(inputs["tokens"]) + len(tokens) + int(stopped_early)

        early = [n for n, stopped in decoded_lengths if stopped]
        assert len(early) >= 20, "weights should make many requests hit EOS before max_len"
        assert len({n for n, _ in decoded_lengths}) >= 10
        # Requests that hit EOS after a few steps return much sooner than long decodes.
        short = [us for n, us in compute_us if n <= 5]
        long = [us for n, us in compute_us if n >= 30]
        assert short and long and np.median(short) < np.median(long)

        with server.client() as client:
            stats = wait_idle(client)
        # The manager's tasks ran decoder steps past EOS, which were discarded (a running batch stops a decoder at
        # the end of the chain run in which its EOS came); their slots were freed too.
        assert stats["nodes"] > executed if running_batch == "manager" else stats["nodes"] >= executed
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values()), stats["workers"]
        assert stats["requests"]["ok"] == 150
    finally:
        stop_server(server)


def test_gru_and_seq2seq_served_together(tmp_path: Path):
    config = write_config(tmp_path, SMALL_GRU + SMALL_SEQ2SEQ)
    server = start_server(config, workers=1)
    try:
        rng = np.random.default_rng(5)
        gru_inputs = [{"tokens": rng.integers(0, 1000, size=int(n)).tolist()} for n in rng.integers(1, 50, size=60)]
        s2s_inputs = [{"tokens": rng.integers(0, 1000, size=int(n)).tolist()} for n in rng.integers(1, 20, size=40)]

        async def run():
            async with AsyncClient(server.address, timeout=120) as client:
                gru = [client.infer("gru", x) for x in gru_inputs]
                s2s = [client.infer("seq2seq", x) for x in s2s_inputs]
                return await asyncio.gather(asyncio.gather(*gru), asyncio.gather(*s2s))

        gru_replies, s2s_replies = asyncio.run(run())
        gru_model, s2s_model = build_model(config.models["gru"]), build_model(config.models["seq2seq"])
        gru_state, s2s_state = gru_model.load_weights(), s2s_model.load_weights()
        for inputs, reply in zip(gru_inputs, gru_replies):
            expected = gru_model.reference(gru_state, inputs)
            assert set(reply.outputs) == {"h", "h_n"}
            assert np.abs(reply.outputs["h"] - expected["h"]).max() <= 1e-5
        for inputs, reply in zip(s2s_inputs, s2s_replies):
            assert_same_decoding(reply.outputs["tokens"], s2s_model.reference(s2s_state, inputs))
        with server.client() as client:
            stats = wait_idle(client)
            models = client.models()["models"]
        assert set(stats["batch_sizes"]) == {"gru/layer0", "gru/layer1", "seq2seq/encoder", "seq2seq/decoder"}
        assert models["seq2seq"]["kind"] == "seq2seq" and models["gru"]["kind"] == "gru"
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values())
    finally:
        stop_server(server)
