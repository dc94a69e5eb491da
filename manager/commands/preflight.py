"""What the supervisor checks before it starts any process: the models build, their weights files
fit them, and the ports the manager will bind are free. Each failure is one ConfigError that
names the fix, instead of a traceback in a child process's log after the server seemed to start.

Reading weights needs torch, which the supervisor never imports: the weights are checked by
`python -m batchmaker.manager.commands.preflight CONFIG` in a child process, whose error becomes the supervisor's.
"""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
import sys

from batchmaker.common.config import Config, ConfigError, load_config
from batchmaker.common.models.base import Planner, build_model, build_planner
from batchmaker.manager.batching.policies import check_policy
from batchmaker.manager.commands.doors import check_door_packages
from batchmaker.manager.commands.launcher import free_port_on
from batchmaker.manager.observability.trace_export import check_tracing_packages

log = logging.getLogger("batchmaker.supervisor")


def check_before_start(config: Config, address: str) -> None:
    """Every check, in the order a user meets the problems; warns loudly about random weights."""
    planners = {name: build_planner(model) for name, model in config.models.items()}
    check_policy(config.scheduler.policy, planners)
    check_weights(config)
    warn_random_weights(planners)
    check_client_address(address, str(config.path))
    check_metrics_address(config.server.metrics_address, str(config.path))
    check_tracing_packages(config)
    check_door_packages(config)
    check_door_addresses(config)


def check_weights(config: Config) -> None:
    """Every model's weights file read and checked against the model, in a child process (see above)."""
    done = subprocess.run(
        [sys.executable, "-m", "batchmaker.manager.commands.preflight", str(config.path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise ConfigError(done.stderr.strip() or f"checking the weights files failed (exit status {done.returncode})")


def _read_all_weights(argv: list[str]) -> int:
    """`python -m batchmaker.manager.commands.preflight CONFIG`: read every model's weights.

    Every model's problem goes to stderr, all in one message, with status 2: a user who forgot
    several files learns of them all at once rather than one start-up at a time.
    """
    try:
        models = load_config(argv[0]).models.values()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    problems = []
    for model_config in models:
        try:
            build_model(model_config).load_weights()
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        print(_weights_problems(problems), file=sys.stderr)
        return 2
    return 0


def _weights_problems(problems: list[str]) -> str:
    """One message for every model whose weights cannot be served, each problem as its model's check said it."""
    if len(problems) == 1:
        return problems[0]
    return "\n".join([f"{len(problems)} models cannot load their weights:", *(f"- {problem}" for problem in problems)])


def warn_random_weights(models: dict[str, Planner]) -> None:
    for name, model in models.items():
        if model.random_weights:
            log.warning(
                "model %r SERVES RANDOM WEIGHTS: %s was written by `batchmaker init-weights`, so its answers "
                "mean nothing; point `weights` at a trained state dict to serve real answers",
                name, model.config.weights,
            )


def check_client_address(address: str, config_path: str) -> None:
    host, port = _tcp_host_port(address.removeprefix("tcp://")) if address.startswith("tcp://") else (None, 0)
    if host is not None and port and _in_use(host, port):
        raise ConfigError(
            f"address {address} is in use (another batchmaker server?); stop that process, or serve on "
            f"another port: batchmaker serve {config_path} --address tcp://{host}:{_suggested_port(host)}"
        )


def check_metrics_address(address: str, config_path: str) -> None:
    _check_listener_free(
        "metrics address", address, "--metrics-address", f"metrics_address in [server] of {config_path}"
    )


def check_door_addresses(config: Config) -> None:
    """The front door's listeners must be free; with several front door processes they share them later."""
    for flag, table in (("http", config.http), ("grpc", config.grpc)):
        if table is not None:
            _check_listener_free(
                f"[{flag}] address", table.address, f"--{flag}", f"address in [{flag}] of {config.path}"
            )


def _check_listener_free(what: str, address: str, option: str, key: str) -> None:
    """A HOST:PORT listener of the server's (`what`, set by `option` or the config's `key`) must be free."""
    host, port = _tcp_host_port(address) if address else (None, 0)
    if host is not None and port and _in_use(host, port):
        raise ConfigError(
            f"{what} {address}: port {port} is in use; stop the process holding it, or choose another "
            f"port with {option} {host}:{_suggested_port(host)} (or {key})"
        )


def _tcp_host_port(address: str) -> tuple[str | None, int]:
    """("127.0.0.1", 5555) from "127.0.0.1:5555"; (None, 0) for what is not a literal host and port."""
    host, _, port = address.rpartition(":")
    host = "0.0.0.0" if host in ("*", "") else host.strip("[]")
    return (host, int(port)) if port.isdigit() else (None, 0)


def _in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port; other bind errors are left to the process that binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ and the metrics server bind
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _suggested_port(host: str) -> int | str:
    try:
        return free_port_on(host)
    except OSError:
        return "PORT"


if __name__ == "__main__":
    sys.exit(_read_all_weights(sys.argv[1:]))
