"""A model written by a user against the unfold -> CellGraph API (examples/elman.py) is compiled
into the same plans as the built-in models and served by the same scheduler."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from conftest import start_server, stop_server, wait_idle, write_config
from harness import Harness

from batchmaker.clients import AsyncClient
from batchmaker.common.models import build_model

ELMAN = """
[models.elman]
builder = "examples.elman:build"
weights = "elman.pt"
vocab_size = 200
hidden_size = 16
batch_sizes = [1, 2, 4, 8, 16]
"""


def test_a_user_model_compiles_to_a_plan_whose_state_is_overwritten_in_place(tmp_path: Path):
    h = Harness(write_config(tmp_path, ELMAN))
    try:
        request = h.admit("elman", {"tokens": [5, 6, 7, 8]})
        plan = request.unfolded.plan
        assert plan.lane_cells == ("elman/step",) and plan.depth.tolist() == [0, 1, 2, 3]
        assert plan.registers == 1  # h is read only by the next step, which overwrites it
        assert request.unfolded.externals[next(iter(request.unfolded.externals))].tolist() == [5, 6, 7, 8]
    finally:
        h.close()


def test_a_user_model_is_served_and_equals_its_reference(tmp_path: Path):
    config = write_config(tmp_path, ELMAN)
    model = build_model(config.models["elman"])
    state = model.load_weights()
    rng = np.random.default_rng(7)
    sequences = [rng.integers(0, 200, size=int(rng.integers(1, 40))).tolist() for _ in range(60)]
    server = start_server(config, workers=2)
    try:

        async def send() -> list:
            async with AsyncClient(server.address, timeout=60) as client:
                return await asyncio.gather(*(client.infer("elman", {"tokens": tokens}) for tokens in sequences))

        replies = asyncio.run(send())
        for tokens, reply in zip(sequences, replies):
            expected = model.reference(state, {"tokens": tokens})["h"]
            assert np.abs(reply.outputs["h"] - expected).max() <= 1e-5
        with server.client() as client:
            stats = wait_idle(client)
        assert stats["nodes"] == sum(map(len, sequences)) and stats["mean_batch_size"] > 1
        assert all(worker["slots_in_use"] == 0 for worker in stats["workers"].values())
    finally:
        stop_server(server)
