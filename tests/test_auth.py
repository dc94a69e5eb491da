"""CurveZMQ: real sockets on loopback, an allowed client is served, anyone else never reaches the server."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from batchmaker.common.auth import (
    CurveServer,
    apply_curve_client,
    generate_keypair,
    keygen_main,
    load_public_key,
    load_secret_key,
)

TIMEOUT_MS = 1000


class Keys:
    def __init__(self, root: Path) -> None:
        self.server_public, self.server_secret = generate_keypair(root, "server")
        self.allowed = root / "allowed"
        self.allowed.mkdir()
        self.client_public, self.client_secret = generate_keypair(self.allowed, "client")
        self.client_secret = self.client_secret.rename(root / self.client_secret.name)  # only public keys stay
        self.intruder_public, self.intruder_secret = generate_keypair(root, "intruder")


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def server(context: zmq.Context, keys: Keys) -> Iterator[tuple[zmq.Socket, str]]:
    """A CURVE ROUTER on a random loopback port that accepts only `keys.client_public`."""
    curve = CurveServer(context, keys.server_secret, keys.allowed)
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    curve.apply(router)
    router.bind("tcp://127.0.0.1:0")
    yield router, router.last_endpoint.decode()
    router.close()
    curve.stop()


def client_socket(context: zmq.Context, endpoint: str, secret_file: Path | None, server_public: Path) -> zmq.Socket:
    dealer = context.socket(zmq.DEALER)
    dealer.linger = 0
    if secret_file is not None:
        apply_curve_client(dealer, secret_file, server_public)
    dealer.connect(endpoint)
    return dealer


def echo_once(router: zmq.Socket) -> bool:
    """Echo one message if one arrives within the timeout; say whether one did."""
    if not router.poll(TIMEOUT_MS):
        return False
    router.send_multipart(router.recv_multipart())
    return True


def test_allowed_client_gets_a_reply(context: zmq.Context, keys: Keys, server: tuple[zmq.Socket, str]) -> None:
    router, endpoint = server
    dealer = client_socket(context, endpoint, keys.client_secret, keys.server_public)
    dealer.send(b"hello")
    assert echo_once(router)
    assert dealer.poll(TIMEOUT_MS)
    assert dealer.recv() == b"hello"
    dealer.close()


@pytest.mark.parametrize("who", ["unknown key", "no curve"])
def test_other_clients_never_reach_the_server(
    context: zmq.Context, keys: Keys, server: tuple[zmq.Socket, str], who: str
) -> None:
    router, endpoint = server
    secret = keys.intruder_secret if who == "unknown key" else None
    dealer = client_socket(context, endpoint, secret, keys.server_public)
    dealer.send(b"let me in")
    assert not echo_once(router)
    assert not dealer.poll(TIMEOUT_MS)
    dealer.close()


def test_client_with_the_wrong_server_key_is_not_served(
    context: zmq.Context, keys: Keys, server: tuple[zmq.Socket, str]
) -> None:
    """A client that expects another server's key cannot be fooled into talking to this one, nor reach it."""
    router, endpoint = server
    dealer = client_socket(context, endpoint, keys.client_secret, keys.intruder_public)
    dealer.send(b"hello")
    assert not echo_once(router)
    dealer.close()


def test_keypair_files(keys: Keys) -> None:
    assert stat.S_IMODE(keys.server_secret.stat().st_mode) == 0o600
    public, secret = load_secret_key(keys.server_secret)
    assert load_public_key(keys.server_public) == public
    assert len(public) == len(secret) == 40
    assert zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(keys.server_secret) == (public, secret)  # zmq's own reader agrees


def test_loading_a_public_file_as_secret_is_refused(keys: Keys) -> None:
    with pytest.raises(ValueError, match="no secret key"):
        load_secret_key(keys.server_public)
    with pytest.raises(FileNotFoundError):
        load_public_key(keys.server_public.with_name("missing.key"))


def test_generate_keypair_refuses_to_overwrite(keys: Keys, tmp_path: Path) -> None:
    before = keys.server_secret.read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        generate_keypair(tmp_path, "server")
    assert keys.server_secret.read_bytes() == before
    keys.server_secret.unlink()
    with pytest.raises(FileExistsError):  # the public half alone also blocks a new pair
        generate_keypair(tmp_path, "server")
    assert not keys.server_secret.exists()


def test_curve_server_needs_allowed_keys(context: zmq.Context, keys: Keys, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no \\*.key file"):
        CurveServer(context, keys.server_secret, empty)
    with pytest.raises(FileNotFoundError):
        CurveServer(context, keys.server_secret, tmp_path / "missing")
    with pytest.raises(ValueError, match="no secret key"):
        CurveServer(context, keys.server_public, keys.allowed)


def test_keygen_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "keys"
    assert keygen_main([str(directory), "--name", "manager"]) == 0
    out = capsys.readouterr().out
    assert str(directory / "manager.key") in out and str(directory / "manager.key_secret") in out
    assert stat.S_IMODE((directory / "manager.key_secret").stat().st_mode) == 0o600
    load_secret_key(directory / "manager.key_secret")

    assert keygen_main([str(directory), "--name", "manager"]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err

    assert keygen_main([str(directory)]) == 0
    assert (directory / "server.key").is_file()

    with pytest.raises(SystemExit):
        keygen_main([str(directory), "--name", "../elsewhere"])


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_secret_key_file_others_may_read_is_refused(keys: Keys, mode: int) -> None:
    keys.server_secret.chmod(mode)
    with pytest.raises(ValueError, match=f"mode {mode:04o}.*chmod 600"):
        load_secret_key(keys.server_secret)
    keys.server_secret.chmod(0o400)
    assert load_secret_key(keys.server_secret)
