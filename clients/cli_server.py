"""Which server the command-line client talks to, and whether anything answers there.

The address comes from `--address`, else the `[server] address` of `--config FILE`, else the
environment variable BATCHMAKER_ADDRESS, so that a shell or a script names its server once.
Before its request, a command sends `health` to each address and waits a few seconds
(`--connect-timeout`) for an answer: an address where nothing listens is reported at once,
and `--timeout` is left to bound the request itself.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import ServerError
from .messages import DEFAULT_ADDRESS, CurveKeys
from .sync_client import Client

ADDRESS_ENV = "BATCHMAKER_ADDRESS"
CONNECT_TIMEOUT = 3.0  # a running server answers health at once; a starting one takes longer (--connect-timeout)
ConfigAddress = Callable[[Path], str]  # reads a server config's [server] address; raises OSError or ValueError


class AddressError(ValueError):
    """No server address was given, or the one given cannot be read."""


@dataclass(frozen=True)
class Target:
    """The addresses of the servers to talk to, and where they were taken from (for messages)."""

    addresses: list[str]
    source: str


def find_target(given: Sequence[str] | None, config: Path | None, config_address: ConfigAddress) -> Target:
    """The addresses to use: `--address` wins over `--config`, which wins over BATCHMAKER_ADDRESS."""
    if given:
        return Target(list(given), "--address")
    if config is not None:
        try:
            return Target([config_address(config)], f"--config {config}")
        except (OSError, ValueError) as exc:
            raise AddressError(f"cannot take the server address from --config {config}: {exc}") from None
    from_environment = [part.strip() for part in os.environ.get(ADDRESS_ENV, "").split(",") if part.strip()]
    if from_environment:
        return Target(from_environment, ADDRESS_ENV)
    raise AddressError(
        f"no server address: give it with --address ADDRESS, set {ADDRESS_ENV}=ADDRESS "
        "(several separated by commas), or name the server's config with --config FILE (its [server] address)"
    )


def toml_server_address(path: Path) -> str:
    """The `[server] address` of a server config, read with tomllib alone: the client distribution
    has neither torch nor the server's config loader. A config without one serves on the default."""
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    server = raw.get("server", {})
    address = server.get("address", DEFAULT_ADDRESS) if isinstance(server, dict) else None
    if isinstance(address, str):
        return address
    raise ValueError(f"{path}: [server] address must be a string like \"tcp://127.0.0.1:5555\"")


def answering(addresses: Sequence[str], wait: float, curve: CurveKeys | None) -> list[str]:
    """The addresses whose server answers `health` within `wait` seconds, all asked at once."""
    with ThreadPoolExecutor(len(addresses)) as pool:
        answered = list(pool.map(lambda address: _answers(address, wait, curve), addresses))
    return [address for address, answers in zip(addresses, answered) if answers]


def _answers(address: str, wait: float, curve: CurveKeys | None) -> bool:
    try:
        with Client(address, wait, curve=curve) as client:
            client.health()
    except TimeoutError:
        return False
    except ServerError:  # an error reply is still a server answering
        return True
    return True


def no_server_message(target: Target, wait: float) -> str:
    """What to tell a user when nothing answered the probe: the address, where it came from, and the fixes."""
    return (
        f"no server at {' or '.join(target.addresses)} (from {target.source}): nothing answered a health check "
        f"within {wait:g} s; start one with `batchmaker serve CONFIG`, or give its address with --address, "
        f"--config or {ADDRESS_ENV} (--connect-timeout waits longer for a server that is starting)"
    )
