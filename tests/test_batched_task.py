"""worker.batched_task: a multi-step task's slot lists made into tensors once (`resolve`), and the rows a
cell reads (`gather`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_worker import cells, lstm_step_task, multi_step  # noqa: F401 (a fixture)

from batchmaker.common.slots import ZERO_SLOT
from batchmaker.common.task import TaskMessage, decode_task, encode_task
from batchmaker.worker.batched_task import Inline, InputRows, gather, resolve


def without_tokens(step: TaskMessage) -> TaskMessage:
    """The step with its tokens read from the arena instead of sent inline."""
    tokens = (*step.inputs[0][:4], None)
    return TaskMessage(
        step.task_id, step.cell_index, step.batch_size, [tokens, *step.inputs[1:]], step.outputs, step.downloads
    )


def test_a_multi_step_task_is_resolved_into_one_index_tensor(cells):  # noqa: F811
    _, modules, kinds, _ = cells
    tensors = [
        torch.zeros(8, *kind.shape, dtype=getattr(torch, kind.dtype)) for kind in kinds for _ in ("device", "io")
    ]
    steps = [
        lstm_step_task(1, kinds, [5, 9], [ZERO_SLOT, ZERO_SLOT], [10, 12], None),
        without_tokens(lstm_step_task(1, kinds, [7, 3], [10, 12], [20, 22], [3, 4])),
        lstm_step_task(1, kinds, [4], [20], [30], [2]),
    ]
    issued = resolve(decode_task(encode_task(multi_step(1, steps))), tensors, modules, {})

    assert len(issued) == 3 and {step.task_id for step in issued} == {1}
    storages = {rows.slots.untyped_storage().data_ptr() for step in issued for rows in step.inputs}
    storages |= {slots.untyped_storage().data_ptr() for step in issued for _, slots in step.outputs}
    assert len(storages) == 1  # every step's slot lists are views of one tensor
    for step, sent in zip(issued, steps):
        assert [rows.slots.tolist() for rows in step.inputs] == [list(entry[1]) for entry in sent.inputs]
        assert [slots.tolist() for _, slots in step.outputs] == [list(slots) for _, slots in sent.outputs]
        assert [copy.io_slots.tolist() for copy in step.downloads] == [list(entry[3]) for entry in sent.downloads]
    tokens = [None if step.inputs[0].inline is None else step.inputs[0].inline.rows.tolist() for step in issued]
    assert tokens == [[5, 9], None, [4]]


def test_inline_values_that_do_not_fill_their_rows_fail_the_task(cells):  # noqa: F811
    """A step with a token too many and the next with one too few: each is wrong, though they add up."""
    _, modules, kinds, _ = cells
    tensors = [
        torch.zeros(8, *kind.shape, dtype=getattr(torch, kind.dtype)) for kind in kinds for _ in ("device", "io")
    ]
    long, short = (lstm_step_task(1, kinds, [5, 9], [ZERO_SLOT, ZERO_SLOT], [10, 12], None) for _ in range(2))
    tokens = long.inputs[0]
    long.inputs[0] = (*tokens[:4], (tokens[4][0], np.array([5, 9, 4]).tobytes()))
    short.inputs[0] = (*tokens[:4], (tokens[4][0], np.array([7]).tobytes()))
    with pytest.raises(ValueError, match="24 bytes of inline values for 2 rows of 8 bytes"):
        resolve(multi_step(1, [long, short]), tensors, modules, {})


def test_inline_values_filling_every_row_are_the_input_itself_and_otherwise_go_over_the_gathered_rows():
    arena = torch.arange(8, dtype=torch.int64).view(4, 2)
    values = torch.tensor([[7, 7], [9, 9]])
    whole = InputRows(arena, torch.tensor([0, 0]), None, [], Inline(torch.tensor([0, 1]), values, whole=True))
    assert gather([whole])[0] is values
    part = InputRows(arena, torch.tensor([0, 0, 3]), None, [], Inline(torch.tensor([0, 1]), values))
    assert gather([part])[0].tolist() == [[7, 7], [9, 9], [6, 7]]
