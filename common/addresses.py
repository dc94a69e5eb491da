"""ZeroMQ addresses: which ones other machines can reach, and where workers push completion notices."""

from __future__ import annotations


def is_loopback(address: str) -> bool:
    """Whether only this machine can reach `address`: ipc://, inproc:// or a loopback tcp:// host.
    Every other transport (ws://, tipc://, pgm://, udp://, ...) is taken as reachable from elsewhere."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    return scheme == "tcp" and (host in ("localhost", "::1") or host.startswith("127."))


def completion_address(worker_address: str) -> str:
    """Where workers push completion notices: beside the worker address (the next tcp port).

    Workers derive it from the address they reach the manager at, which is not always the one
    the manager binds (a manager bound to 0.0.0.0 is reached at one of its host's addresses)."""
    if worker_address.startswith("tcp://"):
        host, _, port = worker_address.rpartition(":")
        return f"{host}:{int(port) + 1}"
    return worker_address + "-completions"
