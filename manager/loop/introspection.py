"""The `health` and `stats` replies: what the event loop's parts report of themselves, gathered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchmaker.manager.loop.server import Manager


def health(manager: Manager) -> dict[str, Any]:
    """Ready once every expected worker registered; degraded with fewer; draining once told to stop."""
    up = len(manager.workers)
    if manager.draining:
        status = "draining"
    else:
        status = "ready" if up >= manager.expected_workers and up > 0 else "degraded"
    return {
        "status": status,
        "workers": [w.health() for w in manager.workers.values()],
        "expected_workers": manager.expected_workers,
        "max_message_bytes": manager.config.server.max_message_bytes,
    }


def stats(manager: Manager) -> dict[str, Any]:
    """The `stats` reply; requests in flight count those of the batching core and those routed to workers whole."""
    tracing = {} if manager.tracing is None else {"tracing": manager.tracing.snapshot()}
    core = manager.core.snapshot()
    core["requests_in_flight"] += len(manager.router.table)
    return {
        **tracing,
        **manager.stats.snapshot(),
        "policy": manager.config.scheduler.policy,
        "running_batch": manager.config.scheduler.running_batch,
        "host": manager.pool.host,
        **core,
        "routed": manager.router.table.snapshot(),
        "unreachable_clients": manager.frontend.unreachable_clients,
        "client_connections": manager.frontend.connections.live,
        "refused_connections": manager.frontend.connections.refused,
        "plan_caches": manager.versions.plan_caches(),
        "workers": {str(w.worker_id): w.stats() for w in manager.workers.values()},
    }
