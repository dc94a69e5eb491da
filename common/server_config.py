"""The [server] table: the manager's addresses, its devices and workers, its limits and timeouts, and the
CurveZMQ keys of its client and worker sockets (docs/deploy.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchmaker.common.addresses import is_loopback
from batchmaker.common.config_values import ConfigError, boolean, check_keys, positive_int, string, subtable

# Reads of another GPU's arenas: also staged through a CUDA context on the other GPU where the two have no
# peer access; only where they have it; none at all.
CROSS_GPU_READS = ("always", "peer-access", "never")


@dataclass(frozen=True)
class CurveConfig:
    """CurveZMQ on the client socket: the server's key pair and the directory of allowed client public keys."""

    secret_key: Path
    allowed_clients: Path


@dataclass(frozen=True)
class WorkerCurveConfig:
    """CurveZMQ on the manager's worker sockets. The manager reads `secret_key` (its key pair there) and
    `allowed_workers` (the directory of public keys that may register); workers, and the supervisor's
    readiness checks, read `worker_secret_key` and `manager_public_key` unless given keys of their own."""

    secret_key: Path
    allowed_workers: Path
    worker_secret_key: Path
    manager_public_key: Path


@dataclass(frozen=True)
class ServerConfig:
    address: str = "tcp://127.0.0.1:5555"
    worker_address: str = "auto"
    devices: str | tuple[str, ...] = "auto"
    cpu_workers: int = 1
    threads_per_worker: int = 1
    arena_rows: int = 16384
    io_rows: int = 16384
    max_message_bytes: int = 1024 * 1024  # a client frame over this closes its connection (docs/deploy.md, "Limits")
    max_backlog_bytes: int = 64 * 1024 * 1024  # replies one client may leave unread before it counts as gone
    max_clients: int = 1024  # live client connections; one more is closed when accepted (docs/deploy.md, "Limits")
    default_deadline_ms: int = 0  # 0: requests without deadline_ms have none
    heartbeat_timeout_ms: int = 3000  # a worker silent this long is taken for dead
    hang_timeout_ms: int = 10000  # a worker whose stream does not advance this long, with tasks in flight, is hung
    drain_timeout_ms: int = 30000  # on SIGTERM, how long in-flight requests may take to finish
    restart_budget: int = 10  # worker restarts allowed per 10 minutes before the supervisor gives up
    load_wait_ms: int = 60000  # a model load with no worker registered waits this long for one (docs/deploy.md)
    # a request replayed this often after losing its worker fails with INTERNAL when it loses another
    max_replays: int = 2
    max_queued_requests: int = 10000  # admission bound: requests in flight; beyond it new ones get OVERLOADED
    max_queued_nodes: int = 1_000_000  # admission bound: cells admitted and not yet submitted to a worker
    max_queue_delay_ms: int = 250  # admission: refuse when the expected wait exceeds this; 0: off
    unreachable_client_ms: int = 30000  # a client that reads none of its waiting replies this long is taken for gone
    session_ttl_ms: int = 60000  # a session idle this long is dropped (docs/protocol.md, "Sessions")
    max_sessions: int = 10000  # live sessions; beyond it a new one gets OVERLOADED
    metrics_address: str = ""  # "host:port" for the Prometheus /metrics endpoint; empty: off
    cuda_graphs: bool = False  # GPU workers replay each cell as a captured CUDA graph (worker/cuda_graphs.py)
    cross_gpu_reads: str = "always"  # which other GPUs' arenas a GPU worker reads: CROSS_GPU_READS
    curve: CurveConfig | None = None
    worker_curve: WorkerCurveConfig | None = None
    insecure_workers: bool = False  # a worker_address other machines can reach, without worker_curve


