"""The supervisor's view of the Open Inference Protocol front door: how many processes to start, what they
are told, and whether they listen yet (docs/protocol.md, "Open Inference Protocol")."""

from __future__ import annotations

import socket

from batchmaker.common.config import Config, ConfigError
from batchmaker.common.frontdoor_config import split_host_port

CONNECT_TIMEOUT_S = 0.5


def door_processes(config: Config) -> int:
    """Front door processes to run: `[http] processes`, one for [grpc] alone, none without either table."""
    if config.http is not None:
        return config.http.processes
    return 1 if config.grpc is not None else 0


def door_arguments(config: Config, manager_address: str) -> list[str]:
    """What each front door process is told beyond its config: the manager's address and its listeners
    (which `batchmaker serve --http/--grpc` may have set apart from the file)."""
    arguments = ["--manager", manager_address]
    if config.http is not None:
        arguments += ["--http", config.http.address]
    if config.grpc is not None:
        arguments += ["--grpc", config.grpc.address]
    return arguments


def doors_listening(config: Config) -> bool:
    """Whether every configured listener accepts connections."""
    addresses = [table.address for table in (config.http, config.grpc) if table is not None]
    return all(_accepts(address) for address in addresses)


def _accepts(address: str) -> bool:
    host, port = split_host_port(address, "address")
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def check_door_packages(config: Config) -> None:
    """A config that asks for the front door fails start-up, naming the extra, when its libraries are missing."""
    if door_processes(config) == 0:
        return
    from batchmaker.frontdoor import OIP_EXTRA_HINT, missing_oip_packages

    missing = missing_oip_packages()
    if missing:
        raise ConfigError(f"{config.path}: {OIP_EXTRA_HINT} (missing: {', '.join(missing)})")
