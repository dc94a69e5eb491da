"""The front door's TLS, client certificates and bearer tokens, with certificates made for the test: a
request needs all that its port asks for, and the probes stay open."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import SMALL_LSTM, stop_server
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from oip_server import Door, close, start_door
from tritonclient.utils import InferenceServerException

from batchmaker.common.auth import keygen_main

TOKEN = "s3cret-token"


def certificate(
    directory: Path, name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None
) -> tuple:
    """A key and certificate for 127.0.0.1 named `name`, signed by `issuer` (None: a self-signed CA); written as
    NAME.pem/.key."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert, key


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Door, Path]]:
    """HTTP with TLS, client certificates and a token; gRPC with TLS and a token."""
    directory = tmp_path_factory.mktemp("tls")
    ca = certificate(directory, "ca", None)
    certificate(directory, "server", ca)
    certificate(directory, "client", ca)
    (directory / "token").write_text(TOKEN + "\n")
    tls = 'tls_cert = "server.pem"\ntls_key = "server.key"\ntoken_file = "token"\n'
    door = start_door(directory, SMALL_LSTM, http_extra=tls + 'tls_client_ca = "ca.pem"', grpc_extra=tls)
    yield door, directory
    stop_server(door.server)


def tokens() -> np.ndarray:
    return np.array([5, 17, 342], dtype=np.int64)


def https(secured: tuple[Door, Path], path: str, token: str | None, client_cert: bool = True) -> int:
    door, directory = secured
    context = ssl.create_default_context(cafile=directory / "ca.pem")
    if client_cert:
        context.load_cert_chain(directory / "client.pem", directory / "client.key")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"https://{door.http}{path}", headers=headers), context=context
        ) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def test_http_with_a_client_certificate_and_the_token_is_served(secured: tuple[Door, Path]):
    door, directory = secured
    options = {
        "keyfile": str(directory / "client.key"),
        "certfile": str(directory / "client.pem"),
        "ca_certs": str(directory / "ca.pem"),
    }
    triton = httpclient.InferenceServerClient(door.http, ssl=True, ssl_options=options)
    item = httpclient.InferInput("tokens", [3], "INT64")
    item.set_data_from_numpy(tokens())
    reply = triton.infer("lstm", [item], headers={"Authorization": f"Bearer {TOKEN}"})
    assert close(reply.as_numpy("h"), door.reference("lstm", {"tokens": tokens().tolist()})["h"])


def test_http_without_the_token_is_401_but_the_probes_stay_open(secured: tuple[Door, Path]):
    assert https(secured, "/v2/models/lstm", None) == 401
    assert https(secured, "/v2/models/lstm", "wrong") == 401
    assert https(secured, "/v2/models/lstm", TOKEN) == 200
    assert https(secured, "/v2/health/ready", None) == 200 and https(secured, "/metrics", None) == 200


def test_http_without_a_client_certificate_is_refused_at_the_handshake(secured: tuple[Door, Path]):
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionResetError)):
        https(secured, "/v2/health/live", TOKEN, client_cert=False)


def test_grpc_over_tls_needs_the_token(secured: tuple[Door, Path]):
    door, directory = secured
    triton = grpcclient.InferenceServerClient(door.grpc, ssl=True, root_certificates=str(directory / "ca.pem"))
    item = grpcclient.InferInput("tokens", [3], "INT64")
    item.set_data_from_numpy(tokens())
    reply = triton.infer("lstm", [item], headers={"authorization": f"Bearer {TOKEN}"})
    assert close(reply.as_numpy("c"), door.reference("lstm", {"tokens": tokens().tolist()})["c"])
    with pytest.raises(InferenceServerException) as refused:
        triton.infer("lstm", [item])
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException):  # plaintext to a TLS port
        grpcclient.InferenceServerClient(door.grpc).is_server_live()


def test_with_curve_on_the_manager_the_front_door_connects_with_the_servers_key(tmp_path: Path):
    keys = tmp_path / "keys"
    assert keygen_main([str(keys), "--name", "server"]) == 0
    (keys / "clients").mkdir()
    shutil.copy(keys / "server.key", keys / "clients" / "server.key")  # as docs/protocol.md says
    curve = '\n[server.curve]\nsecret_key = "keys/server.key_secret"\nallowed_clients = "keys/clients"\n'
    door = start_door(tmp_path, SMALL_LSTM, server=curve)
    try:
        triton = httpclient.InferenceServerClient(door.http)
        assert triton.is_server_ready()
        item = httpclient.InferInput("tokens", [3], "INT64")
        item.set_data_from_numpy(tokens())
        assert close(
            triton.infer("lstm", [item]).as_numpy("h"), door.reference("lstm", {"tokens": tokens().tolist()})["h"]
        )
    finally:
        stop_server(door.server)
