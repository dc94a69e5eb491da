"""Seq2Seq with Luong attention and stacked layers, served through a real server against an unbatched
torch reference (torch.nn.LSTM stacks, attention written out in torch, one request at a time), and
every mistake in its config or weights refused with the fix."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL_SEQ2SEQ, start_server, stop_server, wait_idle, write_config

from batchmaker.clients import AsyncClient
from batchmaker.common.config import CellTypeConfig, ConfigError, ModelConfig, load_config
from batchmaker.common.models import build_model
from batchmaker.common.models.seq2seq import MEMORY_PORT, decoding_mismatch
from batchmaker.common.models.seq2seq_cells import Seq2SeqModel
from batchmaker.manager.commands.preflight import check_weights

NEAR_TIE = 1e-4
ATTENTION = 'attention = "luong"\n'


def seq2seq(extra: str) -> str:
    """The test Seq2Seq model with `extra` keys in its table."""
    return SMALL_SEQ2SEQ.replace("max_decode_length = 60\n", f"max_decode_length = 60\n{extra}")


def mixed_requests(seed: int, count: int) -> list[dict]:
    """Source lengths from 1 to 40, some with their own max_len: many lengths share every task."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(count):
        inputs = {"tokens": rng.integers(0, 1000, size=int(rng.integers(1, 41))).tolist()}
        if rng.random() < 0.3:
            inputs["max_len"] = int(rng.integers(1, 60))
        requests.append(inputs)
    return requests


async def send_all(address: str, requests: list[dict]) -> list:
    async with AsyncClient(address, timeout=120) as client:
        return await asyncio.gather(*(client.infer("seq2seq", inputs) for inputs in requests))


def serve_and_compare(tmp_path: Path, extra: str, scheduler: str = "", seed: int = 1, count: int = 60) -> dict:
    """Serve `count` mixed requests at once and check each reply against the reference; the stats after."""
    config = write_config(tmp_path, seq2seq(extra), scheduler=scheduler)
    server = start_server(config, workers=2)
    try:
        requests = mixed_requests(seed, count)
        replies = asyncio.run(send_all(server.address, requests))
        model = build_model(config.models["seq2seq"])
        state = model.load_weights()
        for inputs, reply in zip(requests, replies):
            problem = decoding_mismatch(reply.outputs["tokens"], model.reference(state, inputs), NEAR_TIE)
            assert problem is None, f"source of {len(inputs['tokens'])} tokens: {problem}"
        with server.client() as client:
            stats = wait_idle(client)
        assert stats["requests"]["ok"] == count
        assert all(w["slots_in_use"] == 0 for w in stats["workers"].values()), stats["workers"]
        return stats
    finally:
        stop_server(server)


def batched(stats: dict, cell: str) -> bool:
    """Whether some task of the cell type ran more than one node."""
    return any(int(size) > 1 for size in stats["batch_sizes"][f"seq2seq/{cell}"])


def test_attention_decodes_like_the_reference_with_mixed_source_lengths(tmp_path: Path):
    stats = serve_and_compare(tmp_path, ATTENTION)
    assert set(stats["batch_sizes"]) == {"seq2seq/encoder", "seq2seq/decoder"}
    assert batched(stats, "decoder")


def test_stacked_layers_decode_like_the_reference(tmp_path: Path):
    stats = serve_and_compare(tmp_path, "num_layers = 2\n", seed=2)
    assert set(stats["batch_sizes"]) == {
        f"seq2seq/{part}{tail}" for part in ("encoder", "decoder") for tail in ("", "_l1")
    }


def test_attention_over_three_layers_decodes_like_the_reference(tmp_path: Path):
    stats = serve_and_compare(tmp_path, ATTENTION + "num_layers = 3\n", seed=3)
    assert batched(stats, "decoder_l2")


def test_padded_policy_serves_attention_and_layers_like_the_reference(tmp_path: Path):
    stats = serve_and_compare(tmp_path, ATTENTION + "num_layers = 2\n", 'policy = "padded"\nbucket_width = 10', seed=4)
    assert stats["policy"] == "padded"


def test_one_decoder_task_gathers_each_requests_own_encoder_outputs(make_harness):
    """Requests of 3 and 7 source tokens decode in one task, each attending over its own outputs."""
    harness = make_harness(seq2seq(ATTENTION), max_tasks_to_submit=1)
    worker = harness.workers[0]
    long = harness.admit("seq2seq", {"tokens": list(range(10, 17)), "max_len": 20}, name="long")
    for _ in range(4):  # the long source is 4 steps in when the short one arrives: both end together
        harness.schedule(worker)
        harness.complete_oldest(worker)
    short = harness.admit("seq2seq", {"tokens": [5, 6, 7], "max_len": 20}, name="short")
    decoder = harness.models["seq2seq"].decoder_key
    shared = None
    while shared is None and (harness.schedule(worker) or harness.in_flight(worker)):
        task = harness.complete_oldest(worker)
        if task.spec.key == decoder and set(harness.requests_in(task)) == {"short", "long"}:
            shared = next(message for w, message in harness.sent if message.task_id == task.task_id)
    assert shared is not None, "the two requests' decoder steps never shared a task"
    memory = shared.inputs[MEMORY_PORT].first  # a lane task: read once, for every step
    rows_per_member = np.bincount(memory.segments, minlength=len(shared.steps))
    assert sorted(rows_per_member[rows_per_member > 0].tolist()) == [3, 7]
    assert len(set(memory.slots.tolist())) == 10  # ten live encoder outputs, none reused
    assert {short.request_id, long.request_id} == {"short", "long"}


