"""CurveZMQ encryption and client authentication with libzmq's built-in CURVE mechanism.

A server socket gets a long-term keypair and accepts only clients whose public keys
sit as `*.key` files in an allowed directory; libzmq asks a ZAP handler (pyzmq's
ThreadAuthenticator, one per context) about every CURVE handshake, and a refused
client is dropped during the handshake, so none of its messages reaches the socket.
Sockets of the same context that do not use CURVE are unaffected.

Keys are stored in zmq's certificate format (what `zmq.auth.create_certificates`
writes): NAME.key holds the public key and may be shared, NAME.key_secret holds both
keys and is created readable by its owner only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

Z85_KEY_LENGTH = 40  # a 32-byte Curve25519 key in Z85 text


def _certificate_text(public_key: bytes, secret_key: bytes | None) -> str:
    if secret_key:
        banner = ["#   ZeroMQ CURVE **Secret** Certificate", "#   Keep this file private: it proves who its owner is."]
    else:
        banner = ["#   ZeroMQ CURVE Public Certificate", "#   Give this file to the peers that must know its owner."]
    lines = [
        f"#   ****  Generated on {datetime.datetime.now()} by batchmaker  ****",
        *banner,
        "",
        "metadata",
        "curve",
        f'    public-key = "{public_key.decode("ascii")}"',
    ]
    if secret_key:
        lines.append(f'    secret-key = "{secret_key.decode("ascii")}"')
    return "\n".join(lines) + "\n"


def _create_exclusive(path: Path, text: str, mode: int) -> None:
    """Create `path` with `mode` from the start, failing if it exists, so a secret is never briefly readable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)


def generate_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write a new keypair as DIRECTORY/NAME.key (public) and NAME.key_secret (mode 0600); never overwrite."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_file = directory / f"{name}.key"
    secret_file = directory / f"{name}.key_secret"
    existing = [str(p) for p in (public_file, secret_file) if p.exists()]
    if existing:
        raise FileExistsError(
            f"refusing to overwrite {' and '.join(existing)}: replacing a key locks out every peer that trusts it; "
            "choose another name or remove the files first"
        )
    public_key, secret_key = zmq.curve_keypair()
    _create_exclusive(secret_file, _certificate_text(public_key, secret_key), 0o600)
    try:
        _create_exclusive(public_file, _certificate_text(public_key, None), 0o644)
    except BaseException:
        secret_file.unlink()  # leave no half keypair behind
        raise
    return public_file, secret_file


def _load(path: Path) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"key file {path} does not exist")
    public_key, secret_key = zmq.auth.load_certificate(path)
    for key in (public_key, secret_key):
        if key is not None and len(key) != Z85_KEY_LENGTH:
            raise ValueError(f"{path} holds a malformed key ({len(key)} characters, expected {Z85_KEY_LENGTH})")
    return public_key, secret_key


def load_public_key(path: Path) -> bytes:
    """The Z85 public key of a .key or .key_secret file."""
    return _load(path)[0]


def load_secret_key(path: Path) -> tuple[bytes, bytes]:
    """The Z85 (public, secret) keys of a .key_secret file."""
    public_key, secret_key = _load(path)
    if secret_key is None:
        raise ValueError(f"{path} holds no secret key; pass the NAME.key_secret file, not the public NAME.key")
    mode = Path(path).stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(
            f"secret key file {path} may be read by other users (mode {mode:04o}); "
            f"allow its owner only: chmod 600 {path}"
        )
    return public_key, secret_key


class CurveServer:
    """Makes sockets CURVE servers that accept only the clients whose public keys are in `allowed_dir`
    (`peers` names them in errors: clients, or workers on the manager's worker sockets).

    The allowed keys are read once, here; restart to pick up new ones. libzmq allows one
    ZAP handler per context, so create one CurveServer per context and `apply` it to
    every socket that needs it; `stop` it before terminating the context.
    """

    def __init__(self, context: zmq.Context, secret_key_file: Path, allowed_dir: Path, peers: str = "client") -> None:
        self._public_key, self._secret_key = load_secret_key(secret_key_file)
        allowed_dir = Path(allowed_dir)
        if not allowed_dir.is_dir():
            raise FileNotFoundError(f"allowed {peers} keys directory {allowed_dir} does not exist")
        if not any(allowed_dir.glob("*.key")):
            raise ValueError(f"{allowed_dir} holds no *.key file, so no {peers} could connect")
        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.configure_curve(domain="*", location=str(allowed_dir))  # reads the keys, may raise
        self._authenticator.start()

    def apply(self, socket: zmq.Socket) -> None:
        """Make `socket` a CURVE server with this keypair; call before bind."""
        socket.curve_secretkey = self._secret_key
        socket.curve_publickey = self._public_key
        socket.curve_server = True

    def stop(self) -> None:
        self._authenticator.stop()


@dataclass(frozen=True)
class CurveClient:
    """A client's key pair and the server's public key, read once, for every socket that connects with them."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes

    @classmethod
    def load(cls, client_secret_file: Path, server_public_file: Path) -> CurveClient:
        """Read the key files; raises FileNotFoundError or ValueError saying which file is wrong."""
        public_key, secret_key = load_secret_key(client_secret_file)
        return cls(public_key, secret_key, load_public_key(server_public_file))

    def apply(self, socket: zmq.Socket) -> None:
        """Make `socket` a CURVE client that proves its key and checks the server's; call before connect."""
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = self.public_key
        socket.curve_serverkey = self.server_key


def connect_socket(
    context: zmq.Context, kind: int, address: str, curve: CurveClient | None, linger_ms: int = 0
) -> zmq.Socket:
    """A socket of `kind` connected to `address`, as a CURVE client with `curve`'s keys when given."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, linger_ms)
    if curve is not None:
        curve.apply(socket)
    socket.connect(address)
    return socket


def apply_curve_client(socket: zmq.Socket, client_secret_file: Path, server_public_file: Path) -> None:
    """Make `socket` a CURVE client that proves its key and checks the server's; call before connect."""
    CurveClient.load(client_secret_file, server_public_file).apply(socket)


def keygen_main(argv: list[str] | None = None) -> int:
    """`batchmaker keygen DIRECTORY [--name NAME]`: create a CURVE keypair."""
    parser = argparse.ArgumentParser(
        prog="batchmaker keygen",
        description="Create a CurveZMQ keypair: NAME.key (public, share it) and NAME.key_secret (keep it private).",
    )
    parser.add_argument("directory", type=Path, help="where to write the key files (created if missing)")
    parser.add_argument("--name", default="server", help="base name of the key files (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.name or args.name != Path(args.name).name or args.name.startswith("."):
        parser.error(f"--name must be a plain file name, got {args.name!r}")
    try:
        public_file, secret_file = generate_keypair(args.directory, args.name)
    except OSError as exc:
        print(f"batchmaker keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public_file}")
    print(f"secret key: {secret_file}")
    print(
        f"hint: keep {secret_file.name} private; give {public_file.name} to the other side "
        "(clients need the server's .key, the server's allowed-clients directory needs each client's .key)"
    )
    return 0
