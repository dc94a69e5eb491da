"""Built-in models, the model interface and weight-file helpers."""

from __future__ import annotations

import zlib
from pathlib import Path

from common.config import Config
from common.models.base import Model, build_model, save_weights

__all__ = ["Model", "build_model", "init_missing_weights"]


def init_missing_weights(config: Config) -> list[Path]:
    """Create, deterministically, every weights file the config names that does not exist yet.

    The seed derives from the model's name, so every machine generates the same weights.
    """
    created = []
    for name, model_config in config.models.items():
        if model_config.weights.exists():
            continue
        model = build_model(model_config)
        save_weights(model.init_weights(seed=zlib.crc32(name.encode())), model_config.weights)
        created.append(model_config.weights)
    return created
