"""Chain LSTM: an embedding followed by one or more LSTM layers (see common/models/chain.py).

Outputs `h` and `c`, the last layer's final state. The cells are in common/models/chain_cells.py.
"""

from __future__ import annotations

from batchmaker.common.config import ModelConfig
from batchmaker.common.models.base import Model, model_named
from batchmaker.common.models.chain import ChainPlanner


class LSTMPlanner(ChainPlanner):
    kind = "lstm"
    state_names = ("h", "c")


def planner(config: ModelConfig) -> LSTMPlanner:
    return LSTMPlanner(config)


def build(config: ModelConfig) -> Model:
    return model_named("batchmaker.common.models.chain_cells:LSTMModel", config)
