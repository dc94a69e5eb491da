"""The Kubernetes and KServe ConfigMaps' configs served as their pods would serve them, their Secrets' files made
here and their addresses moved to free loopback ports: the probes answer without a token, the front door
reaches its manager (CURVE-protected, with the server's key pair, on Kubernetes), and inference needs the token."""

from __future__ import annotations

import json
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


def test_the_kserve_config_serves_v2_over_http_on_loopback_with_the_token(tmp_path: Path):
    text = yaml.safe_load((ROOT / "deploy" / "kserve" / "configmap.yaml").read_text())["data"]["config.toml"]
    port = free_port()
    for old, new in (
        ("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{free_port()}"),
        ("127.0.0.1:9100", f"127.0.0.1:{free_port()}"),
        ("127.0.0.1:8080", f"127.0.0.1:{port}"),
        ('"/door/', f'"{tmp_path}/'),
        ('"/weights/', f'"{tmp_path}/'),
    ):
        assert old in text, old
        text = text.replace(old, new)
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "config.toml").write_text(text)
    config = load_config(tmp_path / "config.toml")
    init_missing_weights(config)
    model = build_model(config.models["lstm"])
    expected = model.reference(model.load_weights(), {"tokens": [5, 17, 342, 9]})
    body = json.dumps({"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [4], "data": [5, 17, 342, 9]}]})
    server = start_server(config)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=10) as reply:
            assert reply.status == 200  # the ServingRuntime's readiness probe, as queue-proxy runs it
        infer = f"http://127.0.0.1:{port}/v2/models/lstm/infer"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
        with urllib.request.urlopen(urllib.request.Request(infer, body.encode(), headers), timeout=30) as reply:
            outputs = {output["name"]: output["data"] for output in json.load(reply)["outputs"]}
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(infer, body.encode(), {"Content-Type": "application/json"}))
    finally:
        stop_server(server)
    assert np.abs(np.array(outputs["h"], dtype=np.float32) - expected["h"]).max() <= TOLERANCE
    assert refused.value.code == 401
