"""The benchmarks' served policy: a server that fails to start leaves its log for the reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL_LSTM, write_config

from batchmaker.bench.sweep import ServedPolicy


def test_a_server_that_does_not_start_keeps_its_log_and_the_error_names_it(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    weights = Path(config.models["lstm"].weights)
    weights.unlink()  # the server refuses to start without its weights
    with pytest.raises(SystemExit) as failed, ServedPolicy(config.path, config.server.address, "cellular", "lstm"):
        pytest.fail("the server started without its weights")
    message = str(failed.value)
    assert "did not start" in message and "exited with status" in message
    log = Path(message.rsplit("its log is ", 1)[1])
    assert log.exists() and weights.name in log.read_text()
    log.unlink()
