"""Lane tasks in the worker (worker.lanes): chain lanes run several steps a task, their state carried,
lanes ending along the way, checked against torch.nn.LSTM; and their wire form (common.task)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_LSTM, write_config
from test_worker import io_array, make_backend, wait_signal

from batchmaker.common.lanes import CONSTANT, SEQUENCE, STATE
from batchmaker.common.models import build_model
from batchmaker.common.slots import SCRATCH_SLOT, ZERO_SLOT
from batchmaker.common.task import (
    InlineValues,
    LaneInput,
    LaneTaskMessage,
    SlotList,
    StepDownload,
    TaskInput,
    decode_task,
    encode_task,
)
from batchmaker.worker.backend import arena_ids
from batchmaker.worker.lanes import step_batches
from batchmaker.worker.main import load_cells


@pytest.fixture
def cells(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    specs, modules, kinds = load_cells(config)
    return specs, modules, kinds, build_model(config.models["lstm"]).load_weights()


def packed(sequences: list[list[int]], start: int, steps: list[int]) -> np.ndarray:
    """Tokens of the steps after the first, step after step, of the lanes still going at each (longest first)."""
    return np.array(
        [s[start + j] for j in range(1, max(steps)) for s, n in zip(sequences, steps) if n > j], dtype=np.int64
    )


def lane_task(task_id: int, kinds, sequences, h_in, h_out, start=0, steps=None, downloads=()) -> LaneTaskMessage:
    """An LSTM lane task: lane i runs `sequences[i]` from `start` for `steps[i]` steps (all of it by
    default), from h at rows `h_in` (c at the row after), writing its last h and c to `h_out` (and after)."""
    ids = arena_ids(kinds)
    tokens = next(k for k in kinds if k.dtype == "int64")
    state = next(k for k in kinds if k.dtype == "float32")
    steps = np.array(steps or [len(s) - start for s in sequences], dtype=np.int64)
    lanes = len(sequences)
    first_tokens = np.array([s[start] for s in sequences], dtype=np.int64)
    inline = InlineValues(np.arange(lanes), first_tokens.tobytes())
    h_in = np.array(h_in)
    c_in = np.where(h_in == ZERO_SLOT, ZERO_SLOT, h_in + 1)
    later = packed(sequences, start, list(steps)).tobytes() or None  # the later steps' tokens, as values
    inputs = [
        LaneInput(
            SEQUENCE, 0, ids[tokens][0], TaskInput(ids[tokens][0], np.full(lanes, ZERO_SLOT), None, None, inline), later
        ),
        LaneInput(STATE, 0, ids[state][0], TaskInput(ids[state][0], h_in, None, None, None), None),
        LaneInput(STATE, 1, ids[state][0], TaskInput(ids[state][0], c_in, None, None, None), None),
    ]
    h_out = np.array(h_out)
    outputs = [SlotList(ids[state][0], h_out), SlotList(ids[state][0], h_out + 1)]
    return LaneTaskMessage(task_id, 0, steps, inputs, outputs, [], list(downloads))


def reference(cells, sequences: list[list[int]]) -> list[np.ndarray]:
    """torch.nn.LSTM's h at every step of each sequence."""
    _specs, _modules, _kinds, state = cells
    embedding = torch.nn.Embedding.from_pretrained(state["embedding.weight"])
    lstm = torch.nn.LSTM(32, 64)
    lstm.load_state_dict({k.removeprefix("lstm."): v for k, v in state.items() if k.startswith("lstm.")})
    with torch.inference_mode():
        return [lstm(embedding(torch.tensor(s)))[0].numpy() for s in sequences]


SEQUENCES = [[5, 7, 9, 11, 2], [9, 3, 4], [8, 1, 6], [4]]  # longest first, as a task orders its lanes


def test_step_batches_pack_the_lanes_still_going():
    assert step_batches(np.array([5, 3, 3, 1])) == ([4, 3, 3, 1, 1], [0, 4, 7, 10, 11])
    assert step_batches(np.array([2, 2])) == ([2, 2], [0, 2])
    assert step_batches(np.zeros(0, np.int64)) == ([], [])


@contextmanager
def cpu_worker(cells) -> Iterator[tuple[Any, np.ndarray, tuple[int, int]]]:
    """A CPU backend, its io arena of h rows as the manager maps it, and the (device, io) ids of that kind."""
    kinds = cells[2]
    backend = make_backend("cpu", cells)
    results = io_array(backend, "float32[64]")
    try:
        yield backend, results.array, arena_ids(kinds)[next(k for k in kinds if k.dtype == "float32")]
    finally:
        results.close()
        backend.close()


def run(backend, *tasks: LaneTaskMessage) -> None:
    """Issue the tasks as sent (encoded and decoded), wait for the stream, and check none failed."""
    for task in tasks:
        backend.issue(decode_task(encode_task(task)))
    wait_signal(backend, len(tasks))
    assert [backend.finish(task.task_id) for task in tasks] == [None] * len(tasks)


