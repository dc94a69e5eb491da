"""Tree models end to end with real processes: a binary TreeLSTM on SST trees and a Child-Sum TreeLSTM
on random trees, served together to concurrent clients and checked against the reference."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import ROOT, RunningServer, start_server, stop_server, wait_idle, write_config

from batchmaker.bench.trees import random_tree
from batchmaker.clients import AsyncClient, ServerError
from batchmaker.common.models import build_model
from batchmaker.common.models.sst import load_vocabulary, ptb_to_tree
from batchmaker.common.protocol import INVALID_INPUT

SST = ROOT / "data" / "sst"
TOLERANCE = 1e-5
CHILDSUM_VOCAB = 1000

MODELS = f"""
[models.sst]
builder = "batchmaker.common.models.treelstm:build"
weights = "sst.pt"
vocab_size = {len(load_vocabulary(SST / "vocab.txt"))}
embedding_size = 32
hidden_size = 64
num_classes = 5
batch_sizes = [1, 2, 4, 8, 16, 32, 64]

[models.childsum]
builder = "batchmaker.common.models.childsum:build"
weights = "childsum.pt"
vocab_size = {CHILDSUM_VOCAB}
embedding_size = 32
hidden_size = 64
max_nodes = 200
batch_sizes = [1, 2, 4, 8, 16, 32, 64]
"""

# A root over a leaf and over nodes with 1, 3 and 9 leaf children (tree nodes 2, 4 and 8):
# once the leaves are computed, the nodes with 1, 3 and 9 children are ready together.
MIXED_ARITY_TREE = {
    "tokens": [-1, 1, -1, 2, -1, 3, 4, 5, -1, *range(6, 15)],
    "parents": [-1, 0, 0, 2, 0, 4, 4, 4, 0, *[8] * 9],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(write_config(tmp_path_factory.mktemp("trees"), MODELS), workers=2)
    yield running
    stop_server(running)


def assert_slots_free(stats: dict) -> None:
    assert stats["requests_in_flight"] == 0
    assert all(w["slots_in_use"] == 0 for w in stats["workers"].values()), stats["workers"]


async def send_staggered(address: str, requests: list[tuple[str, dict]], seed: int) -> list:
    """One client with many requests in flight, sent with random gaps."""
    rng = np.random.default_rng(seed)
    async with AsyncClient(address, timeout=120) as client:
        pending = []
        for model, tree in requests:
            pending.append(asyncio.create_task(client.infer(model, {"tree": tree})))
            await asyncio.sleep(float(rng.exponential(0.003)))
        return await asyncio.gather(*pending)


async def run_clients(address: str, per_client: list[list[tuple[str, dict]]]) -> list[list]:
    return await asyncio.gather(*(send_staggered(address, reqs, seed) for seed, reqs in enumerate(per_client)))


def test_concurrent_trees_of_both_models_equal_the_reference(server: RunningServer):
    vocabulary = load_vocabulary(SST / "vocab.txt")
    lines = (SST / "dev.txt").read_text(encoding="utf-8").splitlines()
    rng = np.random.default_rng(11)
    requests: list[tuple[str, dict]] = []
    for line in rng.choice(lines, size=160, replace=False):
        tokens, parents, _ = ptb_to_tree(line, vocabulary)
        requests.append(("sst", {"tokens": tokens, "parents": parents}))
    for size in rng.integers(1, 80, size=160):
        requests.append(("childsum", random_tree(rng, int(size), CHILDSUM_VOCAB)))
    order = rng.permutation(len(requests))
    per_client = [[requests[i] for i in order[k::4]] for k in range(4)]

    results = asyncio.run(run_clients(server.address, per_client))

    models = {name: build_model(server.config.models[name]) for name in ("sst", "childsum")}
    states = {name: model.load_weights() for name, model in models.items()}
    worst = 0.0
    for sent, replies in zip(per_client, results):
        assert len(replies) == len(sent)
        for (name, tree), reply in zip(sent, replies):
            expected = models[name].reference(states[name], {"tree": tree})
            assert reply.outputs.keys() == expected.keys() == ({"h", "c", "logits"} if name == "sst" else {"h", "c"})
            for key, value in expected.items():
                assert reply.outputs[key].dtype == np.float32 and reply.outputs[key].shape == value.shape
                worst = max(worst, float(np.abs(reply.outputs[key] - value).max()))
    assert worst <= TOLERANCE

    with server.client() as client:
        stats = wait_idle(client)
    assert stats["requests"]["ok"] >= len(requests)
    assert {"sst/leaf", "sst/internal", "sst/classifier", "childsum/node"} <= stats["batch_sizes"].keys()
    assert stats["mean_batch_size"] > 1.5
    assert_slots_free(stats)


def test_childsum_tasks_mix_nodes_of_different_arities(server: RunningServer):
    """`stats` counts nodes per task, not arities, so the mix is proved by counting.

    The tree has 18 nodes: 14 leaves and one node each with 1, 3, 4 and 9 children. If
    tasks never mixed arities, each of those four nodes would need a task to itself: at
    least four single-node tasks. Fewer means some task held nodes of different arities
    (here the nodes with 1, 3 and 9 children run as one task of 3, right after the leaves).
    """
    model = build_model(server.config.models["childsum"])
    arities = Counter(Counter(MIXED_ARITY_TREE["parents"]).get(node, 0) for node in range(18))
    assert arities == {0: 14, 1: 1, 3: 1, 4: 1, 9: 1}
    with server.client() as client:
        before = wait_idle(client)["batch_sizes"].get("childsum/node", {})
        reply = client.infer("childsum", {"tree": MIXED_ARITY_TREE})
        after = wait_idle(client)
    expected = model.reference(model.load_weights(), {"tree": MIXED_ARITY_TREE})
    assert all(np.abs(reply.outputs[k] - expected[k]).max() <= TOLERANCE for k in ("h", "c"))

    tasks = {int(size): n - before.get(size, 0) for size, n in after["batch_sizes"]["childsum/node"].items()}
    tasks = {size: n for size, n in tasks.items() if n}
    assert sum(size * n for size, n in tasks.items()) == 18, tasks  # only this request ran
    single_arity_nodes = sum(1 for count in arities.values() if count == 1)
    assert tasks.get(1, 0) < single_arity_nodes, f"tasks by size {tasks}: no proof of a mixed-arity task"
    assert_slots_free(after)


def test_an_invalid_tree_fails_alone(server: RunningServer):
    with server.client() as client:
        with pytest.raises(ServerError) as error:
            client.infer("sst", {"tree": {"tokens": [-1, 1, 2, 3], "parents": [-1, 0, 0, 0]}})
        assert error.value.code == INVALID_INPUT and "exactly 2" in error.value.message
        with pytest.raises(ServerError) as error:
            client.infer("childsum", {"tree": {"tokens": [1, 2], "parents": [1, 0]}})
        assert error.value.code == INVALID_INPUT and "no root" in error.value.message
        reply = client.infer("childsum", {"tree": {"tokens": [1, 2], "parents": [-1, 0]}})
        assert reply.outputs["h"].shape == (64,)
        assert_slots_free(wait_idle(client))


def test_models_op_describes_tree_inputs(server: RunningServer):
    with server.client() as client:
        described = client.models()["models"]
    sst, childsum = described["sst"], described["childsum"]
    assert (sst["kind"], childsum["kind"]) == ("treelstm", "childsum")
    assert (sst["inputs"]["tree"]["max_nodes"], childsum["inputs"]["tree"]["max_nodes"]) == (1000, 200)
    assert sst["outputs"]["logits"] == {"dtype": "float32", "shape": [5]}
    assert "logits" not in childsum["outputs"]
    priorities = {key: cell["priority"] for key, cell in sst["cell_types"].items()}
    assert priorities == {"sst/leaf": 0, "sst/internal": 1, "sst/classifier": 2}
