"""Chain GRU: an embedding followed by one or more GRU layers (see common/models/chain.py).

Outputs `h`, the last layer's final state. The cells are in common/models/chain_cells.py.
"""

from __future__ import annotations

from common.config import ModelConfig
from common.models.base import Model
from common.models.chain import ChainPlanner


class GRUPlanner(ChainPlanner):
    kind = "gru"
    state_names = ("h",)


def planner(config: ModelConfig) -> GRUPlanner:
    return GRUPlanner(config)


def build(config: ModelConfig) -> Model:
    from common.models.chain_cells import GRUModel

    return GRUModel(config)
