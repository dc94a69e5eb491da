"""Checks the Kubernetes manifests in deploy/k8s against the server they run (deploy/validate calls it).

Schema validation cannot see these: the ConfigMap must hold a config the server accepts,
the probes and scrape annotations must point at the port the config serves metrics on,
and the grace period must leave the drain and the supervisor's stop time to finish.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.config import Config, parse_config

MANIFESTS = ROOT / "deploy" / "k8s"
CONFIG_PATH = Path("/etc/batchmaker/config.toml")


def supervisor_constant(name: str) -> float:
    """A constant of manager/supervisor.py, read without importing it (it needs torch)."""
    for node in ast.parse((ROOT / "manager" / "supervisor.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return float(ast.literal_eval(node.value))
    raise LookupError(f"{name} is not defined in manager/supervisor.py")


def load_objects() -> list[dict[str, Any]]:
    return [doc for path in sorted(MANIFESTS.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def server_config(objects: list[dict[str, Any]]) -> Config:
    import tomllib

    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "batchmaker-config")
    return parse_config(tomllib.loads(config_map["data"]["config.toml"]), CONFIG_PATH)


def check_deployment(deployment: dict[str, Any], config: Config, problems: list[str]) -> None:
    name = deployment["metadata"]["name"]
    pod = deployment["spec"]["template"]
    metrics_port = int(config.server.metrics_address.rpartition(":")[2])
    drain_s = config.server.drain_timeout_ms / 1e3
    stop_s = drain_s + 2 * supervisor_constant("STOP_GRACE_S")  # drain, then the manager's and workers' grace
    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if grace <= stop_s:
        problems.append(f"{name}: terminationGracePeriodSeconds {grace} must exceed the {stop_s:g} s a drain can take")
    if pod["metadata"].get("annotations", {}).get("prometheus.io/port") != str(metrics_port):
        problems.append(f"{name}: the prometheus.io/port annotation must be the metrics port {metrics_port}")
    server = next(c for c in pod["spec"]["containers"] if c["name"] == "server")
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    if ports.get("metrics") != metrics_port:
        problems.append(f"{name}: the container's metrics port must be {metrics_port}, as in metrics_address")
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = server.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or get.get("port") != "metrics":
            problems.append(f"{name}: {probe} must GET {path} on the metrics port")
    if "preStop" not in server.get("lifecycle", {}):
        problems.append(f"{name}: the server container needs a preStop hook that drains it")


def main() -> int:
    objects = load_objects()
    config = server_config(objects)
    problems: list[str] = []
    if not config.server.metrics_address:
        problems.append("the config must set metrics_address: the probes are served there")
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    for deployment in deployments:
        check_deployment(deployment, config, problems)
    for problem in problems:
        print(f"deploy/k8s: {problem}", file=sys.stderr)
    if not problems:
        print(f"deploy/k8s: the config loads and {len(deployments)} Deployments agree with it")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
