"""Page-locked staging memory reused task after task, so that a GPU task costs no host allocation.

A task's slot lists and inline values reach the device in one copy from page-locked host memory
(device_tasks.Staging). The ring holds one page-locked buffer and its device twin, allocated once,
and hands out regions in the order tasks are issued. A region is free again once the stream's
counter has passed its task: the task's upload, the first thing it enqueues, has run by then, so
its host bytes may be overwritten. Its device bytes may be overwritten sooner, by any later task,
as the later upload runs after the earlier task's kernels on the same stream.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


class StagingRing:
    """Regions of one page-locked host buffer (`pinned`, viewed as `host`) and a device buffer of the
    same size; `take` gives none when the free space cannot hold the task (the caller allocates)."""

    def __init__(self, pinned: torch.Tensor, host: np.ndarray, device: torch.Tensor):
        self.pinned, self._host, self._device = pinned, host, device
        self.capacity = host.size
        self._head = 0  # where the next region starts, unless it must wrap to 0
        self._held: deque[tuple[int, int]] = deque()  # (start, task number) of regions in use, oldest first

    def take(self, nbytes: int, number: int, passed: int) -> tuple[int, np.ndarray, torch.Tensor] | None:
        """A region of `nbytes` for task `number` (the counter's value once it is done), the counter now
        at `passed`: where it starts in `pinned`, its numpy view, and its device twin."""
        while self._held and self._held[0][1] <= passed:
            self._held.popleft()
        start = self._start(nbytes)
        if start is None:
            return None
        self._held.append((start, number))
        self._head = start + nbytes
        end = start + nbytes
        return start, self._host[start:end], self._device[start:end]

    def _start(self, nbytes: int) -> int | None:
        if nbytes > self.capacity:
            return None
        if not self._held:
            return 0
        tail = self._held[0][0]  # the oldest region in use starts here
        if self._head > tail:  # in use: [tail, head); free: [head, capacity) and [0, tail)
            if self.capacity - self._head >= nbytes:
                return self._head
            return 0 if tail >= nbytes else None
        return self._head if tail - self._head >= nbytes else None  # wrapped: free is [head, tail)