@pytest.mark.parametrize("bucket_width", [None, 4])
def test_encoder_outputs_keep_their_registers_until_the_last_decoder_step(bucket_width: int | None):
    """Every decoder step reads the same encoder-output registers, and from their encoder step to the last
    decoder step no other node writes them."""
    model = model_of(attention="luong", num_layers=2)
    plan = model._plan(5, 8, bucket_width)
    decoder = plan.lane_cells.index(model.decoder_key)
    nodes = range(plan.lane_bounds[decoder], plan.lane_bounds[decoder + 1])
    read = [
        set(plan.ragged_refs[plan.ragged_start[n] : plan.ragged_start[n] + plan.ragged_count[n], MEMORY_PORT])
        for n in nodes
    ]
    assert len(read) == 8 and all(registers == read[0] for registers in read) and len(read[0]) == 5
    cell_of = [plan.lane_cells[np.searchsorted(plan.lane_bounds, n, "right") - 1] for n in range(plan.nodes)]
    written = [set(plan.outputs[n, : len(model.cell_types[cell_of[n]].outputs)].tolist()) for n in range(plan.nodes)]
    depth = plan.depth
    first_read, last_read = min(depth[n] for n in nodes), max(depth[n] for n in nodes)
    for register in read[0]:  # (a register may hold other values before: a state overwritten in place)
        writers = [n for n in range(plan.nodes) if register in written[n]]
        value = max((n for n in writers if depth[n] < first_read), key=lambda n: depth[n])
        assert cell_of[value] == model.encoder_keys[-1]
        assert not [n for n in writers if depth[value] < depth[n] <= last_read]


def model_of(**params) -> Seq2SeqModel:
    base = {"src_vocab_size": 50, "tgt_vocab_size": 20, "embedding_size": 6, "hidden_size": 8}
    builder = "batchmaker.common.models.seq2seq:build"
    return Seq2SeqModel(ModelConfig("s2s", builder, Path("s2s.pt"), {**base, **params}, CellTypeConfig((1, 2), 0), {}))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"attention": "bahdanau"}, "attention must be one of ['luong'] (or left out for none), got 'bahdanau'"),
        ({"attention": True}, "attention must be one of ['luong'] (or left out for none), got True"),
        ({"num_layers": 0}, "num_layers must be an integer >= 1, got 0"),
        ({"num_layers": "2"}, "num_layers must be an integer >= 1, got '2'"),
    ],
)
def test_bad_config_values_are_refused(params: dict, message: str):
    with pytest.raises(ConfigError) as refused:
        model_of(**params)
    assert message in str(refused.value)


def saved(
    tmp_path: Path, model: Seq2SeqModel, drop: str = "", reshape: tuple[str, tuple[int, ...]] | None = None
) -> Seq2SeqModel:
    """`model` reading a weights file written from its own init_weights, less one key or with one reshaped."""
    state = model.init_weights(0)
    state.pop(drop, None)
    if reshape:
        state[reshape[0]] = torch.zeros(reshape[1])
    path = tmp_path / "s2s.pt"
    torch.save(state, path)
    config = model.config
    return Seq2SeqModel(
        ModelConfig(config.name, config.builder, path, config.params, config.default_cell, config.cells)
    )


@pytest.mark.parametrize(
    ("params", "drop", "expected"),
    [
        ({"attention": "luong"}, "decoder.attention.weight", "lacks 1 of the 14 tensors"),
        ({"attention": "luong"}, "decoder.combine.weight", "lacks 1 of the 14 tensors"),
        ({"num_layers": 2}, "decoder.lstm.weight_ih_l1", "lacks 1 of the 20 tensors"),
        ({"num_layers": 2}, "encoder.lstm.bias_hh_l1", "lacks 1 of the 20 tensors"),
    ],
)
def test_weights_without_a_needed_tensor_are_refused(tmp_path: Path, params: dict, drop: str, expected: str):
    model = saved(tmp_path, model_of(**params), drop=drop)
    with pytest.raises(ConfigError) as refused:
        model.load_weights()
    assert expected in str(refused.value) and drop in str(refused.value)


@pytest.mark.parametrize(
    ("params", "key", "shape", "needed"),
    [
        ({"attention": "luong"}, "decoder.attention.weight", (8, 16), "(8, 8)"),
        ({"attention": "luong"}, "decoder.combine.weight", (8, 8), "(8, 16)"),
        ({"num_layers": 2}, "encoder.lstm.weight_ih_l1", (32, 6), "(32, 8)"),
    ],
)
def test_weights_of_the_wrong_shape_are_refused(tmp_path: Path, params: dict, key: str, shape: tuple, needed: str):
    model = saved(tmp_path, model_of(**params), reshape=(key, shape))
    with pytest.raises(ConfigError) as refused:
        model.load_weights()
    assert f"{key} is {shape} in the file, the config needs {needed}" in str(refused.value)


def test_weights_without_attention_are_refused_before_the_server_starts(tmp_path: Path):
    """The supervisor's preflight (a child process reading the weights against the config) names both tensors."""
    config = write_config(tmp_path, SMALL_SEQ2SEQ)  # weights written without attention
    config.path.write_text(
        config.path.read_text().replace("max_decode_length = 60\n", f"max_decode_length = 60\n{ATTENTION}")
    )
    with pytest.raises(ConfigError) as refused:
        check_weights(load_config(config.path))
    assert "lacks 2 of the 14 tensors" in str(refused.value)
    assert "decoder.attention.weight" in str(refused.value) and "decoder.combine.weight" in str(refused.value)
