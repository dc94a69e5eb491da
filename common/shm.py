"""Named shared memory holding one array, mappable by other processes.

CPU workers create their arenas and signal counter here, CUDA workers their io arenas; the
manager attaches to a worker's io arenas to read results. (External inputs travel inline in
the task message, and completions arrive as notices: the manager maps no counter.)
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

_created_here: set[str] = set()
PREFIX = "batchmaker-"  # then the creating process's pid: a segment whose creator is gone is stale
SHM_DIR = Path("/dev/shm")


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink this project's segments whose creating process no longer runs (a killed server's,
    left in a container's /dev/shm that outlives it); return their names. Segments of servers
    still running keep their creators, so several servers may share one /dev/shm."""
    removed = []
    for path in directory.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].partition("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class SharedArray:
    """A numpy array in named shared memory. The creating process owns (and unlinks) it."""

    def __init__(self, dtype: str, shape: tuple[int, ...], name: str | None = None):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize)
        self.owner = name is None
        if self.owner:
            name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            _created_here.add(self._shm.name)
        else:
            self._shm = shared_memory.SharedMemory(name=name)
            if name not in _created_here:
                # Attaching registers the segment with this process's resource tracker, which
                # would unlink it (under its owner's feet) when this process exits.
                resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
            if self._shm.size < nbytes:
                raise ValueError(f"shared memory {name} holds {self._shm.size} bytes, expected {nbytes}")
        self.array = np.ndarray(self.shape, dtype=self.dtype, buffer=self._shm.buf)
        if self.owner:
            self.array.fill(0)

    @property
    def name(self) -> str:
        return self._shm.name

    def close(self) -> None:
        """Unmap (and unlink, for the owner). Views handed out must be dropped first."""
        self.array = None  # type: ignore[assignment]
        try:
            self._shm.close()
        except BufferError:
            pass  # a torch view still exports the buffer; the mapping goes with the process
        self.unlink()

    def unlink(self) -> None:
        """Remove the name (for the owner): no process can attach any more, and the memory goes once
        every mapping of it is closed."""
        if self.owner and self._shm.name in _created_here:
            _created_here.discard(self._shm.name)
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
