"""The servers preset's report, offline: cores by role, the client's CPU per request, a fault's timeline,
what counts as a failed run, and the table. (`./scripts/bench servers --quick` runs it with real servers.)"""

from __future__ import annotations

import numpy as np
import pytest

from batchmaker.bench.client_load import OpenLoop, Saturated, Usage
from batchmaker.bench.servers_report import client_cost, fault, problems, table, throughput

A, B, C = "tcp://127.0.0.2:1", "tcp://127.0.0.3:1", "tcp://127.0.0.4:1"
CHECK = {"checked": 5, "max_abs_error": 1e-7, "wrong": [], "ok": True}


def test_throughput_splits_the_cores_by_role_and_leaves_the_rest_to_other_work():
    before = Usage(at=100.0, client=1.0, servers={"manager": 2.0, "worker": 3.0}, machine=50.0, steal=1.0)
    servers = {"supervisor": 0.1, "manager": 10.0, "worker": 8.0}
    after = Usage(at=110.0, client=4.0, servers=servers, machine=70.0, steal=2.0)
    row = throughput(2, Saturated(20_000, before, after, {"p50": 5.0, "p90": 8.0, "p99": 9.0}, {}))
    assert row["requests_per_s"] == 2000
    assert row["cores"]["client"] == pytest.approx(0.3) and row["cores"]["manager"] == pytest.approx(0.8)
    assert row["cores"]["supervisor"] == pytest.approx(0.01) and row["cores"]["worker"] == pytest.approx(0.5)
    assert row["cores"]["other"] == pytest.approx((20 - 3 - 0.1 - 8 - 5) / 10)  # the machine's busy time not ours
    assert row["cores"]["steal"] == pytest.approx(0.1)
    assert row["cpu_us_per_request"]["client"] == pytest.approx(150)


def test_client_cost_is_cpu_per_request_sent_and_latency_counts_from_the_due_time():
    due = np.arange(100) / 100
    received = due + 0.004
    received[-1] = np.nan  # never answered: no latency, but its share of the CPU still counts
    row = client_cost("raw", 0.02, due, received, failed=1)
    assert row["cpu_us_per_request"] == pytest.approx(200)
    assert row["latency_ms"]["p99"] == pytest.approx(4) and row["failed"] == 1


def killed_run() -> OpenLoop:
    """200 requests, one every 10 ms over A, B, C in turn (B and C once A is set aside), each answered 20 ms after
    its due time. A is killed at 1.0 s and set aside at 1.06 s; the requests A held then (sent from 0.95 s on)
    are sent again to B at 1.06 s and answered at 1.1 s. One of them got a late second reply."""
    due = np.arange(200) / 100
    sends = [[(float(t), (A, B, C)[i % 3] if t < 1.06 else (B, C)[i % 2])] for i, t in enumerate(due)]
    received = due + 0.02
    answers = [1] * 200
    for i, t in enumerate(due):
        if sends[i][0][1] == A and t >= 0.95:
            sends[i].append((1.06, B))
            received[i] = 1.1
    answers[96] = 2
    run = OpenLoop(due, due.copy(), received, [None] * 200, [None] * 200, resent=4, fault_at=1.0, manager_gone=1.03)
    run.sends, run.answers = sends, answers
    run.set_aside = [(1.06, A, "its connection closed")]
    return run


def test_a_kill_is_timed_from_the_signal():
    row = fault("kill -9", A, 3, killed_run(), CHECK)
    assert row["manager_gone_after_ms"] == pytest.approx(30)
    assert row["set_aside_after_ms"] == pytest.approx(60) and row["set_aside_because"] == "its connection closed"
    assert row["last_sent_to_it_after_ms"] == pytest.approx(50)  # request 105, at 1.05 s, was A's last
    assert row["sent_to_it_after_signal"] == 2  # 102 and 105
    assert row["resent"] == 4 and row["resent_requests"] == 4  # requests 96, 99, 102, 105
    assert row["last_resent_answered_after_ms"] == pytest.approx(100)
    assert row["answered"] == 200 and row["failed"] == {} and row["duplicate_replies_dropped"] == 1
    assert row["latency_ms_before"]["p99"] == pytest.approx(20)  # answered before the signal
    # 96: 0.96 to 1.1 s
    assert row["latency_ms_after"]["p99"] > 100 and row["max_latency_ms_after"] == pytest.approx(140)
    assert row["refused_while_draining"] == 0 and row["servers"] == 3


def test_a_drain_counts_the_refusals_of_its_server_only():
    run = killed_run()
    run.refusals = [(1.01, A), (1.02, A), (1.5, B)]
    run.set_aside = [(0.5, A, "an earlier probe"), (1.4, A, "its connection closed")]
    row = fault("SIGTERM (drain)", A, 3, run, CHECK)
    assert row["refused_while_draining"] == 2
    assert row["set_aside_after_ms"] == pytest.approx(400)  # the first time after the signal


def result(faults: list[dict]) -> dict:
    usage = Usage(at=0.0, client=0.0, servers={}, machine=0.0, steal=0.0)
    later = Usage(at=10.0, client=2.0, servers={"manager": 5.0, "worker": 4.0}, machine=12.0, steal=0.0)
    due = np.arange(10) / 10
    return {
        "describe": "abc1234", "workload": "LSTM", "machine": {"cores": 2}, "load_average": [1.5, 1.0, 1.0],
        "window": 128, "steady_rps": 500.0,
        "throughput": [throughput(1, Saturated(15_000, usage, later, {"p50": 60.0, "p90": 90.0, "p99": 120.0}, {}))],
        "client_cost": [client_cost("AsyncClient, 1 address", 0.002, due, due + 0.01, 0)],
        "faults": faults,
    }


def test_problems_are_unanswered_requests_and_wrong_answers():
    good = fault("kill -9", A, 3, killed_run(), CHECK)
    assert problems(result([good])) == []
    run = killed_run()
    run.errors[3] = "TIMEOUT"
    wrong = {**CHECK, "ok": False, "wrong": ["tokens is [1], expected [2]"]}
    found = problems(result([fault("kill -9", A, 3, run, wrong)]))
    assert found == ["kill -9: 1 requests not answered {'TIMEOUT': 1}",
                     "kill -9: answers differ from the reference: tokens is [1], expected [2]"]


def test_the_table_has_a_row_per_measurement():
    text = table(result([fault("kill -9", A, 3, killed_run(), CHECK)]))
    assert "servers at abc1234: LSTM; 2 cores, load average 1.5 at the start" in text
    assert "| 1 | 1,500 | 60.0 | 120.0 | 0.20 | 0.00 | 0.50 | 0.40 | 0.10 | 0.00 |" in text
    assert "| AsyncClient, 1 address | 200 | 10.0 | 10.0 | 0 |" in text
    assert "| kill -9 | 3 | 30 | 60 | 50 | 2 | 4 | 100 | 0 | 200/200 | 1 | 5 ok | 20.0 |" in text
