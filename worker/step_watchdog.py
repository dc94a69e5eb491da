"""The end of a worker whose running batch is stuck in a step.

A cell that never returns cannot be interrupted, and the running batch's steps run on the worker's main thread, the
one that reads the manager's messages: such a worker would never read the manager's `stop`. The manager takes a
running batch that ran no step for `hang_timeout_ms` for hung, and replays its requests on other workers (a worker
on its host it kills; one on another host it tells to stop). This thread ends the process once a step has outlasted
that timeout by a second, so that a hung worker on another host ends too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("batchmaker.worker")

MARGIN_S = 1.0  # beyond the manager's hang timeout: it has written this worker off by then
CHECK_S = 0.25
EXIT_HUNG = 3  # the process's exit status


class StepWatchdog(threading.Thread):
    """Ends the process when a step of the running batch lasts longer than `timeout_s` + MARGIN_S."""

    def __init__(self, timeout_s: float):
        super().__init__(name="step-watchdog", daemon=True)
        self._limit_s = timeout_s + MARGIN_S
        self._since: float | None = None  # when the step under way began; written by the main thread only

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one step of the running batch."""
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def run(self) -> None:
        while True:
            time.sleep(CHECK_S)
            since = self._since
            if since is not None and time.monotonic() - since > self._limit_s:
                log.error("a step of the running batch has not returned for %.1f s: the manager took this worker for "
                          "hung and sent its requests elsewhere; exiting", time.monotonic() - since)  # fmt: skip
                logging.shutdown()
                os._exit(EXIT_HUNG)
