"""Chain GRU: an embedding followed by one or more GRU layers (see common/models/chain.py).

Outputs `h`, the last layer's final state. The cells are in common/models/chain_cells.py.
"""

from __future__ import annotations

from batchmaker.common.config import ModelConfig
from batchmaker.common.models.base import Model, model_named
from batchmaker.common.models.chain import ChainPlanner


class GRUPlanner(ChainPlanner):
    kind = "gru"
    state_names = ("h",)


def planner(config: ModelConfig) -> GRUPlanner:
    return GRUPlanner(config)


def build(config: ModelConfig) -> Model:
    return model_named("batchmaker.common.models.chain_cells:GRUModel", config)
