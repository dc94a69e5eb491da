"""Chain runs: several steps of the same lanes in one step of the running batch (worker.running_batch), so that
what a step costs beyond its cell (choosing its nodes, gathering, scattering, Python) is paid once for them all.

A node's chain goes on to the next node of its request in a lane the plan runs as a chain when that node is of the
same cell type, the node is alone at its depth (the next one's `need` is one more: nothing else of the request runs
between them), and the next one reads some of the node's outputs (the carried state: an LSTM's h and c, a decoder's
previous token). Run in one go, the carried inputs are gathered at the first step only and handed from step to step
as tensors; a carried output that each step writes to the same row (an LSTM's state in place) is written back once,
when each lane's run ends, and every other output at each step, as a step of its own would write it (the lower layer
of a stacked chain keeps each step's h for the layer above); the other inputs (a chain's tokens) are gathered at
each step. As nothing else of the request runs in between, and nothing of another request reads its rows, the arenas
end as they would after the same steps run one at a time.

A plan's template says, once per plan, how many nodes each node's chain goes on for (`chain`, 1: none after it)
and which outputs of a node its next node reads at which inputs (`carry`: bit `input * STRIDE + output`, and bit
`IN_PLACE + output` for a carried output written to the same row again); a run takes the lanes whose links carry
alike.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from batchmaker.common.config import SchedulerConfig


class ChainBounds(NamedTuple):
    """How long a chain run may be: at most `max_steps` waves, and no longer than a request that arrives meanwhile
    should wait to join (`max_join_delay_us`, at the waves' measured cost): the scheduler's bounds of a multi-step
    task, `[scheduler] max_steps_per_task` and `max_join_delay_us`, which the manager sends its workers."""

    max_steps: int
    max_join_delay_us: int


DEFAULT_BOUNDS = ChainBounds(SchedulerConfig.max_steps_per_task, SchedulerConfig.max_join_delay_us)
STRIDE = 7  # a carry code's bits per input: cell types of more than 7 inputs or outputs run no chains
IN_PLACE = 56  # the carry code's bit of a carried output that stays in its row


def chain_columns(cell: np.ndarray, need: np.ndarray, inputs: np.ndarray, outputs: np.ndarray,
                  chains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Per node of a plan's template (its cell types, needs, the registers each input reads (>= 0) and each output
    writes (>= 0, else -1), and whether its lane may run as a chain): the nodes its chain goes on for, itself
    included, and its link's carry code (0: no link)."""
    count = len(cell)
    chain, carry = np.ones(count, np.int64), np.zeros(count, np.int64)
    ports, outs = inputs.shape[1], outputs.shape[1]
    if count < 2 or outs > STRIDE or ports > STRIDE:
        return chain, carry
    before = outputs[:-1]
    match = (inputs[1:, :, None] == before[:, None, :]) & (before >= 0)[:, None, :]  # [links, inputs, outputs]
    bits = np.int64(1) << (STRIDE * np.arange(ports, dtype=np.int64)[:, None] + np.arange(outs, dtype=np.int64))
    code = match.reshape(count - 1, -1) @ bits.ravel()
    in_place = match.any(1) & (outputs[1:] == before)  # [links, outputs]
    code |= in_place @ (np.int64(1) << (IN_PLACE + np.arange(outs, dtype=np.int64)))
    ok = chains[:-1] & (cell[1:] == cell[:-1]) & (need[1:] == need[:-1] + 1) & match.any((1, 2))
    goes_on = np.zeros(count - 1, bool)
    goes_on[:-1] = ok[1:] & (code[1:] == code[:-1])
    links = np.arange(count - 1)
    last = np.minimum.accumulate(np.where(ok & ~goes_on, links, count)[::-1])[::-1]  # the last link of its run
    chain[:-1] = np.where(ok, last - links + 2, 1)
    carry[:-1] = np.where(ok, code, 0)
    return chain, carry


def run_steps(chain: np.ndarray, carry: np.ndarray, limit: int) -> tuple[np.ndarray, int] | None:
    """For the chosen nodes' `chain` and `carry`: the steps each runs (at most `limit`), those whose links carry
    otherwise than the first long one's running one; and that carry code. None: no chain runs on."""
    steps = np.minimum(chain, limit)
    long = steps > 1
    if not long.any():
        return None
    code = int(carry[long.argmax()])
    steps[long & (carry != code)] = 1
    return steps, code


@functools.cache
def carried(code: int) -> tuple[tuple[int, int], ...]:
    """The (input, output) pairs a carry code says."""
    return tuple(divmod(bit, STRIDE) for bit in range(min(code.bit_length(), IN_PLACE)) if code >> bit & 1)


@functools.cache
def in_place(code: int) -> frozenset[int]:
    """The carried outputs a carry code says stay in their rows: written when a lane's run ends."""
    return frozenset(bit - IN_PLACE for bit in range(IN_PLACE, code.bit_length()) if code >> bit & 1)
