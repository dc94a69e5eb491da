"""The `batchmaker` command: serve, run a worker, create weights, and the client subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from batchmaker.clients.cli import add_client_commands, run_client_command
from batchmaker.clients.cli_output import closed_pipe_ends_quietly
from batchmaker.common.config import DEFAULT_CONFIG, POLICIES, RUNNING_BATCH, ConfigError, load_config
from batchmaker.common.logs import setup_logging


def _serve(args: argparse.Namespace) -> int:
    from batchmaker.manager.commands.supervisor import serve

    if args.log_format == "json":
        os.environ["BATCHMAKER_LOG_FORMAT"] = "json"  # inherited by the manager and workers
        setup_logging("supervisor")
    doors = (args.http, args.grpc)
    config = load_config(args.config)
    return serve(config, args.address, args.workers, args.policy, args.metrics_address, doors, args.running_batch)


def _init_weights(args: argparse.Namespace) -> int:
    from batchmaker.common.models import init_missing_weights

    created = init_missing_weights(load_config(args.config))
    for path in created:
        print(f"created {path}")
    if not created:
        print("all weights files exist")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchmaker", description="Low-latency RNN serving with cellular batching.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the server (manager + workers) in the foreground")
    serve.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="TOML config (default: %(default)s)")
    serve.add_argument("--address", help="client address, overriding the config")
    serve.add_argument("--workers", type=int, help="number of CPU workers, overriding the config")
    serve.add_argument("--policy", choices=POLICIES, help="batching policy, overriding the config")
    serve.add_argument(
        "--running-batch", choices=RUNNING_BATCH, help="who decides each step (auto, manager, worker), over the config"
    )
    serve.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        help='Prometheus /metrics address, overriding the config ("" for none)',
    )
    serve.add_argument("--http", metavar="HOST:PORT", help="serve the Open Inference Protocol over HTTP there")
    serve.add_argument("--grpc", metavar="HOST:PORT", help="serve the Open Inference Protocol over gRPC there")
    serve.add_argument("--log-format", choices=["text", "json"], default="text", help="json: one object per line")
    serve.set_defaults(handler=_serve)

    weights = commands.add_parser("init-weights", help="create missing weights files deterministically")
    weights.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    weights.set_defaults(handler=_init_weights)

    commands.add_parser(
        "worker",
        help="run one worker process that registers with a running manager: worker --manager ADDRESS [--config ...]",
        add_help=False,
    )
    commands.add_parser("keygen", help="create a CurveZMQ key pair: keygen DIRECTORY [--name NAME]", add_help=False)

    add_client_commands(commands)
    return parser


def _config_address(path: Path) -> str:
    """The `[server] address` of a config, read and checked as `batchmaker serve` reads it."""
    return load_config(path).server.address


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return closed_pipe_ends_quietly(lambda: _command(argv))


def _command(argv: list[str]) -> int:
    setup_logging("supervisor")
    if argv[:1] == ["keygen"]:
        from batchmaker.common.auth import keygen_main

        return keygen_main(argv[1:])
    if argv[:1] == ["worker"]:  # its own parser, shared with the worker processes the supervisor starts
        from batchmaker.worker.main import main as worker_main

        return worker_main(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "client_command", None):
        return run_client_command(args, _config_address)
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"batchmaker: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
