"""The CURVE keys a worker, or the supervisor's readiness check, presents on the manager's worker sockets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from batchmaker.common.auth import CurveClient
from batchmaker.common.config import ConfigError
from batchmaker.common.server_config import ServerConfig


def worker_curve(server: ServerConfig, files: Sequence[str] | None = None) -> CurveClient | None:
    """`files` (a worker's own secret key file and the manager's public key file), else the config's
    [server.worker_curve] worker keys; None when neither is given (the worker sockets use no CURVE)."""
    keys = server.worker_curve
    if files is None and keys is None:
        return None
    if files is not None:
        secret, public = Path(files[0]), Path(files[1])
    else:
        secret, public = keys.worker_secret_key, keys.manager_public_key
    try:
        return CurveClient.load(secret, public)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the worker's CURVE keys: {exc}") from None
