"""deploy/check_manifests.py (what ./deploy/validate runs after the schemas) on the bundled manifests, which it
accepts, and on copies each broken in one way, which it refuses, naming what is wrong."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def check(tmp_path: Path, edits: dict[str, tuple[str, str]]) -> subprocess.CompletedProcess:
    """Run the checks on copies of deploy/k8s and deploy/kserve, with `edits` (file -> (old, new)) applied."""
    for folder in ("k8s", "kserve"):
        shutil.copytree(ROOT / "deploy" / folder, tmp_path / folder)
    for name, (old, new) in edits.items():
        path = tmp_path / name
        text = path.read_text()
        assert old in text, (name, old)
        path.write_text(text.replace(old, new))
    command = [sys.executable, str(ROOT / "deploy" / "check_manifests.py")]
    return subprocess.run(
        [*command, "--k8s", str(tmp_path / "k8s"), "--kserve", str(tmp_path / "kserve")],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_bundled_manifests_agree_with_their_configs(tmp_path: Path):
    done = check(tmp_path, {})
    assert done.returncode == 0, done.stderr
    assert "2 Deployments and the KServe example agree with them" in done.stdout


READY = "httpGet: {path: /v2/health/ready, port: http, scheme: HTTPS}"
HTTP_TABLE = '[http]\n    address = "0.0.0.0:8000"\n'
GRPC_TOKEN = '    token_file = "/door/token"\n\n    [scheduler]'
DOOR_MOUNT = "            - {name: door, mountPath: /door, readOnly: true}  # the config names its files\n"


@pytest.mark.parametrize(
    ("edits", "problem"),
    [
        (
            {"k8s/deployment-cpu.yaml": (READY, READY.replace("port: http", "port: metrics"))},
            "batchmaker: readinessProbe must GET /v2/health/ready with HTTPS on port 8000",
        ),
        (
            {"k8s/deployment-gpu.yaml": (READY, READY.replace(", scheme: HTTPS", ""))},
            "batchmaker-gpu: readinessProbe must GET /v2/health/ready with HTTPS on port 8000",
        ),
        (
            {"k8s/configmap.yaml": (HTTP_TABLE, HTTP_TABLE + '    tls_client_ca = "/door/tls.crt"\n')},
            "batchmaker: livenessProbe must GET /healthz with HTTP on port 9100",
        ),
        (
            {"k8s/deployment-cpu.yaml": ("- {name: http, containerPort: 8000}", "- {name: http, containerPort: 8080}")},
            "batchmaker: the container's http port must be the config's [http] address port",
        ),
        (
            {"k8s/deployment-cpu.yaml": (DOOR_MOUNT, "")},
            "batchmaker: container init-weights must mount [http] tls_cert /door/tls.crt from a Secret",
        ),
        (
            {"k8s/configmap.yaml": (GRPC_TOKEN, "\n    [scheduler]")},
            "the config's [grpc] is reachable from the cluster: it needs TLS and a token_file",
        ),
        (
            {"k8s/networkpolicy.yaml": ("        - {port: grpc, protocol: TCP}\n", "")},
            "a NetworkPolicy must admit clients to the front door's http and grpc ports",
        ),
        (
            {"k8s/deployment-gpu.yaml": ("              - {key: server.key, path: clients/server.key}\n", "")},
            "batchmaker-gpu: the front door connects with the server's key pair: project server.key into clients/",
        ),
        (
            {"kserve/servingruntime.yaml": ("- {containerPort: 8080, protocol: TCP}", "- {containerPort: 8000}")},
            "ServingRuntime batchmaker: its one port must be the config's [http] address port",
        ),
        (
            {"kserve/servingruntime.yaml": ("path: /v2/health/ready, port: 8080", "path: /v2/health/live, port: 8080")},
            "ServingRuntime batchmaker: readinessProbe must GET /v2/health/ready with HTTP on port 8080",
        ),
        (
            {"kserve/inferenceservice.yaml": ("protocolVersion: v2", "protocolVersion: v1")},
            "InferenceService batchmaker-lstm: its model must use ServingRuntime batchmaker with protocolVersion v2",
        ),
    ],
)
def test_a_broken_copy_is_refused_with_what_is_wrong(tmp_path: Path, edits: dict[str, tuple[str, str]], problem: str):
    done = check(tmp_path, edits)
    assert done.returncode == 1
    assert f"deploy: {problem}\n" in done.stderr
