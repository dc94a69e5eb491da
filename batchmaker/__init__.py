"""batchmaker: a low-latency inference server for recurrent and recursive networks, with cellular batching.

The package's parts live in the repository's top-level folders, mapped under this namespace by
pyproject.toml: `batchmaker.manager` (manager/), `batchmaker.worker` (worker/), `batchmaker.common`
(common/), `batchmaker.clients` (clients/) and `batchmaker.bench` (bench/). The client API is
importable from here: `from batchmaker import Client, AsyncClient, ServerError`. It is imported on
first use, so that the server's processes, which import their own parts, do not load the clients.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchmaker.clients import (
        AsyncClient,
        Backoff,
        Client,
        Partial,
        Reply,
        RequestTooLarge,
        ServerError,
        ServerLost,
    )

__all__ = ["AsyncClient", "Backoff", "Client", "Partial", "Reply", "RequestTooLarge", "ServerError", "ServerLost"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("batchmaker.clients"), name)
    raise AttributeError(f"module 'batchmaker' has no attribute {name!r}")
