"""Checks the Kubernetes manifests in deploy/k8s against the server they run (deploy/validate calls it).

Schema validation cannot see these: the ConfigMap must hold a config the server accepts,
the probes must read the front door's health on the port and scheme its [http] table
serves, the scrape annotations must point at the port the config serves metrics on, and
the grace period must leave the drain and the supervisor's stop time to finish. Nor does it
see what keeps a deployment safe by default: clients authenticated by CURVE with keys from
a Secret, the front door's HTTP and gRPC ports with TLS and a token from a Secret, metrics
on no Service and behind a NetworkPolicy, containers that cannot gain privileges or write
their image, a CPU limit on every server, and key files kept out of git and of the images.
The KServe example (deploy/kserve) is checked the same way: its config loads, its probes
and port are its [http] listener's, and it speaks the v2 protocol.
"""

from __future__ import annotations

import argparse
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
from batchmaker.common.frontdoor_config import DOOR_FILES

MANIFESTS = ROOT / "deploy" / "k8s"
KSERVE = ROOT / "deploy" / "kserve"
CONFIG_PATH = Path("/etc/batchmaker/config.toml")
DOOR_TABLES = ("http", "grpc")
# The front door's health endpoints, which need no token: what each probe must GET.
PROBES = {"startupProbe": "/v2/health/live", "livenessProbe": "/v2/health/live", "readinessProbe": "/v2/health/ready"}
# With client certificates on the HTTP port the kubelet cannot probe it: the metrics port's probes instead.
METRICS_PROBES = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
KSERVE_PROBES = {"readinessProbe": "/v2/health/ready"}  # queue-proxy runs it on loopback; the kubelet could not


