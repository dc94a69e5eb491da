"""Shared memory segments: named by their creator, and those of processes that are gone removed at start."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from batchmaker.common.shm import PREFIX, SHM_DIR, SharedArray, remove_stale_segments


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_segments_of_processes_that_are_gone_are_removed_and_live_ones_kept():
    live = SharedArray("float32", (4, 2))
    stale = SHM_DIR / f"{PREFIX}{dead_pid()}-0123456789ab"
    stale.write_bytes(b"\x00" * 64)
    other = SHM_DIR / "psm_not_ours_0123"
    other.write_bytes(b"\x00")
    try:
        assert live.name.startswith(f"{PREFIX}") and (SHM_DIR / live.name).exists()
        assert stale.name in remove_stale_segments()
        assert not stale.exists() and other.exists()
        assert (SHM_DIR / live.name).exists()  # its creator, this process, runs
        live.array[:] = 1
        np.testing.assert_array_equal(live.array, np.ones((4, 2)))
    finally:
        live.close()
        stale.unlink(missing_ok=True)
        other.unlink(missing_ok=True)
