"""What the manager's memory grows by over a long run, to tell a leak from a cache filling up.

Set BATCHMAKER_TRACE_MEMORY to a file path and the manager traces its Python allocations (tracemalloc:
it then serves several times slower, so this is for finding where memory goes, not for serving). One
interval after it starts (BATCHMAKER_TRACE_MEMORY_EVERY_S, 60 s by default: once it has warmed up)
it takes a first snapshot; at every interval after that, and when it exits, it rewrites the file with
what has grown since: the traced total then and now, and the allocation sites that grew most, each
with its call stack. A leak keeps growing from one report to the next; a bounded cache stops.
"""

from __future__ import annotations

import linecache
import logging
import os
import threading
import tracemalloc
from pathlib import Path

log = logging.getLogger("batchmaker.manager")

PATH_ENV = "BATCHMAKER_TRACE_MEMORY"
EVERY_ENV = "BATCHMAKER_TRACE_MEMORY_EVERY_S"
DEFAULT_EVERY_S = 60.0
FRAMES = 8  # of each allocation's call stack kept, so a site shows who asked for it
TOP = 25  # allocation sites reported
IGNORED = (
    tracemalloc.__file__,
    linecache.__file__,
    "<frozen importlib._bootstrap>",
    "<frozen importlib._bootstrap_external>",
    "<unknown>",
)


class MemoryTrace:
    def __init__(self, path: Path, every_s: float):
        self.path = path
        self.every_s = every_s
        self._first: tracemalloc.Snapshot | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # the last report at exit and a periodic one must not interleave
        self._thread = threading.Thread(target=self._run, name="memory-trace", daemon=True)

    @classmethod
    def from_environment(cls) -> MemoryTrace | None:
        """The trace asked for by the environment, or None; raises ValueError for a malformed interval."""
        path = os.environ.get(PATH_ENV)
        if not path:
            return None
        every = os.environ.get(EVERY_ENV, str(DEFAULT_EVERY_S))
        try:
            every_s = float(every)
        except ValueError:
            every_s = -1.0
        if not every_s > 0:
            raise ValueError(f"{EVERY_ENV} must be a number of seconds above 0, got {every!r}")
        return cls(Path(path), every_s)

    def start(self) -> None:
        tracemalloc.start(FRAMES)
        self._thread.start()
        log.warning(
            "tracing memory (serving is slower meanwhile): growth after %g s written to %s", self.every_s, self.path
        )

    def stop(self) -> None:
        """Write the last report and stop tracing."""
        self._stopped.set()
        self._thread.join()
        self._report()
        tracemalloc.stop()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            self._report()

    def _report(self) -> None:
        with self._lock:
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, name) for name in IGNORED])
            if self._first is None:
                self._first = snapshot
                self.path.write_text("first snapshot taken; growth is reported from the next one\n")
                return
            self.path.write_text(growth(self._first, snapshot))


def growth(first: tracemalloc.Snapshot, now: tracemalloc.Snapshot) -> str:
    """The traced total in both snapshots and the TOP call stacks whose allocations grew most between them."""
    before = sum(stat.size for stat in first.statistics("filename"))
    after = sum(stat.size for stat in now.statistics("filename"))
    lines = [f"traced: {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB ({(after - before) / 2**20:+.2f} MiB)"]
    for stat in now.compare_to(first, "traceback")[:TOP]:
        lines.append(
            f"\n{stat.size_diff / 1024:+.1f} KiB in {stat.count_diff:+d} blocks (now {stat.size / 1024:.1f} KiB)"
        )
        lines += stat.traceback.format(most_recent_first=True)
    return "\n".join(lines) + "\n"