def test_a_lane_task_runs_every_step_with_lanes_ending_along_the_way(cells):
    kinds = cells[2]
    with cpu_worker(cells) as (backend, results, state):
        # Every step's h of every lane goes to io rows 2, 3, ...; entry e is the e-th row of every step packed.
        count = sum(map(len, SEQUENCES))
        download = StepDownload(0, np.arange(count), state[1], np.arange(2, 2 + count))
        out = [10, 12, 14, 16]
        task = lane_task(1, kinds, SEQUENCES, [ZERO_SLOT] * 4, out, downloads=[download])
        run(backend, task)
        expected = reference(cells, SEQUENCES)
        rows = results[2 : 2 + count]
        for step, (size, offset) in enumerate(zip(*step_batches(task.steps))):
            for lane in range(size):
                np.testing.assert_allclose(rows[offset + lane], expected[lane][step], atol=1e-5)
        arena = backend._tensors[state[0]].numpy()
        np.testing.assert_allclose(arena[out], [e[-1] for e in expected], atol=1e-5)  # each lane's last h, once


def test_a_lane_goes_on_in_the_next_task_from_the_rows_the_last_one_wrote(cells):
    kinds = cells[2]
    with cpu_worker(cells) as (backend, results, state):
        lanes = SEQUENCES[:3]
        first = lane_task(1, kinds, lanes, [ZERO_SLOT] * 3, [10, 12, 14], steps=[2, 2, 1])
        # The second task goes on in another order (by steps left), from where each lane stopped.
        rest = [lanes[i] for i in (0, 2, 1)]
        tokens = [s[b:] for s, b in zip(rest, (2, 1, 2))]
        download = StepDownload(0, np.array([5, 4, 2]), state[1], np.array([2, 3, 4]))  # each lane's last step
        run(backend, first, lane_task(2, kinds, tokens, [10, 14, 12], [20, 22, 24], downloads=[download]))
        np.testing.assert_allclose(results[2:5], [reference(cells, [s])[0][-1] for s in rest], atol=1e-5)


def test_a_constant_input_is_read_once_for_every_step(cells):
    """The zero row as a constant initial c: the same answer as a state starting from zeros, on one step."""
    kinds = cells[2]
    with cpu_worker(cells) as (backend, results, state):
        task = lane_task(1, kinds, [[5], [9]], [ZERO_SLOT] * 2, [SCRATCH_SLOT, SCRATCH_SLOT])
        constant = task.inputs[2]._replace(mode=CONSTANT, source=0)
        download = StepDownload(0, np.array([0, 1]), state[1], np.array([2, 3]))
        run(backend, LaneTaskMessage(1, 0, task.steps, [*task.inputs[:2], constant], task.outputs, [], [download]))
        np.testing.assert_allclose(results[2:4], [reference(cells, [[t]])[0][0] for t in (5, 9)], atol=1e-5)


def test_a_lane_task_that_cannot_be_resolved_fails_alone(cells):
    """An unknown arena, or a sequence without a row for each later step, fails its task only."""
    kinds = cells[2]
    with cpu_worker(cells) as (backend, _, _):
        task = lane_task(1, kinds, [[5, 7]], [ZERO_SLOT], [10])
        tokens = task.inputs[0]
        unknown = LaneTaskMessage(
            1,
            0,
            task.steps,
            [tokens._replace(first=tokens.first._replace(arena=99)), *task.inputs[1:]],
            task.outputs,
            [],
            [],
        )
        short = LaneTaskMessage(2, 0, task.steps, [tokens._replace(later=None), *task.inputs[1:]], task.outputs, [], [])
        for broken in (unknown, short):
            backend.issue(broken)
        backend.issue(lane_task(3, kinds, [[5, 7]], [ZERO_SLOT], [10]))
        wait_signal(backend, 3)
        assert "no arena 99" in (backend.finish(1) or "")
        assert "of 0 rows for 1 rows of later steps" in (backend.finish(2) or "")
        assert backend.finish(3) is None


@pytest.mark.parametrize("steps", [[3], [2, 1]])
def test_the_wire_form_round_trips(cells, steps):
    _specs, _modules, kinds, _ = cells
    sequences = [[1, 2, 3], [4, 5]][: len(steps)]
    download = StepDownload(1, np.array([0]), 3, np.array([7]))
    task = lane_task(
        4, kinds, sequences, [ZERO_SLOT] * len(steps), [10, 12][: len(steps)], steps=steps, downloads=[download]
    )
    back = decode_task(encode_task(task))
    assert isinstance(back, LaneTaskMessage) and back.task_id == 4 and back.steps.tolist() == steps
    assert [(entry.mode, entry.source, entry.arena) for entry in back.inputs] == [
        (entry.mode, entry.source, entry.arena) for entry in task.inputs
    ]
    assert [entry.later for entry in back.inputs] == [entry.later for entry in task.inputs]
    assert back.inputs[1].first.slots.tolist() == task.inputs[1].first.slots.tolist()
    assert back.downloads[0].port == 1 and back.downloads[0].io_slots.tolist() == [7]
    assert back.io_rows()[0][0] == 3
