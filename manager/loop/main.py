"""Entry point of the manager process (started by the supervisor)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal

import zmq

from batchmaker.common.config import (
    POLICIES,
    RUNNING_BATCH,
    Config,
    ConfigError,
    load_config,
    with_metrics_address,
    with_policy,
    with_running_batch,
)
from batchmaker.common.logs import setup_logging
from batchmaker.manager.loop.server import Manager
from batchmaker.manager.observability.memory_trace import MemoryTrace
from batchmaker.manager.observability.trace_export import open_tracing

log = logging.getLogger("batchmaker.manager")

SUPERVISOR_TOKEN_ENV = "BATCHMAKER_SUPERVISOR_TOKEN"  # hex; the supervisor signs its worker_exited messages with it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchmaker.manager", description="Run the batchmaker manager process."
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--address", help="client address (default: from the config)")
    parser.add_argument("--worker-address", required=True, help="address workers register at")
    parser.add_argument("--expected-workers", type=int, default=1, help="workers configured (for health)")
    parser.add_argument("--policy", choices=POLICIES, help="batching policy (default: from the config)")
    parser.add_argument("--running-batch", choices=RUNNING_BATCH, help="who decides each step (default: the config's)")
    parser.add_argument("--metrics-address", help="HOST:PORT of /metrics, or \"\" for none (default: from the config)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process stops being the parent")
    args = parser.parse_args(argv)
    setup_logging("manager")
    token = bytes.fromhex(os.environ.pop(SUPERVISOR_TOKEN_ENV, ""))  # out of the environment: no child inherits it
    try:
        trace = MemoryTrace.from_environment()
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if trace is not None:
        trace.start()

    def read_config() -> Config:
        """The config file with the command line's overrides: at start, and again on every reload."""
        config = load_config(args.config)
        if args.policy is not None:
            config = with_policy(config, args.policy)
        if args.running_batch is not None:
            config = with_running_batch(config, args.running_batch)
        if args.metrics_address is not None:
            config = with_metrics_address(config, args.metrics_address)
        return config

    try:
        config = read_config()
        address = args.address or config.server.address
        tracing = open_tracing(config, address)
        manager = Manager(
            config, address, args.worker_address, args.expected_workers, args.parent_pid, token, tracing, read_config
        )
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    except zmq.ZMQError as exc:
        log.error("cannot open the manager's sockets: %s", exc)
        return 2
    except OSError as exc:  # the metrics port, taken since the supervisor checked it
        log.error("cannot serve metrics on %s: %s", config.server.metrics_address, exc)
        return 2
    # Requests allocate many small cyclic objects; collect them rarely, and never rescan start-up state.
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 20, 100)
    signal.signal(signal.SIGTERM, manager.stop)
    signal.signal(signal.SIGINT, manager.stop)
    signal.signal(signal.SIGHUP, manager.request_reload)
    try:
        manager.run()
    finally:
        if trace is not None:
            trace.stop()
    return 0
