"""The baseline policies served by real processes: padded and graph batching return exactly what
the model computes (as cellular batching does), for chains, Seq2Seq and trees."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, SMALL_GRU, SMALL_SEQ2SEQ, start_server, stop_server, wait_idle, write_config
from test_integration_seq2seq import assert_same_decoding
from test_tree_models import TREE_MODELS

from batchmaker.bench.trees import random_tree
from batchmaker.clients import AsyncClient
from batchmaker.common.models import build_model

TOLERANCE = 1e-5


def sequence_requests(rng: np.random.Generator) -> list[tuple[str, dict]]:
    requests = [("gru", {"tokens": rng.integers(0, 1000, int(rng.integers(1, 45))).tolist()}) for _ in range(60)]
    requests += [("seq2seq", {"tokens": rng.integers(0, 1000, int(rng.integers(1, 25))).tolist()}) for _ in range(40)]
    return [requests[i] for i in rng.permutation(len(requests))]


async def send_all(address: str, requests: list[tuple[str, dict]]) -> list:
    async with AsyncClient(address, timeout=120) as client:
        pending = []
        for model, inputs in requests:
            pending.append(asyncio.create_task(client.infer(model, inputs)))
            await asyncio.sleep(0.002)
        return await asyncio.gather(*pending)


def check_answers(config, requests: list[tuple[str, dict]], replies: list) -> None:
    models = {name: build_model(config.models[name]) for name in config.models}
    states = {name: model.load_weights() for name, model in models.items()}
    for (name, inputs), reply in zip(requests, replies):
        expected = models[name].reference(states[name], inputs)
        if name == "seq2seq":
            assert_same_decoding(reply.outputs["tokens"], expected)
            continue
        for key, value in reply.outputs.items():
            np.testing.assert_allclose(value, expected[key], atol=TOLERANCE)


@pytest.mark.parametrize("policy", ["padded", "graph"])
def test_baseline_policies_answer_like_the_reference(tmp_path: Path, policy: str):
    config = write_config(tmp_path, SMALL_GRU + SMALL_SEQ2SEQ, scheduler=f'policy = "{policy}"\nbucket_width = 10')
    server = start_server(config, workers=1)
    try:
        requests = sequence_requests(np.random.default_rng(5))
        replies = asyncio.run(send_all(server.address, requests))
        check_answers(config, requests, replies)
        with server.client() as client:
            stats = wait_idle(client)
        assert stats["policy"] == policy and stats["requests_waiting_for_a_batch"] == 0
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values())
        gru_cells = sum(len(inputs["tokens"]) * 2 for name, inputs in requests if name == "gru")
        ran = sum(int(size) * n for size, n in stats["batch_sizes"]["gru/layer0"].items())
        ran += sum(int(size) * n for size, n in stats["batch_sizes"]["gru/layer1"].items())
        if policy == "padded":
            assert ran > gru_cells  # padding cells ran too
    finally:
        stop_server(server)


def test_graph_policy_serves_trees_like_the_reference(tmp_path: Path):
    config = write_config(tmp_path, TREE_MODELS, scheduler='policy = "graph"')
    server = start_server(config, workers=1)
    try:
        rng = np.random.default_rng(3)
        requests = [("cs", {"tree": random_tree(rng, int(rng.integers(1, 30)), 50)}) for _ in range(40)]
        replies = asyncio.run(send_all(server.address, requests))
        check_answers(config, requests, replies)
    finally:
        stop_server(server)


def test_serving_a_tree_model_padded_is_refused_with_a_clear_error(tmp_path: Path):
    config = write_config(tmp_path, TREE_MODELS)
    run = subprocess.run(
        [sys.executable, "-m", "batchmaker.manager.commands.cli", "serve", str(config.path), "--policy", "padded"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 2
    assert "policy 'padded' needs sequence models" in run.stderr and "bin, cs cannot be padded" in run.stderr