def supervisor_constant(name: str) -> float:
    """A constant of manager/commands/supervisor.py, read without importing it (it needs torch)."""
    for node in ast.parse((ROOT / "manager" / "commands" / "supervisor.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return float(ast.literal_eval(node.value))
    raise LookupError(f"{name} is not defined in manager/commands/supervisor.py")


def load_objects(folder: Path) -> list[dict[str, Any]]:
    return [doc for path in sorted(folder.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


DoorFiles = dict[str, dict[str, str]]  # [http]/[grpc] -> key -> the path it names in the pod


def server_config(objects: list[dict[str, Any]], name: str) -> tuple[Config, DoorFiles]:
    """The config in ConfigMap `name`, and the files its [http] and [grpc] tables name. Those live in the pod
    (from a Secret), not here, so the tables are parsed without them; `check_door_files` checks their mounts."""
    import tomllib

    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name)
    raw = tomllib.loads(config_map["data"]["config.toml"])
    files = {
        table: {key: raw[table].pop(key) for key in DOOR_FILES if key in raw[table]}
        for table in DOOR_TABLES
        if table in raw
    }
    return parse_config(raw, CONFIG_PATH), files


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def check_probes(
    name: str, container: dict[str, Any], config: Config, files: DoorFiles, probes: dict[str, str], problems: list[str]
) -> None:
    """Every probe GETs the front door's health on the [http] port, with TLS where the port has it; where that
    port asks for client certificates, which the kubelet cannot present, the metrics port's /healthz and /readyz."""
    if config.http is None:
        problems.append(f"{name}: the config needs an [http] table: the probes read the front door's health")
        return
    expected = {
        probe: (path, port_of(config.http.address), "HTTPS" if "tls_cert" in files["http"] else "HTTP")
        for probe, path in probes.items()
    }
    if "tls_client_ca" in files["http"]:
        metrics = port_of(config.server.metrics_address)
        expected = {probe: (METRICS_PROBES[probe], metrics, "HTTP") for probe in probes}
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    for probe, (path, port, scheme) in expected.items():
        get = container.get(probe, {}).get("httpGet", {})
        got = ports.get(get.get("port")) if isinstance(get.get("port"), str) else get.get("port")
        if (get.get("path"), got, get.get("scheme", "HTTP")) != (path, port, scheme):
            problems.append(f"{name}: {probe} must GET {path} with {scheme} on port {port}")


def check_door_files(name: str, pod: dict[str, Any], files: DoorFiles, problems: list[str]) -> None:
    """Each file of [http]/[grpc] reaches every container that loads the config, from a Secret's item."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    containers = pod.get("initContainers", []) + pod["containers"]
    loaders = [c for c in containers if str(CONFIG_PATH) in " ".join(c.get("command", []) + c.get("args", []))]
    for container in loaders:
        mounts = container.get("volumeMounts", [])
        for table, named in files.items():
            for key, path in named.items():
                found = [
                    (m, volumes.get(m["name"], {}).get("secret", {}))
                    for m in mounts
                    if path.startswith(m["mountPath"] + "/")
                ]
                items = {item["path"] for _, secret in found for item in secret.get("items", [])}
                if (
                    not any(secret for _, secret in found)
                    or path.removeprefix(found[0][0]["mountPath"] + "/") not in items
                ):
                    problems.append(
                        f"{name}: container {container['name']} must mount [{table}] {key} {path} from a Secret"
                    )


def check_deployment(deployment: dict[str, Any], config: Config, files: DoorFiles, problems: list[str]) -> None:
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
    for table in DOOR_TABLES:
        door = getattr(config, table)
        if door is None or ports.get(table) != port_of(door.address):
            problems.append(f"{name}: the container's {table} port must be the config's [{table}] address port")
    check_probes(name, server, config, files, PROBES, problems)
    check_door_files(name, pod["spec"], files, problems)
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
    secrets = {v["secret"]["secretName"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
    if KEYS_SECRET not in secrets:
        problems.append(f"{name}: the CURVE keys must come from the Secret {KEYS_SECRET}")
    elif "clients/server.key" not in {item["path"] for item in secrets[KEYS_SECRET].get("items", [])}:
        problems.append(f"{name}: the front door connects with the server's key pair: project server.key into clients/")


KEYS_SECRET = "batchmaker-keys"


def check_exposure(objects: list[dict[str, Any]], config: Config, files: DoorFiles, problems: list[str]) -> None:
    """Clients authenticated on every port; metrics on no Service; a NetworkPolicy that admits clients to the
    client ports and only Prometheus to the metrics port."""
    if config.server.curve is None:
        problems.append("the config must set [server.curve]: the client port is reachable from the cluster")
    for table in (t for t in DOOR_TABLES if getattr(config, t) is not None):
        named = files.get(table, {})
        if "tls_cert" not in named or not {"token_file", "tls_client_ca"} & set(named):
            problems.append(f"the config's [{table}] is reachable from the cluster: it needs TLS and a token_file")
    metrics_port = int(config.server.metrics_address.rpartition(":")[2])
    for service in (o for o in objects if o["kind"] == "Service"):
        for port in service["spec"].get("ports", []):
            if port.get("name") == "metrics" or metrics_port in (port.get("port"), port.get("targetPort")):
                problems.append(f"Service {service['metadata']['name']} publishes the metrics port")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    if not policies:
        problems.append("a NetworkPolicy must restrict who reaches the pods")
    admitted = {p.get("port") for o in policies for rule in o["spec"].get("ingress", []) for p in rule.get("ports", [])}
    if not {"http", "grpc"} <= admitted:
        problems.append("a NetworkPolicy must admit clients to the front door's http and grpc ports")
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


def check_kserve(objects: list[dict[str, Any]], problems: list[str]) -> None:
    """The ServingRuntime serves its ConfigMap's [http] listener on its one port, probes it, and speaks v2, and
    the InferenceService runs it with protocolVersion v2."""
    config, files = server_config(objects, "batchmaker-kserve-config")
    runtime = next(o for o in objects if o["kind"] == "ServingRuntime")
    name = f"ServingRuntime {runtime['metadata']['name']}"
    if "v2" not in runtime["spec"].get("protocolVersions", []):
        problems.append(f"{name}: protocolVersions must include v2")
    container = runtime["spec"]["containers"][0]
    ports = [p["containerPort"] for p in container.get("ports", [])]
    if config.http is None or ports != [port_of(config.http.address)]:
        problems.append(f"{name}: its one port must be the config's [http] address port")
    check_probes(name, container, config, files, KSERVE_PROBES, problems)
    check_door_files(name, runtime["spec"] | {"containers": [container]}, files, problems)
    for service in (o for o in objects if o["kind"] == "InferenceService"):
        model = service["spec"]["predictor"].get("model", {})
        if model.get("runtime") != runtime["metadata"]["name"] or model.get("protocolVersion") != "v2":
            problems.append(
                f"InferenceService {service['metadata']['name']}: its model must use {name} with protocolVersion v2"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k8s", type=Path, default=MANIFESTS, help="the Kubernetes manifests (default: deploy/k8s)")
    parser.add_argument("--kserve", type=Path, default=KSERVE, help="the KServe example (default: deploy/kserve)")
    args = parser.parse_args(argv)
    objects = load_objects(args.k8s)
    config, files = server_config(objects, "batchmaker-config")
    problems: list[str] = []
    if not config.server.metrics_address:
        problems.append("the config must set metrics_address: Prometheus scrapes it")
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    for deployment in deployments:
        check_deployment(deployment, config, files, problems)
    check_exposure(objects, config, files, problems)
    check_ignored_keys(problems)
    check_kserve(load_objects(args.kserve), problems)
    for problem in problems:
        print(f"deploy: {problem}", file=sys.stderr)
    if not problems:
        print(f"deploy: the configs load and {len(deployments)} Deployments and the KServe example agree with them")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
