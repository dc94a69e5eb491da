"""Host identity: which workers share a machine, and so may read each other's shared memory."""

from __future__ import annotations

import socket
from pathlib import Path

# Stable per machine, or at least per boot; /etc/machine-id is absent in some containers.
MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/proc/sys/kernel/random/boot_id"))


def default_host_id() -> str:
    """This machine's identity: its hostname and machine id (else boot id).

    The hostname keeps containers apart: they may share a kernel (and so a boot id) but not
    /dev/shm, so processes are taken to share memory only when both parts agree."""
    name = socket.gethostname()
    for path in MACHINE_ID_FILES:
        try:
            machine = path.read_text().strip()
        except OSError:
            continue
        if machine:
            return f"{name}/{machine}"
    return name
