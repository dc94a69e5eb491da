"""How long a worker's kernels are busy: the CPU stream times its cells' forward calls (worker.batched_task
KernelClock), every notice and heartbeat carries the total (common.task), the manager's `stats` reports
it per worker, and a benchmark's load point turns it into the share of its span the kernels were busy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from conftest import SMALL_LSTM, write_config
from test_bench import counts, replies
from test_cuda_backend import fake_backend, lstm_task, poller_of
from test_cuda_fake import all_cells
from test_lanes_worker import SEQUENCES, lane_task
from test_worker import cells, lstm_step_task, make_backend, notices_until, polled, wait_signal  # noqa: F401 (fixtures)
from test_worker_pool import Pool, pool  # noqa: F401 (a fixture)

from batchmaker.bench.sweep import point
from batchmaker.common.notice import CompletionNotice, decode_notice, encode_notice
from batchmaker.common.slots import ZERO_SLOT
from batchmaker.common.task import decode_task, encode_task
from batchmaker.worker.notices import InProgressFIFO


def test_a_notice_carries_the_kernel_busy_total_or_nil():
    timed = CompletionNotice(3, [5], {}, 1, key=b"k", busy_us=[10], kernel_busy_us=1_234_567)
    assert decode_notice(encode_notice(timed)).kernel_busy_us == 1_234_567
    untimed = CompletionNotice(3, [], {}, 1, key=b"k", kernel_busy_us=None)
    assert decode_notice(encode_notice(untimed)).kernel_busy_us is None
    assert decode_notice(encode_notice(CompletionNotice(3, [], {}, 1))).kernel_busy_us == 0
    for bad in ("x", 1.5, True, -1, [3]):
        with pytest.raises(ValueError, match="kernel busy time"):
            decode_notice(msgpack.packb([3, b"k", [5], {}, 1, [], [10], bad]))
    with pytest.raises(ValueError, match="eight fields"):
        decode_notice(msgpack.packb([3, b"k", [5], {}, 1, [], [10]]))


def test_the_cpu_stream_times_the_cells_of_tasks_of_waves_and_lane_tasks(cells: tuple[Any, ...]):  # noqa: F811
    """Each kind of task adds to the total, which never exceeds the wall time since before it was issued."""
    kinds = cells[2]
    backend = make_backend("cpu", cells)
    try:
        assert backend.kernel_busy_us() == 0  # nothing has run on the stream yet
        began = time.perf_counter()
        waves = lstm_step_task(1, kinds, [5, 9], [ZERO_SLOT, ZERO_SLOT], [10, 12], None)
        backend.issue(decode_task(encode_task(waves)))
        wait_signal(backend, 1)
        after_waves = backend.kernel_busy_us()
        assert 0 < after_waves <= (time.perf_counter() - began) * 1e6
        lanes = lane_task(2, kinds, SEQUENCES, [ZERO_SLOT] * len(SEQUENCES), [20, 22, 24, 26])
        backend.issue(decode_task(encode_task(lanes)))
        wait_signal(backend, 2)
        after_lanes = backend.kernel_busy_us()
        assert after_waves < after_lanes <= (time.perf_counter() - began) * 1e6
        assert [backend.finish(1), backend.finish(2)] == [None, None]
    finally:
        backend.close()


def test_every_notice_and_heartbeat_carries_the_total_so_far(
    cells: tuple[Any, ...], polled: tuple[Any, ...]  # noqa: F811
):
    kinds = cells[2]
    backend, fifo, receiver = polled
    for task_id in range(1, 6):
        fifo.push(task_id, [])
        backend.issue(decode_task(encode_task(lstm_step_task(task_id, kinds, [2], [ZERO_SLOT], [10], None))))
    totals = [notice.kernel_busy_us for notice in notices_until(receiver, 5) if notice.task_ids]
    final = backend.kernel_busy_us()
    assert 0 < totals[0] and totals == sorted(totals) and totals[-1] == final
    heartbeat = None  # one sent before the last task ended may still be on its way: the next one says `final`
    while heartbeat is None or heartbeat.task_ids or heartbeat.kernel_busy_us < final:
        assert receiver.poll(10_000), "no heartbeat"
        heartbeat = decode_notice(receiver.recv())
        assert heartbeat.kernel_busy_us <= final
    assert heartbeat.kernel_busy_us == final


def test_a_gpu_worker_does_not_time_its_asynchronous_kernels(tmp_path: Path):
    layout = all_cells(write_config(tmp_path, SMALL_LSTM).path)
    fifo = InProgressFIFO()
    with fake_backend(layout) as (backend, _, _):
        assert backend.kernel_busy_us() is None
        backend.warm_up()
        with poller_of(backend, fifo, tmp_path) as (_, receiver):
            fifo.push(1, [])
            backend.issue(lstm_task(1, layout, backend))
            notices: list[CompletionNotice] = []
            while not any(notice.task_ids for notice in notices):
                assert receiver.poll(60_000), "no notice"
                notices.append(decode_notice(receiver.recv()))
    assert [notice.kernel_busy_us for notice in notices] == [None] * len(notices)


def test_the_managers_stats_report_the_largest_total_a_worker_sent(pool: Pool):  # noqa: F811
    """A CPU worker's heartbeats and notices travel on two sockets: an older total arriving late is ignored."""
    _, reply = pool.register("elsewhere")
    worker = pool.handle(reply)
    assert worker.stats()["kernel_busy_s"] is None  # nothing heard yet
    pool.notices(CompletionNotice(worker.worker_id, [], {}, 0, kernel_busy_us=2_500_000))
    assert worker.stats()["kernel_busy_s"] == 2.5
    pool.notices(CompletionNotice(worker.worker_id, [], {}, 0, kernel_busy_us=1_000_000))
    assert worker.stats()["kernel_busy_s"] == 2.5
    pool.notices(CompletionNotice(worker.worker_id, [], {}, 0, kernel_busy_us=None))
    assert worker.stats()["kernel_busy_s"] is None


def test_a_point_reports_the_share_of_its_span_the_kernels_were_busy():
    run = replies(100, 10, 0.05)
    span = 9.99  # from the first send plus the quickest answer (0.05 s) to the last answer (10.04 s)
    before = counts(0, 0, 0, {"1": {"kernel_busy_s": 3.0}, "2": {"kernel_busy_s": 1.0}})
    after = counts(1, 1, 1, {"1": {"kernel_busy_s": 7.995}, "2": {"kernel_busy_s": 3.997}})
    assert point(*run, 100, before, after)["kernel_busy"] == pytest.approx((4.995 + 2.997) / span)
    joined = counts(1, 1, 1, {**after["workers"], "3": {"kernel_busy_s": 1.0}})  # counted from its start
    assert point(*run, 100, before, joined)["kernel_busy"] == pytest.approx((4.995 + 2.997 + 1.0) / span)
    untimed = counts(1, 1, 1, {**after["workers"], "3": {"kernel_busy_s": None}})
    assert point(*run, 100, before, untimed)["kernel_busy"] is None
    assert point(*run, 100, counts(0, 0, 0), counts(1, 1, 1))["kernel_busy"] is None  # no worker
    assert point(*replies(100, 10, 0.05, lost=1000), 100, before, after)["kernel_busy"] is None  # none answered