def parse_server(table: dict[str, Any], path: Path) -> ServerConfig:
    defaults = ServerConfig()
    check_keys(table, set(ServerConfig.__dataclass_fields__), "server", path)
    metrics_address = table.get("metrics_address", defaults.metrics_address)
    if not isinstance(metrics_address, str) or (metrics_address and ":" not in metrics_address):
        raise ConfigError(f'{path}: [server] metrics_address must look like "127.0.0.1:9100" (or "" for none)')
    devices = table.get("devices", defaults.devices)
    if isinstance(devices, list):
        if not devices or not all(isinstance(d, str) and (d == "cpu" or d.startswith("cuda:")) for d in devices):
            raise ConfigError(
                f"{path}: [server] devices must be \"auto\", \"cpu\" or a list like [\"cuda:0\", \"cuda:1\"]"
            )
        if "cpu" in devices and len(set(devices)) > 1:
            # Peers read each other's arenas: GPUs through CUDA IPC, CPU workers through shared memory;
            # a worker of one kind cannot open the other's, so the first migrated value would fail.
            raise ConfigError(
                f"{path}: [server] devices mixes cpu with GPUs {sorted(set(devices) - {'cpu'})}; "
                "use GPUs only, or \"cpu\" with cpu_workers"
            )
        devices = tuple(devices)
    elif devices not in ("auto", "cpu"):
        raise ConfigError(f"{path}: [server] devices must be \"auto\", \"cpu\" or a list of devices, got {devices!r}")
    cuda_graphs = boolean(table, "cuda_graphs", defaults.cuda_graphs, "server", path)
    if cuda_graphs and (devices == "cpu" or (isinstance(devices, tuple) and "cpu" in devices)):
        raise ConfigError(f"{path}: [server] cuda_graphs = true needs GPU workers, but devices is {devices!r}")
    cross_gpu_reads = string(table, "cross_gpu_reads", defaults.cross_gpu_reads, "server", path)
    if cross_gpu_reads not in CROSS_GPU_READS:
        raise ConfigError(
            f"{path}: [server] cross_gpu_reads must be one of {', '.join(CROSS_GPU_READS)}, got {cross_gpu_reads!r}"
        )
    server = ServerConfig(
        address=string(table, "address", defaults.address, "server", path),
        worker_address=string(table, "worker_address", defaults.worker_address, "server", path),
        devices=devices,
        cpu_workers=positive_int(table, "cpu_workers", defaults.cpu_workers, "server", path),
        threads_per_worker=positive_int(table, "threads_per_worker", defaults.threads_per_worker, "server", path),
        arena_rows=positive_int(table, "arena_rows", defaults.arena_rows, "server", path, minimum=16),
        io_rows=positive_int(table, "io_rows", defaults.io_rows, "server", path, minimum=16),
        max_message_bytes=positive_int(table, "max_message_bytes", defaults.max_message_bytes, "server", path, 1024),
        max_backlog_bytes=positive_int(table, "max_backlog_bytes", defaults.max_backlog_bytes, "server", path, 1024),
        max_clients=positive_int(table, "max_clients", defaults.max_clients, "server", path),
        default_deadline_ms=positive_int(
            table, "default_deadline_ms", defaults.default_deadline_ms, "server", path, minimum=0
        ),
        heartbeat_timeout_ms=positive_int(
            table, "heartbeat_timeout_ms", defaults.heartbeat_timeout_ms, "server", path, 500
        ),
        hang_timeout_ms=positive_int(table, "hang_timeout_ms", defaults.hang_timeout_ms, "server", path, 100),
        drain_timeout_ms=positive_int(table, "drain_timeout_ms", defaults.drain_timeout_ms, "server", path, minimum=0),
        restart_budget=positive_int(table, "restart_budget", defaults.restart_budget, "server", path, minimum=0),
        load_wait_ms=positive_int(table, "load_wait_ms", defaults.load_wait_ms, "server", path, minimum=0),
        max_replays=positive_int(table, "max_replays", defaults.max_replays, "server", path, minimum=0),
        max_queued_requests=positive_int(table, "max_queued_requests", defaults.max_queued_requests, "server", path),
        max_queued_nodes=positive_int(table, "max_queued_nodes", defaults.max_queued_nodes, "server", path),
        max_queue_delay_ms=positive_int(
            table, "max_queue_delay_ms", defaults.max_queue_delay_ms, "server", path, minimum=0
        ),
        unreachable_client_ms=positive_int(
            table, "unreachable_client_ms", defaults.unreachable_client_ms, "server", path, minimum=100
        ),
        session_ttl_ms=positive_int(table, "session_ttl_ms", defaults.session_ttl_ms, "server", path),
        max_sessions=positive_int(table, "max_sessions", defaults.max_sessions, "server", path),
        metrics_address=metrics_address,
        cuda_graphs=cuda_graphs,
        cross_gpu_reads=cross_gpu_reads,
        curve=_key_files(table, "curve", CurveConfig, path),
        worker_curve=_key_files(table, "worker_curve", WorkerCurveConfig, path),
        insecure_workers=boolean(table, "insecure_workers", defaults.insecure_workers, "server", path),
    )
    check_worker_address(server.worker_address, server, f"{path}: [server] worker_address")
    return server


def _key_files(server: dict[str, Any], key: str, kind: type, path: Path) -> Any:
    """The [server.KEY] table of key files as a `kind` (one path per field, relative to the config file), or None."""
    if key not in server:
        return None
    where = f"server.{key}"
    table = subtable(server, key, path, where)
    fields = list(kind.__dataclass_fields__)
    check_keys(table, set(fields), where, path)
    paths = []
    for field_name in fields:
        value = Path(string(table, field_name, None, where, path))
        paths.append(value if value.is_absolute() else (path.parent / value).resolve())
    return kind(*paths)


def check_worker_address(address: str, server: ServerConfig, where: str) -> None:
    """Worker sockets other machines can reach take only workers holding an allowed CURVE key,
    unless the config says explicitly that they need none."""
    reachable = address != "auto" and not is_loopback(address)  # auto: an ipc path in a private directory
    if reachable and server.worker_curve is None and not server.insecure_workers:
        raise ConfigError(
            f"{where} {address!r} can be reached from other machines, and anyone who reaches it could register "
            "as a worker: add a [server.worker_curve] table (CurveZMQ keys for workers, see docs/deploy.md) "
            "or set insecure_workers = true in [server]"
        )
