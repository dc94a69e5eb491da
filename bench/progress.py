"""A one-line progress bar on stderr for the benchmark sweep."""

from __future__ import annotations

import sys
import time

WIDTH = 30


class Progress:
    def __init__(self, total: int, stream=sys.stderr):
        self.total = max(total, 1)
        self.done = 0
        self.label = ""
        self._stream = stream
        self._start = time.monotonic()
        self._tty = stream.isatty()

    def note(self, label: str) -> None:
        self.label = label
        self._draw()

    def advance(self, steps: int = 1) -> None:
        self.done = min(self.total, self.done + steps)
        self._draw()

    def _draw(self) -> None:
        filled = WIDTH * self.done // self.total
        elapsed = time.monotonic() - self._start
        line = f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total} {elapsed:5.0f}s  {self.label}"
        if self._tty:
            self._stream.write("\r\033[K" + line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()
