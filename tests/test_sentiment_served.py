"""A sentiment TreeLSTM trained by scripts/train_sst.py, served: the server's predictions are the offline model's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import ROOT, SMALL_SEQ2SEQ, start_server, stop_server, wait_idle, write_config
from test_integration_seq2seq import assert_same_decoding

from batchmaker.clients import AsyncClient
from batchmaker.common.models import build_model
from batchmaker.common.models.sst import load_vocabulary, ptb_to_tree

SST = ROOT / "data" / "sst"


def train_small_model(directory: Path) -> dict:
    """A quick, deterministic training run; returns the JSON summary the script writes beside the weights."""
    out = directory / "treelstm.pt"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_sst.py"), "--out", str(out), "--epochs", "1",
         "--hidden-size", "32", "--embedding-size", "32", "--threads", "1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return json.loads(out.with_suffix(".json").read_text())


def dev_trees() -> tuple[list[dict], list[int]]:
    vocabulary = load_vocabulary(SST / "vocab.txt")
    trees, labels = [], []
    for line in (SST / "dev.txt").read_text().splitlines():
        tokens, parents, node_labels = ptb_to_tree(line, vocabulary)
        trees.append({"tree": {"tokens": tokens, "parents": parents}})
        labels.append(node_labels[parents.index(-1)])
    return trees, labels


def test_served_sentiment_model_predicts_like_the_offline_model(tmp_path: Path):
    summary = train_small_model(tmp_path)
    params = "\n".join(f"{key} = {value}" for key, value in summary["params"].items())
    models = f"""
[models.treelstm]
builder = "batchmaker.common.models.treelstm:build"
weights = "treelstm.pt"
{params}
batch_sizes = [1, 2, 4, 8, 16, 32, 64]
"""
    config = write_config(tmp_path, models + SMALL_SEQ2SEQ)
    server = start_server(config, workers=2)
    try:
        trees, labels = dev_trees()
        rng = np.random.default_rng(0)
        sources = [{"tokens": rng.integers(0, 1000, size=int(n)).tolist()} for n in rng.integers(1, 25, size=80)]

        async def run():
            async with AsyncClient(server.address, timeout=120) as client:
                sentiment = asyncio.gather(*(client.infer("treelstm", tree) for tree in trees))
                translations = asyncio.gather(*(client.infer("seq2seq", source) for source in sources))
                return await asyncio.gather(sentiment, translations)

        sentiment, translations = asyncio.run(run())  # two models served at the same time

        model = build_model(config.models["treelstm"])
        state = model.load_weights()
        served = np.array([int(np.argmax(reply.outputs["logits"])) for reply in sentiment])
        offline = np.array([int(np.argmax(model.reference(state, tree)["logits"])) for tree in trees])
        assert (served == offline).all()
        # The same accuracy the training script measured on its own, batched, offline model.
        assert np.mean(served == np.array(labels)) == summary["dev"]["fine_grained"]

        seq2seq = build_model(config.models["seq2seq"])
        seq2seq_state = seq2seq.load_weights()
        for source, reply in zip(sources, translations):
            assert_same_decoding(reply.outputs["tokens"], seq2seq.reference(seq2seq_state, source))

        with server.client() as client:
            stats = wait_idle(client)
        assert {"treelstm/leaf", "treelstm/internal", "seq2seq/encoder", "seq2seq/decoder"} <= set(stats["batch_sizes"])
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values())
    finally:
        stop_server(server)
