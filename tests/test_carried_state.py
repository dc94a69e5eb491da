"""Chain steps that repeat the step before them: sent as their values alone (common.task), resolved once
and run with their state carried in the cell's results (worker.batched_task), and formed together by
the manager (manager.scheduler, manager.dispatch)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from test_worker import cells, expected_h, io_array, lstm_step_task, make_backend, multi_step, wait_signal  # noqa: F401

from batchmaker.common.slots import SCRATCH_SLOT, ZERO_SLOT
from batchmaker.common.task import InlineValues, TaskInput, TaskMessage, TaskStep, decode_task, encode_task
from batchmaker.worker.batched_task import Inline, InputRows, gather, resolve


def again(step: TaskMessage | TaskStep, tokens: list[int], downloads: list | None = None) -> TaskStep:
    """The step on the very same slot arrays, with other tokens (and downloads)."""
    token_input = TaskInput(*step.inputs[0])
    values = InlineValues(np.arange(len(tokens)), np.array(tokens, dtype=np.int64).tobytes())
    inputs = [token_input._replace(values=values), *(TaskInput(*entry) for entry in step.inputs[1:])]
    return TaskStep(step.batch_size, inputs, step.outputs, downloads or [])


def in_place_chain(kinds, sequences: list[list[int]], results_io: list[int]) -> TaskMessage:
    """A task running `sequences` (of one length) in place on state rows 10, 12, ...: a first step
    reading zeros, then steps that repeat the second, the last copying h to `results_io`."""
    columns = list(zip(*sequences))
    rows = [10 + 2 * i for i in range(len(sequences))]
    first = lstm_step_task(1, kinds, list(columns[0]), [ZERO_SLOT] * len(rows), rows, None)
    second = lstm_step_task(1, kinds, list(columns[1]), rows, rows, None)
    later = [second]
    for column in columns[2:]:
        later.append(again(later[-1], list(column)))
    last = later[-1]
    downloads = lstm_step_task(1, kinds, list(columns[-1]), rows, rows, results_io).downloads
    later[-1] = TaskStep(last.batch_size, last.inputs, last.outputs, downloads)
    return TaskMessage(1, 0, first.batch_size, first.inputs, first.outputs, first.downloads,
                       tuple(TaskStep(s.batch_size, s.inputs, s.outputs, s.downloads) for s in later))  # fmt: skip


def test_a_step_on_the_previous_steps_slot_arrays_is_sent_as_its_values_and_downloads_alone(cells):  # noqa: F811
    _, _, kinds, _ = cells
    message = in_place_chain(kinds, [[5, 7, 4, 8], [9, 3, 2, 6]], [3, 4])
    fields = msgpack.unpackb(encode_task(message))
    assert [len(entry) for entry in fields[6]] == [4, 2, 2]  # the second step in full, then values alone
    decoded = decode_task(encode_task(message)).steps()
    assert all(step.inputs[1].slots is decoded[1].inputs[1].slots for step in decoded[2:])
    assert all(step.outputs is decoded[1].outputs for step in decoded[2:])
    tokens_sent = [np.frombuffer(step.inputs[0].values.data, np.int64).tolist() for step in decoded]
    assert tokens_sent == [[5, 9], [7, 3], [4, 2], [8, 6]]
    assert [len(step.downloads) for step in decoded] == [0, 0, 0, 1]
    assert decoded[3].downloads[0].io_slots.tolist() == [3, 4]


def test_equal_slot_lists_that_are_not_shared_are_sent_in_full(cells):  # noqa: F811
    _, _, kinds, _ = cells
    steps = [lstm_step_task(1, kinds, [5], [10], [10], None), lstm_step_task(1, kinds, [7], [10], [10], None)]
    assert [len(entry) for entry in msgpack.unpackb(encode_task(multi_step(1, steps)))[6]] == [4]


def test_a_repeated_step_with_values_for_other_inputs_than_the_step_before_is_refused(cells):  # noqa: F811
    _, _, kinds, _ = cells
    fields = msgpack.unpackb(encode_task(in_place_chain(kinds, [[5, 7, 4]], [3])))
    fields[6][1][0].append(None)  # a value for a fourth input
    with pytest.raises(ValueError, match="values for 4 inputs; the step before it has 3"):
        decode_task(msgpack.packb(fields))


def test_repeated_steps_carry_their_state_and_match_the_reference(cells):  # noqa: F811
    """Two sequences of 5 in place: steps 3-5 carry h and c from the step before; only the last writes them."""
    _, modules, kinds, _ = cells
    sequences = [[5, 7, 4, 8, 1], [9, 3, 2, 6, 11]]
    message = decode_task(encode_task(in_place_chain(kinds, sequences, [3, 4])))
    tensors = [torch.zeros(16, *kind.shape, dtype=getattr(torch, kind.dtype)) for kind in kinds for _ in ("device", "io")]
    issued = resolve(message, tensors, modules, {}, carry=True)
    assert [step.carried for step in issued] == [(), (), ((1, 0), (2, 1)), ((1, 0), (2, 1)), ((1, 0), (2, 1))]
    assert [sorted(step.kept) for step in issued] == [[], [0, 1], [0, 1], [0, 1], []]
    backend = make_backend("cpu", cells)
    try:
        results = io_array(backend, "float32[64]")
        backend.issue(message)
        wait_signal(backend, 1)
        assert backend.finish(1) is None
        got = results.array[[3, 4]].copy()
        results.close()
    finally:
        backend.close()
    np.testing.assert_allclose(got, expected_h(cells, sequences), atol=1e-5)


def test_padding_rows_may_carry_anything_but_an_input_reading_a_carried_row_elsewhere_stops_the_carry(cells):  # noqa: F811
    _, modules, kinds, _ = cells
    tensors = [torch.zeros(16, *kind.shape, dtype=getattr(torch, kind.dtype)) for kind in kinds for _ in ("device", "io")]
    padded = lstm_step_task(1, kinds, [5, 9], [10, 12], [10, 12], None)
    padded.inputs[1] = (*padded.inputs[1][:1], np.array([10, 12, ZERO_SLOT]), *padded.inputs[1][2:])
    padded.inputs[2] = (*padded.inputs[2][:1], np.array([11, 13, ZERO_SLOT]), *padded.inputs[2][2:])
    padded.outputs[0] = (padded.outputs[0][0], np.array([10, 12, SCRATCH_SLOT]))
    padded.outputs[1] = (padded.outputs[1][0], np.array([11, 13, SCRATCH_SLOT]))
    padded.inputs[0] = (padded.inputs[0][0], np.full(3, ZERO_SLOT), None, None, (np.arange(2), padded.inputs[0][4][1]))
    padded = TaskMessage(1, 0, 3, padded.inputs, padded.outputs, [])
    issued = resolve(multi_step(1, [padded, again(padded, [7, 3])]), tensors, modules, {}, carry=True)
    assert issued[1].carried == ((1, 0), (2, 1))
    crossed = lstm_step_task(1, kinds, [5, 9], [10, 12], [10, 12], None)
    crossed.inputs[2] = (*crossed.inputs[2][:1], np.array([12, 13]), *crossed.inputs[2][2:])  # reads h of row 12 as c
    issued = resolve(multi_step(1, [crossed, again(crossed, [7, 3])]), tensors, modules, {}, carry=True)
    assert issued[1].carried == () and not issued[0].kept


def test_inline_values_filling_every_row_are_the_input_itself_and_otherwise_go_over_the_gathered_rows():
    arena = torch.arange(8, dtype=torch.int64).view(4, 2)
    values = torch.tensor([[7, 7], [9, 9]])
    whole = InputRows(arena, torch.tensor([0, 0]), None, [], Inline(torch.tensor([0, 1]), values, whole=True))
    assert gather([whole])[0] is values
    part = InputRows(arena, torch.tensor([0, 0, 3]), None, [], Inline(torch.tensor([0, 1]), values))
    assert gather([part])[0].tolist() == [[7, 7], [9, 9], [6, 7]]
