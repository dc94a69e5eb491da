"""A served model of every kind behind the Open Inference Protocol front door (HTTP and gRPC), for the
tests/test_frontdoor_*.py modules, and the unbatched references their answers are checked against."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from conftest import (
    SMALL_LSTM,
    SMALL_SEQ2SEQ,
    SST_TREELSTM,
    RunningServer,
    free_port,
    start_server,
    write_config,
)
from test_custom_model import ELMAN

from batchmaker.common.config import Config
from batchmaker.common.models import build_model

TOLERANCE = 1e-5

MODELS = (
    SMALL_LSTM
    + SMALL_SEQ2SEQ
    + SST_TREELSTM
    + """
[models.tagger]
builder = "batchmaker.common.models.lstm:build"
weights = "tagger.pt"
vocab_size = 300
embedding_size = 16
hidden_size = 16
bidirectional = true
per_step = true
head_size = 3
max_length = 100
batch_sizes = [1, 2, 4, 8]

[models.vectors]
builder = "batchmaker.common.models.lstm:build"
weights = "vectors.pt"
input_size = 6
hidden_size = 16
head_size = 4
max_length = 100
batch_sizes = [1, 2, 4, 8]
"""
    + ELMAN
)

# A binary tree over the SST vocabulary: leaves 0, 1, 3 carry words; 2 and 4 are internal; 4 is the root.
TREE = {"tokens": [5, 17, -1, 40, -1], "parents": [2, 2, 4, 4, -1]}


def door_tables(http: int, grpc: int, http_extra: str = "", grpc_extra: str = "", host: str = "127.0.0.1") -> str:
    return f'\n[http]\naddress = "{host}:{http}"\n{http_extra}\n[grpc]\naddress = "{host}:{grpc}"\n{grpc_extra}\n'


@dataclass
class Door:
    """A running server with its front door, and the addresses tritonclient calls."""

    server: RunningServer
    config: Config
    http: str
    grpc: str
    _reference_models: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # model, weights: loaded once

    def reference(self, model: str, inputs: dict[str, Any]) -> dict[str, Any]:
        planner, state = self._reference_models.get(model) or self._load(model)
        return planner.reference(state, inputs)

    def _load(self, model: str) -> tuple[Any, Any]:
        planner = build_model(self.config.models[model])
        self._reference_models[model] = planner, planner.load_weights()
        return self._reference_models[model]


def start_door(directory: Path, models: str = MODELS, server: str = "", scheduler: str = "", **tables: str) -> Door:
    """A server with its front door; `tables` go to door_tables (`host`: where both listen; clients call loopback)."""
    http, grpc = free_port(), free_port()
    config = write_config(directory, models + door_tables(http, grpc, **tables), server=server, scheduler=scheduler)
    return Door(start_server(config, workers=1), config, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}")


def close(got: np.ndarray, expected: Any) -> bool:
    expected = np.asarray(expected, dtype=np.float32)
    return got.shape == expected.shape and float(np.abs(got - expected).max()) <= TOLERANCE
