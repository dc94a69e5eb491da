"""Checks the Kubernetes manifests in deploy/k8s against the server they run (deploy/validate calls it).

Schema validation cannot see these: the ConfigMap must hold a config the server accepts,
the probes and scrape annotations must point at the port the config serves metrics on,
and the grace period must leave the drain and the supervisor's stop time to finish. Nor
does it see what keeps a deployment safe by default: clients authenticated by CURVE with
keys from a Secret, metrics on no Service and behind a NetworkPolicy, containers that
cannot gain privileges or write their image, a CPU limit on every server, and key files
kept out of git and of the images.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
# The tools' virtualenv has no batchmaker installed: batchmaker.common is this checkout's common/,
# as pyproject.toml maps it (its config module needs only the standard library).
for name, path in (("batchmaker", []), ("batchmaker.common", [str(ROOT / "common")])):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = path

from batchmaker.common.config import Config, parse_config

MANIFESTS = ROOT / "deploy" / "k8s"
CONFIG_PATH = Path("/etc/batchmaker/config.toml")


def supervisor_constant(name: str) -> float:
    """A constant of manager/commands/supervisor.py, read without importing it (it needs torch)."""
    for node in ast.parse((ROOT / "manager" / "commands" / "supervisor.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return float(ast.literal_eval(node.value))
    raise LookupError(f"{name} is not defined in manager/commands/supervisor.py")


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
    if "cpu" not in server.get("resources", {}).get("limits", {}):
        problems.append(f"{name}: the server container needs a CPU limit")
    check_hardening(name, pod["spec"], problems)


HARDENED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def check_hardening(name: str, pod: dict[str, Any], problems: list[str]) -> None:
    """Every container locked down, a writable /tmp for each, and the keys from the Secret."""
    if pod.get("securityContext", {}).get("seccompProfile") != {"type": "RuntimeDefault"}:
        problems.append(f"{name}: the pod's securityContext needs seccompProfile RuntimeDefault")
    if not pod.get("securityContext", {}).get("runAsNonRoot"):
        problems.append(f"{name}: the pod must run as non-root")
    for container in pod.get("initContainers", []) + pod["containers"]:
        context = container.get("securityContext", {})
        for key, value in HARDENED.items():
            if context.get(key) != value:
                problems.append(f"{name}: container {container['name']} needs securityContext {key}: {value}")
        if not any(m["mountPath"] == "/tmp" for m in container.get("volumeMounts", [])):
            problems.append(f"{name}: container {container['name']} has a read-only root and needs an emptyDir at /tmp")
    secrets = [v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v]
    if KEYS_SECRET not in secrets:
        problems.append(f"{name}: the CURVE keys must come from the Secret {KEYS_SECRET}")


KEYS_SECRET = "batchmaker-keys"


def check_exposure(objects: list[dict[str, Any]], config: Config, problems: list[str]) -> None:
    """Clients authenticated; metrics on no Service; a NetworkPolicy that admits only Prometheus to them."""
    if config.server.curve is None:
        problems.append("the config must set [server.curve]: the client port is reachable from the cluster")
    metrics_port = int(config.server.metrics_address.rpartition(":")[2])
    for service in (o for o in objects if o["kind"] == "Service"):
        for port in service["spec"].get("ports", []):
            if port.get("name") == "metrics" or metrics_port in (port.get("port"), port.get("targetPort")):
                problems.append(f"Service {service['metadata']['name']} publishes the metrics port")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    if not policies:
        problems.append("a NetworkPolicy must restrict who reaches the pods")
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = {port.get("port") for port in rule.get("ports", [])}
            if not rule.get("from") and ("metrics" in ports or metrics_port in ports or not ports):
                problems.append(f"NetworkPolicy {policy['metadata']['name']} admits anyone to the metrics port")


def check_ignored_keys(problems: list[str]) -> None:
    """`batchmaker keygen keys` writes secret keys under keys/: neither git nor an image may take them."""
    for path in [ROOT / ".gitignore", *sorted((ROOT / "deploy").glob("*.dockerignore"))]:
        lines = {line.strip() for line in path.read_text().splitlines()}
        if not lines & {"keys", "keys/", "/keys", "/keys/", "**/keys"}:
            problems.append(f"{path.relative_to(ROOT)} must leave out keys/")


def main() -> int:
    objects = load_objects()
    config = server_config(objects)
    problems: list[str] = []
    if not config.server.metrics_address:
        problems.append("the config must set metrics_address: the probes are served there")
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    for deployment in deployments:
        check_deployment(deployment, config, problems)
    check_exposure(objects, config, problems)
    check_ignored_keys(problems)
    for problem in problems:
        print(f"deploy/k8s: {problem}", file=sys.stderr)
    if not problems:
        print(f"deploy/k8s: the config loads and {len(deployments)} Deployments agree with it")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
