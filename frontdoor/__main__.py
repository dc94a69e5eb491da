"""`python -m batchmaker.frontdoor --config FILE`: one front door process, serving [http] and [grpc].

Several processes (`[http] processes`) share the ports with SO_REUSEPORT. SIGTERM stops accepting new
connections and lets the requests already accepted finish (the manager, draining too, answers each of
them with its outputs or an error) before the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from batchmaker.common.config import ConfigError, load_config, with_door_addresses
from batchmaker.common.logs import setup_logging

from . import OIP_EXTRA_HINT, missing_oip_packages

log = logging.getLogger("batchmaker.frontdoor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchmaker.frontdoor", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--manager", help="the manager's client address (default: the config's [server] address)")
    parser.add_argument("--http", metavar="HOST:PORT", help="the HTTP listener, overriding the config's [http] address")
    parser.add_argument("--grpc", metavar="HOST:PORT", help="the gRPC listener, overriding the config's [grpc] address")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process stops being the parent")
    args = parser.parse_args(argv)
    setup_logging("frontdoor")
    missing = missing_oip_packages()
    if missing:
        log.error("%s (missing: %s)", OIP_EXTRA_HINT, ", ".join(missing))
        return 2
    try:
        config = with_door_addresses(load_config(args.config), args.http, args.grpc)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    from .serve import serve

    try:
        return asyncio.run(serve(config, args.manager or config.server.address, lambda: _parent_gone(args.parent_pid)))
    except (OSError, RuntimeError) as exc:  # aiohttp's bind raises OSError, grpc's RuntimeError
        log.error("cannot listen: %s", exc)
        return 2


def _parent_gone(parent_pid: int | None) -> bool:
    return parent_pid is not None and os.getppid() != parent_pid


if __name__ == "__main__":
    sys.exit(main())
