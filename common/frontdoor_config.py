"""The [http] and [grpc] tables: where the Open Inference Protocol front door listens, and how it is secured.

Either table turns the front door on (docs/protocol.md, "Open Inference Protocol"); without both it does not run.
Paths are relative to the config file, as the key files of [server.curve] are.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchmaker.common.config_values import ConfigError, check_keys, positive_int, subtable

DEFAULT_HTTP_ADDRESS = "127.0.0.1:8000"
DEFAULT_GRPC_ADDRESS = "127.0.0.1:8001"
DEFAULT_MAX_STREAM_REQUESTS = 1024
DEFAULT_MAX_STREAM_REPLIES = 1024
# The keys naming files (relative to the config file), which must exist when the config loads.
DOOR_FILES = ("tls_cert", "tls_key", "tls_client_ca", "token_file", "control_token_file")


@dataclass(frozen=True)
class DoorSecurity:
    """TLS (with client certificates checked against `tls_client_ca` when given), the bearer token file of
    every call but the probes, and the one of model control (the repository's load and unload)."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    token_file: Path | None = None
    control_token_file: Path | None = None

    def token(self) -> str | None:
        """The bearer token requests must carry, read from its file (surrounding whitespace dropped)."""
        return _read_token(self.token_file)

    def control_token(self) -> str | None:
        """The bearer token of load and unload calls, read as `token` is."""
        return _read_token(self.control_token_file)


@dataclass(frozen=True)
class HttpConfig:
    address: str = DEFAULT_HTTP_ADDRESS
    processes: int = 1  # front door processes sharing the ports (SO_REUSEPORT)
    max_body_bytes: int | None = None  # a larger body gets 413 unread; None: the manager's [server] max_message_bytes
    security: DoorSecurity = DoorSecurity()


@dataclass(frozen=True)
class GrpcConfig:
    address: str = DEFAULT_GRPC_ADDRESS
    security: DoorSecurity = DoorSecurity()
    max_stream_requests: int = DEFAULT_MAX_STREAM_REQUESTS  # in flight on one ModelStreamInfer stream
    max_stream_replies: int = DEFAULT_MAX_STREAM_REPLIES  # made for one stream and not yet read by its client


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an Authorization header (or gRPC metadata) value carries the token, compared in constant time."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def body_limit(http: HttpConfig | None, max_message_bytes: int) -> int:
    """The largest HTTP body and gRPC message the front door reads: [http] max_body_bytes, else the largest
    request the manager reads, [server] max_message_bytes, so that the door holds no more than the manager
    would. Tensors as JSON text take more bytes than as the manager's request: for those, raise the former."""
    given = http.max_body_bytes if http is not None else None
    return max_message_bytes if given is None else given


def split_host_port(address: str, where: str) -> tuple[str, int]:
    """ "host:port" as the listeners take it; ValueError naming `where` when it is not one."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f'{where} must look like "127.0.0.1:8000", got {address!r}')
    return host.strip("[]"), int(port)


def parse_door_tables(raw: dict[str, Any], path: Path) -> tuple[HttpConfig | None, GrpcConfig | None]:
    """The [http] and [grpc] tables of a config file (None where absent); a mistake raises ConfigError."""
    http = grpc = None
    if "http" in raw:
        table = subtable(raw, "http", path)
        check_keys(table, {"address", "processes", "max_body_bytes", *DOOR_FILES}, "http", path)
        limited = "max_body_bytes" in table
        http = HttpConfig(
            address=_address(table, DEFAULT_HTTP_ADDRESS, "http", path),
            processes=positive_int(table, "processes", 1, "http", path),
            max_body_bytes=positive_int(table, "max_body_bytes", 1, "http", path) if limited else None,
            security=_security(table, "http", path),
        )
    if "grpc" in raw:
        table = subtable(raw, "grpc", path)
        check_keys(table, {"address", "max_stream_requests", "max_stream_replies", *DOOR_FILES}, "grpc", path)
        grpc = GrpcConfig(
            address=_address(table, DEFAULT_GRPC_ADDRESS, "grpc", path),
            security=_security(table, "grpc", path),
            max_stream_requests=positive_int(table, "max_stream_requests", DEFAULT_MAX_STREAM_REQUESTS, "grpc", path),
            max_stream_replies=positive_int(table, "max_stream_replies", DEFAULT_MAX_STREAM_REPLIES, "grpc", path),
        )
    return http, grpc


def _address(table: dict[str, Any], default: str, where: str, path: Path) -> str:
    value = table.get("address", default)
    try:
        split_host_port(value if isinstance(value, str) else "", f"{path}: [{where}] address")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return value


def _security(table: dict[str, Any], where: str, path: Path) -> DoorSecurity:
    files: dict[str, Path] = {}
    for key in DOOR_FILES:
        if key in table:
            value = table[key]
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{path}: [{where}] {key} must be a non-empty path, got {value!r}")
            file = Path(value) if Path(value).is_absolute() else (path.parent / value).resolve()
            if not file.is_file():
                raise ConfigError(f"{path}: [{where}] {key} {str(file)!r} is not a file")
            files[key] = file
    if ("tls_cert" in files) != ("tls_key" in files):
        raise ConfigError(f"{path}: [{where}] tls_cert and tls_key go together: give both, or neither")
    if "tls_client_ca" in files and "tls_cert" not in files:
        raise ConfigError(f"{path}: [{where}] tls_client_ca (client certificates) needs tls_cert and tls_key")
    token, control_token = (_read_token(files.get(key)) for key in ("token_file", "control_token_file"))
    for key, text in (("token_file", token), ("control_token_file", control_token)):
        if key in files and not text:
            raise ConfigError(f"{path}: [{where}] {key} {str(files[key])!r} is empty")
    if token is not None and token == control_token:
        raise ConfigError(
            f"{path}: [{where}] control_token_file holds the same token as token_file: every caller that may "
            "infer could load and unload models; give model control a token of its own"
        )
    return DoorSecurity(**files)


def _read_token(file: Path | None) -> str | None:
    return None if file is None else file.read_text().strip()
