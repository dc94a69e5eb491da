"""Multi-step tasks through a real server (supervisor, manager, worker, sockets, shared memory): every
reply equals the model's unbatched reference, whether a request ran alone, in tasks of many steps,
ended inside one, or arrived while one ran; each model's lone request runs in fewer tasks than
steps; a cancel and a deadline end a request inside multi-step tasks, and streamed partials add up."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import (
    ROOT,
    SMALL_SEQ2SEQ,
    SST_TREELSTM,
    RunningServer,
    start_server,
    stop_server,
    wait_idle,
    write_config,
)

from batchmaker.clients import AsyncClient, Partial, ServerError
from batchmaker.common.models import build_model
from batchmaker.common.models.seq2seq import decoding_mismatch
from batchmaker.common.models.sst import load_vocabulary, ptb_to_tree
from batchmaker.common.protocol import CANCELLED, DEADLINE_EXCEEDED

TOLERANCE = 1e-5
NEAR_TIE = 1e-4
SST = ROOT / "data" / "sst"
VOCAB = 100
LONG = [1 + i % (VOCAB - 1) for i in range(30000)]  # seconds of steps: ended long before it could finish
CHAIN = f"vocab_size = {VOCAB}\nembedding_size = 12\nhidden_size = 16\nmax_length = 40\nbatch_sizes = [1, 2, 4, 8]"
MODELS = f"""
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
{CHAIN}

[models.gru_bi]
builder = "batchmaker.common.models.gru:build"
weights = "gru_bi.pt"
bidirectional = true
per_step = true
head_size = 5
{CHAIN}

