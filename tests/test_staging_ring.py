"""The GPU worker's staging ring (worker.staging_ring): regions handed out in issue order, free again once the
counter passes their task, never overlapping a region still in use; and a CUDA backend that stages every
task from it, allocating no pinned memory per task."""

from __future__ import annotations

import numpy as np
import torch
from test_cuda_backend import fake_backend, hold_stream, lstm_task, small  # noqa: F401  (small: a fixture)

from batchmaker.worker import cuda
from batchmaker.worker.staging_ring import StagingRing


def ring(capacity: int = 100) -> StagingRing:
    pinned = torch.zeros(capacity, dtype=torch.uint8)
    return StagingRing(pinned, pinned.numpy(), torch.zeros(capacity, dtype=torch.uint8))


def start(region) -> int | None:
    return None if region is None else region[0]


def test_regions_follow_each_other_and_wrap_once_the_oldest_are_done():
    staging = ring()
    assert [start(staging.take(30, number, passed=0)) for number in (1, 2, 3)] == [0, 30, 60]
    assert staging.take(30, 4, passed=0) is None  # 10 bytes left at the end, none at the start
    assert start(staging.take(30, 4, passed=1)) == 0  # task 1 done: its region comes round again
    assert staging.take(10, 5, passed=1) is None  # wrapped: the free space is what lies before the oldest in use
    _, host, device = staging.take(5, 5, passed=3) or (None, None, None)
    assert host.size == 5 and device.numel() == 5


def test_a_region_never_overlaps_one_in_use():
    rng = np.random.default_rng(0)
    staging, in_use, passed = ring(256), {}, 0
    for number in range(1, 2000):
        passed = max(passed, number - int(rng.integers(1, 6)))  # the counter lags a few tasks behind
        in_use = {n: span for n, span in in_use.items() if n > passed}
        nbytes = int(rng.integers(0, 90))
        region = staging.take(nbytes, number, passed)
        if region is None:
            continue
        begin = region[0]
        assert begin + nbytes <= 256
        assert all(begin + nbytes <= b or e <= begin for b, e in in_use.values() if nbytes), (number, in_use)
        in_use[number] = (begin, begin + nbytes)


def test_the_backend_stages_tasks_from_the_ring_and_falls_back_when_it_is_full(small, monkeypatch):  # noqa: F811
    monkeypatch.setattr(cuda, "STAGING_RING_BYTES", 4096)
    with fake_backend(small) as (backend, runtime, _):
        allocated = len(runtime.pinned_tensors)
        for task_id in range(1, 51):
            backend.issue(lstm_task(task_id, small, backend))
        assert len(runtime.pinned_tensors) == allocated  # the stream ran each task as it came: regions came back
        hold_stream(backend, runtime)
        for task_id in range(51, 151):
            backend.issue(lstm_task(task_id, small, backend))
        assert len(runtime.pinned_tensors) > allocated  # a held stream filled the ring: tasks staged on their own
        runtime.run(backend._calls.stream)
        assert all(backend.finish(task_id) is None for task_id in range(1, 151))
