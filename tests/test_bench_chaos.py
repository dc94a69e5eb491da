"""The chaos benchmark's report: requests tallied per fault window, replies a server sent twice, the
managers' memory, and the goals that make a run fail."""

from __future__ import annotations

import collections

from batchmaker.bench.chaos_report import LOST, OK, Request, problems, replies_beyond_sends, rss_growth, table, tally

FAULTS = ["quiet", "kill -9 worker", "SIGTERM drain"]


def requests() -> list[Request]:
    return [
        Request(0, OK),
        Request(0, OK),
        Request(1, OK),
        Request(1, "UNAVAILABLE"),
        Request(1, "INTERNAL"),
        Request(1, LOST),
        Request(2, OK, answered_twice=1),
        Request(2, OK, wrong=True),
        Request(2, "OVERLOADED"),
    ]


def test_tally_counts_each_window_apart() -> None:
    quiet, killed, drained = tally(FAULTS, requests())
    assert quiet == {"fault": "quiet", "requests": 2, "ok": 2, "errors": {}, "non_retryable": 0, "lost": 0,
                     "answered_twice": 0, "wrong": 0}
    assert killed["ok"] == 1 and killed["lost"] == 1
    assert killed["errors"] == {"INTERNAL": 1, "UNAVAILABLE": 1}
    assert killed["non_retryable"] == 1  # INTERNAL; UNAVAILABLE may be sent elsewhere
    assert (drained["answered_twice"], drained["wrong"], drained["non_retryable"]) == (1, 1, 0)


def test_replies_beyond_sends_counts_one_server_answering_twice() -> None:
    resent = ["tcp://a:1", "tcp://b:1"]  # sent to a, then (a set aside) to b: both may answer
    assert replies_beyond_sends(resent, collections.Counter({"tcp://a:1": 1, "tcp://b:1": 1})) == 0
    assert replies_beyond_sends(["tcp://a:1"], collections.Counter({"tcp://a:1": 2})) == 1
    assert replies_beyond_sends(["tcp://a:1"], collections.Counter()) == 0


def test_rss_growth_compares_only_managers_alive_at_both_samples() -> None:
    growth = rss_growth(
        {"a pid 1": 100 * 2**20, "b pid 2": 50 * 2**20}, {"a pid 1": 103 * 2**20, "b pid 9": 60 * 2**20}
    )
    assert list(growth) == ["a pid 1"]
    assert abs(growth["a pid 1"]["growth"] - 0.03) < 1e-12 and growth["a pid 1"]["end_mib"] == 103


def result(rows: list[dict], rss: dict, side: dict | None = None) -> dict:
    return {"faults": rows, "manager_rss": rss, "side_clients": side or {}}


def test_problems_name_every_missed_goal() -> None:
    rows = tally(FAULTS, requests())
    rss = rss_growth({"a pid 1": 100, "b pid 2": 100}, {"a pid 1": 104, "b pid 2": 106})
    side = {"slow reader": {"sent": 40, "answered": 39, "expected": 40}}
    found = problems(result(rows, rss, side))
    assert found == [
        "kill -9 worker: 1 lost, 1 non retryable",
        "SIGTERM drain: 1 answered twice, 1 wrong",
        "slow reader: 39 of 40 requests answered",
        "manager b pid 2: resident memory grew 6.0%",
    ]


def test_a_clean_run_has_no_problems_and_a_table_row_per_fault() -> None:
    clean = [Request(0, OK), Request(1, OK), Request(1, "OVERLOADED"), Request(2, "UNAVAILABLE")]
    rows = tally(FAULTS, clean)
    rss = rss_growth({"a pid 1": 100}, {"a pid 1": 101})
    side = {"disconnecting client": {"sent": 40, "answered": 1, "expected": 1}}
    assert problems(result(rows, rss, side)) == []
    text = table(result(rows, rss, side))
    assert "| kill -9 worker |  | 2 | 1 | OVERLOADED 1 | 0 | 0 | 0 |" in text
    assert "disconnecting client: sent 40, answered 1 (expected 1)" in text and "(+1.0%)" in text


def test_a_run_where_no_manager_lived_throughout_is_a_problem() -> None:
    assert problems(result(tally(FAULTS, [Request(0, OK)]), {})) == [
        "no manager lived through the run: its memory could not be compared"
    ]
