"""The Kubernetes ConfigMap's config served as a pod would serve it, its Secrets' files made here and its
addresses moved to free loopback ports: the kubelet's probes answer over HTTPS without a token, the front door
reaches its CURVE-protected manager with the server's key pair, and inference needs the token."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from conftest import free_port, start_server, stop_server
from test_frontdoor_security import certificate
from tritonclient.utils import InferenceServerException

from batchmaker.common.config import load_config
from batchmaker.common.models import build_model, init_missing_weights

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "cluster-token"
TOLERANCE = 1e-5


def pod_files(directory: Path) -> None:
    """What the pod's volumes hold: keys/ as install-keys leaves it, door/ from the Secret batchmaker-door."""
    keys, door = directory / "keys", directory / "door"
    for name in ("server", "clients"):
        command = [sys.executable, "-m", "batchmaker.manager.commands.cli", "keygen", str(directory / "made")]
        subprocess.run([*command, "--name", name], check=True, capture_output=True)
    (keys / "clients").mkdir(parents=True)
    door.mkdir()
    (keys / "server.key_secret").write_bytes((directory / "made" / "server.key_secret").read_bytes())
    os.chmod(keys / "server.key_secret", 0o600)
    for name in ("server.key", "clients.key"):  # the Deployments' items: clients/clients.key, clients/server.key
        (keys / "clients" / name).write_bytes((directory / "made" / name).read_bytes())
    ca = certificate(door, "ca", None)
    certificate(door, "server", ca)
    (door / "server.pem").rename(door / "tls.crt")
    (door / "server.key").rename(door / "tls.key")
    (door / "token").write_text(TOKEN + "\n")


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("pod")
    pod_files(directory)
    text = yaml.safe_load((ROOT / "deploy" / "k8s" / "configmap.yaml").read_text())["data"]["config.toml"]
    ports = {"http": free_port(), "grpc": free_port()}
    for old, new in (
        ("tcp://0.0.0.0:5555", f"tcp://127.0.0.1:{free_port()}"),
        ("0.0.0.0:9100", f"127.0.0.1:{free_port()}"),
        ("0.0.0.0:8000", f"127.0.0.1:{ports['http']}"),
        ("0.0.0.0:8001", f"127.0.0.1:{ports['grpc']}"),
        ('"/keys/', f'"{directory}/keys/'),
        ('"/door/', f'"{directory}/door/'),
        ('"/weights/', f'"{directory}/'),
        ("arena_rows = 16384", "arena_rows = 4096"),
        ("io_rows = 16384", "io_rows = 4096"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    (directory / "config.toml").write_text(text)
    config = load_config(directory / "config.toml")
    init_missing_weights(config)
    server = start_server(config)
    yield config, ports, directory
    stop_server(server)


def probe(port: int, path: str) -> int:
    """GET as the kubelet does: HTTPS without checking the certificate, no token."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=context, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_probes_answer_over_https_without_a_token(pod):
    _, ports, _ = pod
    assert probe(ports["http"], "/v2/health/live") == 200
    assert probe(ports["http"], "/v2/health/ready") == 200  # the door reached its manager: the server's key is allowed
    assert probe(ports["http"], "/v2/models/lstm") == 401  # everything else needs the token


def test_grpc_over_tls_serves_with_the_token_and_refuses_without(pod):
    config, ports, directory = pod
    model = build_model(config.models["lstm"])
    expected = model.reference(model.load_weights(), {"tokens": [5, 17, 342, 9]})
    tokens = grpcclient.InferInput("tokens", [4], "INT64")
    tokens.set_data_from_numpy(np.array([5, 17, 342, 9], dtype=np.int64))
    url = f"127.0.0.1:{ports['grpc']}"
    with grpcclient.InferenceServerClient(
        url, ssl=True, root_certificates=str(directory / "door" / "ca.pem")
    ) as triton:
        result = triton.infer("lstm", [tokens], headers={"authorization": f"Bearer {TOKEN}"})
        assert np.abs(result.as_numpy("h") - expected["h"]).max() <= TOLERANCE
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            triton.infer("lstm", [tokens])
