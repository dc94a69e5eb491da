"""Lane tasks on the CUDA backend's tensor work, on fake "cuda" tensors (see test_cuda_fake.py): every
chain cell type of the built-in models runs a lane task of k steps as one staging copy, k steps
enqueued and one counter write, with no host synchronization, whatever its lanes read (a decoder's
stop included)."""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_fake import ACCESSIBLE_PEER, ROOT, ROWS, FakeCalls, all_cells, fake_cuda, fake_tasks, slots

from batchmaker.common.config import load_config
from batchmaker.common.lanes import SEQUENCE, STATE, LaneLayout
from batchmaker.common.models.base import build_planner
from batchmaker.common.task import LaneInput, LaneTaskMessage, SlotList, StepDownload, TaskInput
from batchmaker.worker.device_tasks import staged_lane_bytes

STEPS = np.array([4, 2, 2, 1], dtype=np.int64)  # lanes ending along the way: batches 4, 3, 1, 1


def chain_layouts() -> dict[str, LaneLayout]:
    """The layout of every chain cell type of the built-in models, from the plans of real requests."""
    config = load_config(ROOT / "configs" / "all.toml")
    found = {}
    for model_config in config.models.values():
        planner = build_planner(model_config)
        if planner.kind in ("treelstm", "childsum"):
            continue
        plan = planner.plan({"tokens": [5, 6, 7]}).plan
        found.update({key: layout for key, layout in zip(plan.lane_cells, plan.lane_layouts) if layout is not None})
    return found


@pytest.fixture
def layout():
    return all_cells()


def lane_task(task_id: int, cell_index: int, spec, rules: LaneLayout, ids) -> LaneTaskMessage:
    """A lane task like the manager's: states read first from both peers and inline, sequences packed,
    every output's last value written, and every output of every step downloaded."""
    lanes, packed = len(STEPS), int(STEPS.sum())
    inputs = []
    for kind, (mode, source) in zip(spec.inputs, rules.inputs):
        arena = ids[kind][0]
        first = TaskInput(arena, slots(np.arange(lanes) + 2), None, None, None)
        if kind.dtype == "int64":
            first = first._replace(values=(slots([0]), np.zeros((1, *kind.shape), dtype=kind.dtype).tobytes()))
        else:
            first = first._replace(remote=[(ACCESSIBLE_PEER, arena, slots([5]), slots([lanes - 1]))])
        later = None
        if mode == SEQUENCE:  # the later steps' rows read from the arena, those of the last lane from a peer
            later = TaskInput(arena, slots(np.arange(packed - lanes) + 2), None, None, None)
            later = later._replace(remote=[(ACCESSIBLE_PEER, arena, slots([5]), slots([packed - lanes - 1]))])
        inputs.append(LaneInput(mode, source, arena, first, later))
    outputs = [  # an output read outside the lane at every step is written at every step
        SlotList(ids[kind][0], slots(np.arange(packed if i in rules.every_step else lanes) + 100 + 10 * i))
        for i, kind in enumerate(spec.outputs)
    ]
    every_step = [(port, slots(np.arange(packed))) for port in rules.every_step]
    downloads = [
        StepDownload(port, slots(np.arange(packed)), ids[kind][1], slots(np.arange(packed)))
        for port, kind in enumerate(spec.outputs)
    ]
    return LaneTaskMessage(task_id, cell_index, STEPS, inputs, outputs, every_step, downloads)


def test_a_lane_task_of_every_chain_cell_is_one_copy_k_steps_and_one_signal(layout):
    specs, _, _ = layout
    layouts = chain_layouts()
    assert {"lstm/layer0", "gru/layer0", "gru/layer1", "seq2seq/encoder", "seq2seq/decoder"} <= set(layouts)
    assert layouts["gru/layer0"].every_step == (0,) and layouts["gru/layer1"].inputs[0].mode == SEQUENCE  # stacked
    # the token fed back
    assert any(rule.mode == STATE and rule.source == 2 for rule in layouts["seq2seq/decoder"].inputs)
    chains = [(index, spec) for index, spec in enumerate(specs) if spec.key in layouts]
    assert {spec.key: spec for _, spec in chains}["seq2seq/decoder"].stop is not None  # its EOS masked, no sync
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        for task_id, (index, spec) in enumerate(chains, start=1):
            task = lane_task(task_id, index, spec, layouts[spec.key], ids)
            assert staged_lane_bytes(task) > 0
            tasks.issue(task)
            assert calls.signals == task_id
            assert tasks.finish(task_id) is None, spec.key
    assert calls.sent == len(chains)  # each task's rows, inline values and sequences in one copy
    # A download's rows are one run of io rows: one copy each, whatever the number of steps.
    assert calls.downloads == sum(len(spec.outputs) for _, spec in chains)
    assert calls.count("synchronize") == 0


def test_a_lane_task_it_cannot_issue_enqueues_nothing_and_completes_with_its_error(layout):
    specs, _, _ = layout
    index = next(i for i, spec in enumerate(specs) if spec.key == "lstm/layer0")
    spec, rules = specs[index], chain_layouts()["lstm/layer0"]
    with fake_cuda():
        calls = FakeCalls()
        tasks, ids = fake_tasks(layout, calls)
        good = lane_task(1, index, spec, rules, ids)
        outside = [SlotList(good.outputs[0].arena, slots([2, 3, 4, ROWS])), *good.outputs[1:]]
        out_of_range = LaneTaskMessage(1, index, STEPS, good.inputs, outside, [], [])
        tokens = good.inputs[0]
        short = tokens._replace(later=tokens.later._replace(slots=tokens.later.slots[:1], remote=None))
        too_few_rows = LaneTaskMessage(2, index, STEPS, [short, *good.inputs[1:]], good.outputs, [], [])
        ascending = LaneTaskMessage(3, index, STEPS[::-1].copy(), good.inputs, good.outputs, [], [])
        for task in (out_of_range, too_few_rows, ascending):
            tasks.issue(task)
        assert "out of range" in tasks.finish(1)
        assert "of 1 rows for 5 rows of later steps" in tasks.finish(2)
        assert "descending" in tasks.finish(3)
    assert calls.sent == 0 and calls.signals == 3
