"""The stats' latency window: the latest answers' timings, in memory that does not grow as it fills."""

from __future__ import annotations

import tracemalloc

import numpy as np

from batchmaker.manager.observability.stats import TIMINGS, LatencyWindow, Stats


def timing(i: int) -> dict[str, int]:
    return {"total_us": 1_000_000 + i, "queue_us": 500_000 + i, "compute_us": 200_000 + i}


def test_the_window_keeps_the_latest_answers():
    window = LatencyWindow(size=4)
    assert len(window) == 0 and window.samples().shape == (0, len(TIMINGS))
    for i in range(6):
        window.append(timing(i))
    assert len(window) == 4
    assert sorted(window.samples()[:, TIMINGS.index("total_us")]) == [1_000_002, 1_000_003, 1_000_004, 1_000_005]
    assert sorted(window.samples()[:, TIMINGS.index("compute_us")]) == [200_002, 200_003, 200_004, 200_005]


def test_filling_the_window_allocates_nothing():
    window = LatencyWindow(size=5_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5_000):
            window.append(timing(i))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1_000, f"{grown} bytes for 5,000 answers"  # a deque of tuples took about 150 bytes each


def test_the_stats_snapshot_reports_percentiles_of_the_window():
    stats = Stats()
    for i in range(100):
        stats._latency.append(timing(i * 1000))
    latency = stats.snapshot()["latency"]
    assert latency["total_us"]["p50"] == np.percentile([1_000_000 + 1000 * i for i in range(100)], 50)
    assert latency["queue_us"]["mean"] == np.mean([500_000 + 1000 * i for i in range(100)])
    assert stats.snapshot()["latency_window"] == 100
