"""`bench stages`' rows for the running batch in a worker: every request answered, every stage timed."""

from __future__ import annotations

from batchmaker.bench import stages_running


def test_every_request_of_a_workload_is_answered_and_every_stage_timed():
    row = stages_running.measure("LSTM H=8", "lstm", 8, 512, "wmt", 300)  # more than HELD: some join as others leave
    assert row["requests"] == 300 and row["steps"] > 0
    assert set(row["seconds"]) == set(stages_running.STAGES)
    assert all(seconds > 0 for seconds in row["seconds"].values())
    assert 0 < row["kernel_busy"] < 1
    lines = stages_running.table([row])
    assert lines[1].startswith("LSTM H=8: 300 requests") and len(lines) == 4 + len(stages_running.STAGES)
