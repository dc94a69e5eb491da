"""A test double: the LSTM model of batchmaker.common.models.lstm, failing on cue as the fault tests need.

* a worker whose cell reads token `CRASH_TOKEN` exits at once, without a word, as a poisonous request
  would make it;
* a worker sent SIGUSR1 stops running cells, its heartbeats going on, as a hung device would make it;
* planning a request holding token `SLOW_PLAN_TOKEN` takes `SLOW_PLAN_S`: one manager loop turn far
  past the shortest heartbeat timeout (500 ms), as planning a very long request would make it.

A config names it as `builder = "faulty_lstm:build"` with this file in the config's folder
(conftest.with_faults); its answers are the LSTM's.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
from torch import nn

from batchmaker.common.models.chain_cells import LSTMModel

CRASH_TOKEN = 666
SLOW_PLAN_TOKEN = 667
SLOW_PLAN_S = 2.0
CRASH_EXIT_CODE = 70

_hung = threading.Event()


class FaultyCell(nn.Module):
    """A cell that kills its process on `CRASH_TOKEN` and never returns once the process is hung."""

    def __init__(self, cell: nn.Module):
        super().__init__()
        self.cell = cell

    def forward(self, *args: torch.Tensor) -> Any:
        if _hung.is_set():
            threading.Event().wait()
        if any(arg.dtype == torch.int64 and bool((arg == CRASH_TOKEN).any()) for arg in args):
            os._exit(CRASH_EXIT_CODE)
        return self.cell(*args)


class FaultyLSTMModel(LSTMModel):
    def plan(self, inputs: Any) -> Any:
        if isinstance(inputs, dict) and SLOW_PLAN_TOKEN in inputs.get("tokens", ()):
            time.sleep(SLOW_PLAN_S)
        return super().plan(inputs)

    def make_cells(self, state: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
        """The LSTM's cells, wrapped; SIGUSR1 hangs them (only workers make cells to serve)."""
        signal.signal(signal.SIGUSR1, lambda *_: _hung.set())
        return {key: FaultyCell(cell) for key, cell in super().make_cells(state).items()}


def build(config: Any) -> FaultyLSTMModel:
    return FaultyLSTMModel(config)
