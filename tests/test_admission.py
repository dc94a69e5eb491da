"""Admission by expected wait: the estimator on an injected clock, the refusals, and the config keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchmaker.common.config import ConfigError, load_config
from batchmaker.common.protocol import DEADLINE_EXCEEDED, OVERLOADED, RequestError
from batchmaker.manager.batching.admission import (
    MAX_SPREAD_S,
    MIN_BUSY_S,
    WINDOW_S,
    Admission,
    ExpectedWait,
    warm_up_capacity,
)

FULL = 64  # the largest batch size of the cell type in these tests


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def saturated(estimator: ExpectedWait, clock: Clock, cells_per_task: int, task_s: float, tasks: int) -> None:
    """One worker running tasks back to back, each submitted well before the previous one completed."""
    for i in range(tasks):
        submitted = clock.now - (5 * task_s if i else 0)  # the first task found the worker idle
        clock.now += task_s
        estimator.measure_task(cells_per_task, FULL, 0, submitted)


def light(estimator: ExpectedWait, clock: Clock, tasks: int) -> None:
    """A 1 ms task of 4 cells every 40 ms: small batches, an idle worker in between."""
    for _ in range(tasks):
        clock.now += 0.039
        submitted = clock.now
        clock.now += 0.001
        estimator.measure_task(4, FULL, 0, submitted)


def test_cold_start_has_no_estimate():
    clock = Clock()
    estimator = ExpectedWait(clock)
    assert estimator.cells_per_second() is None and estimator.wait_s(10_000) is None
    estimator.measure_task(FULL, FULL, 0, clock.now - MIN_BUSY_S / 4)  # too little busy time to go by
    assert estimator.wait_s(10_000) is None


def test_rate_is_cells_per_busy_second_and_wait_is_queued_over_rate():
    clock = Clock()
    estimator = ExpectedWait(clock)
    saturated(estimator, clock, cells_per_task=60, task_s=0.002, tasks=100)  # 30,000 cells/s
    assert estimator.cells_per_second() == pytest.approx(30_000)
    assert estimator.wait_s(6_000) == pytest.approx(0.2)
    assert estimator.wait_s(0) == 0


def test_small_batches_are_no_measure_of_capacity():
    clock = Clock()
    estimator = ExpectedWait(clock)
    light(estimator, clock, tasks=100)  # 4,000 cells per busy second, in batches of 4 out of 64
    assert estimator.wait_s(10_000) is None  # a burst is admitted, not judged by what a quiet server did


def test_capacity_is_kept_through_quiet_times_and_follows_full_batches():
    clock = Clock()
    estimator = ExpectedWait(clock)
    saturated(estimator, clock, cells_per_task=64, task_s=0.002, tasks=1000)  # 32,000 cells/s
    light(estimator, clock, tasks=50)
    clock.now += 10 * WINDOW_S  # then idle
    assert estimator.cells_per_second() == pytest.approx(32_000)  # what it can do, not what it was offered
    saturated(estimator, clock, cells_per_task=64, task_s=0.004, tasks=500)  # slower now: 16,000 cells/s
    assert estimator.cells_per_second() == pytest.approx(16_000, rel=0.01)


def test_a_server_filling_up_is_measured_on_its_first_full_tasks():
    clock = Clock()
    estimator = ExpectedWait(clock)
    light(estimator, clock, tasks=20)  # 0.8 s of small batches: load is arriving
    saturated(estimator, clock, cells_per_task=64, task_s=0.002, tasks=9)  # 18 ms of full tasks: not enough yet
    assert estimator.wait_s(6_400) is None
    saturated(estimator, clock, cells_per_task=64, task_s=0.002, tasks=2)  # the small ones still outnumber them
    assert estimator.cells_per_second() == pytest.approx(32_000) and estimator.wait_s(6_400) == pytest.approx(0.2)


def test_workers_add_up():
    clock = Clock()
    estimator = ExpectedWait(clock)
    for i in range(100):
        submitted = clock.now - (0.01 if i else 0)
        clock.now += 0.001
        estimator.measure_task(60, FULL, "a", submitted)
        estimator.measure_task(60, FULL, "b", submitted)  # the same instant: b ran alongside a
    assert estimator.cells_per_second() == pytest.approx(120_000, rel=0.01)


def test_admission_refuses_beyond_the_limit_and_says_the_estimated_wait():
    clock = Clock()
    admission = Admission(250, ExpectedWait(clock))
    admission.check(10**9, None)  # cold start: admitted whatever is queued
    saturated(admission.estimator, clock, cells_per_task=50, task_s=0.002, tasks=100)  # 25,000 cells/s, 78% full
    admission.check(6_000, None)  # 240 ms
    with pytest.raises(RequestError) as refused:
        admission.check(7_000, None)  # 280 ms
    assert refused.value.code == OVERLOADED
    assert "estimated wait 280 ms" in refused.value.message and "250 ms" in refused.value.message


def test_admission_refuses_a_deadline_the_estimate_cannot_meet():
    clock = Clock()
    admission = Admission(0, ExpectedWait(clock))  # the limit is off; deadlines still count
    saturated(admission.estimator, clock, cells_per_task=50, task_s=0.002, tasks=100)  # 25,000 cells/s
    admission.check(10**6, None)
    admission.check(2_500, deadline_ms=100)  # 100 ms: met exactly
    with pytest.raises(RequestError) as refused:
        admission.check(2_500, deadline_ms=99)
    assert refused.value.code == DEADLINE_EXCEEDED and "estimated wait 100 ms" in refused.value.message
    assert "deadline_ms 99" in refused.value.message


def test_snapshot_reports_rate_and_wait():
    clock = Clock()
    admission = Admission(250, ExpectedWait(clock))
    assert admission.snapshot(100) == {
        "cells_per_s": None, "warm_up_cells_per_s": None, "estimated_wait_ms": None, "max_queue_delay_ms": 250
    }
    saturated(admission.estimator, clock, cells_per_task=50, task_s=0.002, tasks=100)  # 25,000 cells/s
    snapshot = admission.snapshot(2_500)
    assert snapshot["cells_per_s"] == pytest.approx(25_000) and snapshot["estimated_wait_ms"] == pytest.approx(100)


def test_warm_up_timings_give_the_capacity_of_full_tasks():
    assert warm_up_capacity([{"lstm": 0.01}], {"lstm": 64}) == pytest.approx(6_400)
    # Two cell types, an equal share of cells each: 64 cells take 0.01 s of one and 0.03 s of the other.
    two = {"encoder": 0.01, "decoder": 0.03}
    assert warm_up_capacity([two], {"encoder": 64, "decoder": 64}) == pytest.approx(2 * 64 / 0.04)
    assert warm_up_capacity([two, two], {"encoder": 64, "decoder": 64}) == pytest.approx(2 * 2 * 64 / 0.04)


@pytest.mark.parametrize(
    "timed", [None, {}, {"other": 0.01}, {"lstm": 0}, {"lstm": -1.0}, {"lstm": True}, {"lstm": "fast"}, [0.01]]
)
def test_a_missing_or_malformed_warm_up_timing_counts_nothing(timed: object):
    assert warm_up_capacity([timed], {"lstm": 64}) is None
    assert warm_up_capacity([timed, {"lstm": 0.01}], {"lstm": 64}) == pytest.approx(6_400)


def test_the_assumed_capacity_bounds_a_cold_start_until_one_is_measured():
    clock = Clock()
    admission = Admission(250, ExpectedWait(clock))
    admission.estimator.assume(10_000)
    with pytest.raises(RequestError) as refused:  # 3,000 cells queued: 300 ms at 10,000 cells/s
        admission.check(3_000, None)
    assert refused.value.code == OVERLOADED and "estimated wait 300 ms" in refused.value.message
    saturated(admission.estimator, clock, cells_per_task=50, task_s=0.002, tasks=100)  # measured: 25,000 cells/s
    admission.check(3_000, None)  # 120 ms
    assert admission.snapshot(0)["cells_per_s"] == pytest.approx(25_000)
    assert admission.snapshot(0)["warm_up_cells_per_s"] == 10_000


def write(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f'[server]\n{server}\n[models.m]\nbuilder = "a:b"\nweights = "w.pt"\nbatch_sizes = [1]\n')
    return path


def test_config_keys_have_defaults_and_are_checked(tmp_path: Path):
    server = load_config(write(tmp_path, "")).server
    assert (server.max_queue_delay_ms, server.unreachable_client_ms) == (250, 30000)
    server = load_config(write(tmp_path, "max_queue_delay_ms = 0\nunreachable_client_ms = 100")).server
    assert (server.max_queue_delay_ms, server.unreachable_client_ms) == (0, 100)
    with pytest.raises(ConfigError, match="max_queue_delay_ms must be an integer >= 0"):
        load_config(write(tmp_path, "max_queue_delay_ms = -1"))
    with pytest.raises(ConfigError, match="unreachable_client_ms must be an integer >= 100"):
        load_config(write(tmp_path, "unreachable_client_ms = 50"))
    with pytest.raises(ConfigError, match="max_queue_delay_ms must be an integer"):
        load_config(write(tmp_path, 'max_queue_delay_ms = "250"'))


def traceback_frames(error: BaseException) -> int:
    frames, tb = 0, error.__traceback__
    while tb is not None:
        frames, tb = frames + 1, tb.tb_next
    return frames


def refusal(admission: Admission, queued_cells: int, deadline_ms: int | None = None) -> RequestError:
    with pytest.raises(RequestError) as refused:
        admission.check(queued_cells, deadline_ms)
    return refused.value


def test_a_run_of_refusals_quoting_the_same_wait_shares_one_error_raised_afresh_each_time():
    clock = Clock()
    admission = Admission(250, ExpectedWait(clock))
    admission.estimator.assume(10_000)
    first = refusal(admission, 3_000)  # 300 ms
    frames = traceback_frames(first)
    for _ in range(100):
        again = refusal(admission, 3_000)
        assert again is first and traceback_frames(again) == frames  # not a frame more per raise
    other = refusal(admission, 4_000)
    assert other is not first and "estimated wait 400 ms" in other.message and "4000 cells queued" in other.message
    late = refusal(admission, 4_000, deadline_ms=100)
    assert late.code == DEADLINE_EXCEEDED and "deadline_ms 100" in late.message
    assert refusal(admission, 4_000, deadline_ms=50).message.endswith(
        "deadline_ms 50; raise the deadline or retry later"
    )
    assert refusal(admission, 4_000) is not other  # only the last refusal is kept
    assert "estimated wait 400 ms" in refusal(admission, 4_000).message


def test_a_refused_burst_is_told_to_return_spread_at_the_rate_the_server_admits_it():
    clock = Clock()
    admission = Admission(250, ExpectedWait(clock))
    saturated(admission.estimator, clock, cells_per_task=50, task_s=0.002, tasks=100)  # 25,000 cells/s
    assert admission.retry_after_ms(6_000, 3) == []  # 240 ms: under the bound, nothing is refused for the wait
    admission.admitted(4, 200)  # 50 cells a request: 2 ms each at capacity
    # 300 ms queued: the first may come back once 50 ms have run, the next 2 ms after it, and so on.
    assert admission.retry_after_ms(7_500, 4) == [50, 52, 54, 56]
    # A burst refused 1 ms later queues behind the four quoted before it.
    clock.now += 0.001
    assert admission.retry_after_ms(7_500, 2) == [57, 59]
    # Once those return times have passed, a new refusal is quoted from the queue alone.
    clock.now += 1.0
    assert admission.retry_after_ms(7_500, 1) == [50]


def test_earlier_quotes_delay_a_new_refusal_by_at_most_the_spread_bound():
    clock = Clock()
    admission = Admission(250, ExpectedWait(clock))
    saturated(admission.estimator, clock, cells_per_task=50, task_s=0.002, tasks=100)  # 25,000 cells/s
    admission.admitted(1, 50)
    quotes = admission.retry_after_ms(7_500, 2_000)  # 4 s of refused requests, quoted in turn
    assert quotes[0] == 50 and quotes[-1] == 50 + 2 * 1_999
    assert admission.retry_after_ms(7_500, 1) == [50 + MAX_SPREAD_S * 1e3]


def test_cells_per_request_is_a_running_mean_of_admitted_bursts():
    clock = Clock()
    admission = Admission(250, ExpectedWait(clock))
    admission.estimator.assume(10_000)
    admission.admitted(0, 0)  # an empty burst says nothing
    assert admission.retry_after_ms(3_000, 2) == [50, 50]  # sizes unknown yet: the same quote
    admission.admitted(1, 100)  # 10 ms at 10,000 cells/s
    clock.now += 1
    assert admission.retry_after_ms(3_000, 2) == [50, 60]
    admission.admitted(1, 200)  # the mean moves a tenth of the way: 110 cells
    clock.now += 1
    assert admission.retry_after_ms(3_000, 2) == [50, 61]
