"""A decoder's stop applied on the device (worker.lanes): a lane that emits EOS stands still for the rest
of its task (its state as at EOS, its later tokens EOS) while the lanes beside it decode on unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL_SEQ2SEQ, write_config

from batchmaker.common.graph import Stop
from batchmaker.common.lanes import STATE
from batchmaker.common.task import LaneInput, LaneTaskMessage, SlotList, StepDownload, TaskInput
from batchmaker.worker.backend import arena_ids
from batchmaker.worker.lanes import resolve_lanes, run_lanes, step_batches
from batchmaker.worker.main import load_cells

STEPS = 12
ROWS = 64
H_IN, C_IN, H_OUT, C_OUT = 2, 10, 20, 30  # first arena row of each lane's state, in and out
TOKEN_IN, TOKEN_OUT = 2, 10


@pytest.fixture
def decoder(tmp_path: Path):
    config = write_config(tmp_path, SMALL_SEQ2SEQ)
    specs, cells, kinds = load_cells(config)
    index = next(i for i, spec in enumerate(specs) if spec.key == "seq2seq/decoder")
    return index, specs, cells, kinds


def unmasked(cell: torch.nn.Module, tokens: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
    """Every step of every lane, batched as in the task, with nothing stopped: tokens, h and c per step."""
    steps = []
    with torch.inference_mode():
        for _ in range(STEPS):
            h, c, tokens = cell(tokens, h, c)
            steps.append((tokens.clone(), h.clone(), c.clone()))
    return steps


def lanes_that_stop(cell: torch.nn.Module, eos: int, go: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First tokens and states of four lanes: one that reaches EOS within the task, one that does not, one
    whose first step emits EOS, and one that starts stopped (its token in is EOS already)."""
    generator = torch.Generator().manual_seed(0)
    found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    while len(found) < 3:
        h, c = torch.randn(64, 64, generator=generator), torch.randn(64, 64, generator=generator)
        steps = unmasked(cell, torch.full((64,), go), h, c)
        emitted = torch.stack([tokens for tokens, _, _ in steps]) == eos
        first = torch.where(emitted.any(0), emitted.int().argmax(0), STEPS)
        for name, lanes in (
            ("midway", (first > 2) & (first < STEPS - 2)),
            ("never", first == STEPS),
            ("first", first == 0),
        ):
            if name not in found and lanes.any():
                lane = int(lanes.nonzero()[0])
                found[name] = h[lane], c[lane]
    h = torch.stack([found["midway"][0], found["never"][0], found["first"][0], found["midway"][0]])
    c = torch.stack([found["midway"][1], found["never"][1], found["first"][1], found["midway"][1]])
    return torch.tensor([go, go, go, eos]), h, c


def test_a_lane_past_its_eos_stands_still_while_the_others_decode_on(decoder):
    index, specs, cells, kinds = decoder
    spec, cell = specs[index], cells[index]
    eos = spec.stop.value
    assert spec.stop == Stop(2, eos)
    tokens, h, c = lanes_that_stop(cell, eos, go=1)
    lanes = len(tokens)
    ids = arena_ids(kinds)
    token_kind, state_kind = spec.outputs[2], spec.outputs[0]
    tensors = [torch.zeros((ROWS, *kind.shape), dtype=getattr(torch, kind.dtype)) for kind in kinds for _ in (0, 1)]
    token_arena, token_io = ids[token_kind]
    state_arena = ids[state_kind][0]
    tensors[token_arena][TOKEN_IN : TOKEN_IN + lanes] = tokens
    tensors[state_arena][H_IN : H_IN + lanes] = h
    tensors[state_arena][C_IN : C_IN + lanes] = c

    def rows(arena: int, start: int) -> TaskInput:
        return TaskInput(arena, np.arange(start, start + lanes), None, None, None)

    inputs = [
        LaneInput(STATE, 2, token_arena, rows(token_arena, TOKEN_IN), None),
        LaneInput(STATE, 0, state_arena, rows(state_arena, H_IN), None),
        LaneInput(STATE, 1, state_arena, rows(state_arena, C_IN), None),
    ]
    outputs = [
        SlotList(state_arena, np.arange(H_OUT, H_OUT + lanes)),
        SlotList(state_arena, np.arange(C_OUT, C_OUT + lanes)),
    ]
    outputs.append(SlotList(token_arena, np.arange(TOKEN_OUT, TOKEN_OUT + lanes)))
    packed = STEPS * lanes
    download = StepDownload(2, np.arange(packed), token_io, np.arange(packed))
    message = LaneTaskMessage(1, index, np.full(lanes, STEPS), inputs, outputs, [], [download])
    assert step_batches(message.steps)[0] == [lanes] * STEPS
    with torch.inference_mode():
        task = resolve_lanes(message, tensors, cells, {}, spec.stop)
        (downloaded,) = run_lanes(task)
    served = downloaded.view(STEPS, lanes)

    steps = unmasked(cell, tokens, h, c)
    for lane, kind in enumerate(("midway", "never", "first", "stopped")):
        emitted = [int(tokens[lane]) for tokens, _, _ in steps]
        end = -1 if kind == "stopped" else (emitted.index(eos) if eos in emitted else STEPS - 1)
        expected = [eos if step > end else token for step, token in enumerate(emitted)]
        assert served[:, lane].tolist() == expected, kind
        final_h, final_c = (h[lane], c[lane]) if end < 0 else (steps[end][1][lane], steps[end][2][lane])
        torch.testing.assert_close(tensors[state_arena][H_OUT + lane], final_h, rtol=0, atol=1e-6)
        torch.testing.assert_close(tensors[state_arena][C_OUT + lane], final_c, rtol=0, atol=1e-6)
        assert int(tensors[token_arena][TOKEN_OUT + lane]) == (eos if kind != "never" else emitted[-1])
    assert served[:, 0].tolist().count(eos) > 2  # EOS mid-task: later steps masked