[models.long]
builder = "batchmaker.common.models.lstm:build"
weights = "lstm.pt"
{CHAIN.replace("max_length = 40", f"max_length = {len(LONG)}")}
""" + SST_TREELSTM.replace("[models.tree]", "[models.sst]") + SMALL_SEQ2SEQ.replace(
    "max_decode_length = 60\n", 'max_decode_length = 60\nattention = "luong"\n'
)
# The join delay is no bound here: tasks take up to max_steps_per_task steps whenever nothing could join.
# The manager decides the steps: multi-step tasks are its own (a worker's running batch sends it no tasks).
SCHEDULER = 'max_steps_per_task = 8\nmax_join_delay_us = 10000000\nrunning_batch = "manager"'


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, dict[str, Any]]]:
    config = write_config(tmp_path_factory.mktemp("multistep"), MODELS, scheduler=SCHEDULER)
    server = start_server(config, workers=1)
    with server.client() as client, pytest.raises(ServerError, match=DEADLINE_EXCEEDED):
        client.call(long_request("plan", deadline_ms=0))  # planned once, so a deadline later counts running only
    models = {}
    for name in config.models:
        model = build_model(config.models[name])
        models[name] = (model, model.load_weights())
    yield server, models
    stop_server(server)


def requests_of_every_model(rng: np.random.Generator, count: int) -> list[tuple[str, dict]]:
    lines = (SST / "dev.txt").read_text(encoding="utf-8").splitlines()
    vocabulary = load_vocabulary(SST / "vocab.txt")
    requests = []
    for index in range(count):
        name = ("lstm", "gru_bi", "seq2seq", "sst")[index % 4]
        if name == "sst":
            tokens, parents, _ = ptb_to_tree(str(rng.choice(lines)), vocabulary)
            inputs: dict = {"tree": {"tokens": tokens, "parents": parents}}
        elif name == "seq2seq":
            inputs = {"tokens": rng.integers(0, 1000, size=int(rng.integers(1, 30))).tolist()}
        else:
            inputs = {"tokens": rng.integers(0, VOCAB, size=int(rng.integers(1, 41))).tolist()}
        requests.append((name, inputs))
    return requests


def check(models: dict[str, Any], name: str, inputs: dict, outputs: dict) -> None:
    model, state = models[name]
    expected = model.reference(state, inputs)
    if name == "seq2seq":
        problem = decoding_mismatch(outputs["tokens"], expected, NEAR_TIE)
        assert problem is None, problem
        return
    assert outputs.keys() == expected.keys(), name
    for key, value in expected.items():
        assert outputs[key].dtype == np.float32 and outputs[key].shape == value.shape, (name, key)
        assert np.abs(outputs[key] - value).max() <= TOLERANCE, (name, key)


async def send_staggered(address: str, requests: list[tuple[str, dict]], seed: int) -> list:
    """Requests sent with random gaps: some arrive while multi-step tasks run, and lanes end inside them."""
    rng = np.random.default_rng(seed)
    async with AsyncClient(address, timeout=180) as client:
        pending = []
        for name, inputs in requests:
            pending.append(asyncio.create_task(client.infer(name, inputs)))
            await asyncio.sleep(float(rng.exponential(0.002)))
        return await asyncio.gather(*pending)


@pytest.mark.parametrize("name", ["lstm", "gru_bi", "seq2seq", "sst"])
def test_a_lone_request_runs_in_fewer_tasks_than_steps(served, name: str):
    server, models = served
    inputs = dict(requests_of_every_model(np.random.default_rng(3), 4))[name]
    with server.client() as client:
        before = wait_idle(client)
        reply = client.infer(name, inputs)
        after = wait_idle(client)
    check(models, name, inputs, reply.outputs)
    tasks, steps = after["tasks"] - before["tasks"], after["steps"] - before["steps"]
    assert tasks < steps, (tasks, steps)


def test_mixed_arrivals_equal_the_reference(served):
    server, models = served
    requests = requests_of_every_model(np.random.default_rng(7), 120)
    per_client = [requests[k::3] for k in range(3)]

    async def run() -> list[list]:
        return await asyncio.gather(
            *(send_staggered(server.address, sent, seed) for seed, sent in enumerate(per_client))
        )

    for sent, replies in zip(per_client, asyncio.run(run())):
        for (name, inputs), reply in zip(sent, replies):
            check(models, name, inputs, reply.outputs)
    with server.client() as client:
        stats = wait_idle(client)
    assert stats["steps"] > stats["tasks"]
    assert stats["requests_in_flight"] == 0
    assert all(w["slots_in_use"] == 0 for w in stats["workers"].values()), stats["workers"]


def long_request(request_id: str, **extra: Any) -> dict:
    return {"id": request_id, "model": "long", "inputs": {"tokens": LONG}, **extra}


async def wait_multi_step(client: AsyncClient) -> None:
    """Until the long request runs in multi-step tasks: the server has run more steps than tasks."""
    while True:
        stats = await client.stats()
        if stats["steps"] > stats["tasks"] and stats["requests_in_flight"]:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("ending", ["cancel", "deadline"])
def test_a_request_ends_inside_multi_step_tasks_and_the_others_are_served(served, ending: str):
    server, models = served
    short = [{"tokens": [5] * n} for n in range(1, 20)]

    async def run():
        async with AsyncClient(server.address, timeout=120) as client:
            deadline = {"deadline_ms": 400} if ending == "deadline" else {}
            long = asyncio.create_task(client.call(long_request(ending, **deadline)))
            await asyncio.wait_for(wait_multi_step(client), 60)
            others = asyncio.gather(*(client.infer("lstm", inputs) for inputs in short))
            cancelled = (await client.cancel(ending))["cancelled"] if ending == "cancel" else None
            return cancelled, await asyncio.gather(long, others, return_exceptions=True)

    cancelled, (long, others) = asyncio.run(run())
    assert isinstance(long, ServerError) and long.code == (CANCELLED if ending == "cancel" else DEADLINE_EXCEEDED)
    assert cancelled in (True, None)
    for inputs, reply in zip(short, others):
        check(models, "lstm", inputs, reply.outputs)
    with server.client() as client:
        stats = wait_idle(client)
    assert all(w["slots_in_use"] == 0 for w in stats["workers"].values()), stats["workers"]


def test_streamed_partials_add_up_to_the_reference(served):
    server, models = served
    model, state = models["seq2seq"]
    rng = np.random.default_rng(5)
    with server.client() as client:
        for _ in range(6):
            inputs = {"tokens": rng.integers(0, 1000, size=int(rng.integers(1, 30))).tolist()}
            *partials, final = client.stream("seq2seq", inputs)
            assert all(isinstance(p, Partial) and not p.restarted for p in partials)
            tokens = final.outputs["tokens"]
            assert decoding_mismatch(tokens, model.reference(state, inputs), NEAR_TIE) is None
            if len(tokens):
                assert np.array_equal(np.concatenate([p.outputs["tokens"] for p in partials]), tokens)
