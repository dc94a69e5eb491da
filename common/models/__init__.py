"""Built-in models, the model interface and weight-file helpers."""

from __future__ import annotations

import zlib
from pathlib import Path

from batchmaker.common.config import Config
from batchmaker.common.models.base import Model, build_model, save_weights
from batchmaker.common.models.weights import mark_random

__all__ = ["Model", "build_model", "init_missing_weights"]


def init_missing_weights(config: Config) -> list[Path]:
    """Create, deterministically, every weights file the config names that does not exist yet.

    The seed derives from the model's name, so every machine generates the same weights. The files
    are marked as random: a server given one warns that its answers mean nothing.
    """
    created = []
    for name, model_config in config.models.items():
        if model_config.weights.exists():
            continue
        model = build_model(model_config)
        seed = zlib.crc32(name.encode())
        save_weights(mark_random(model.init_weights(seed=seed), seed), model_config.weights)
        created.append(model_config.weights)
    return created
