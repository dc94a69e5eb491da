"""A device fault ends the worker process with its own status and one log line; the supervisor restarts
it and the manager replays its requests. On a GPU (`cuda`-marked): a real device-side assert."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL_LSTM, write_config

from batchmaker.worker import main as worker_main
from batchmaker.worker.backend import DeviceFault

ROOT = Path(__file__).resolve().parents[1]


def test_a_worker_whose_device_fails_exits_with_its_own_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    config = write_config(tmp_path, SMALL_LSTM)

    def serve(worker) -> None:
        raise DeviceFault("cuda:0 failed: CUDA error: device-side assert triggered")

    monkeypatch.setattr(worker_main.Worker, "run", serve)
    monkeypatch.setattr(worker_main, "setup_logging", lambda role: None)  # keep pytest's log capture
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)  # and this process's settings
    monkeypatch.setattr(worker_main.signal, "signal", lambda signum, handler: None)
    with caplog.at_level("ERROR"):
        status = worker_main.main(["--config", str(config.path), "--manager", "tcp://127.0.0.1:9"])
    assert status == worker_main.EXIT_DEVICE_FAULT
    assert "device-side assert triggered; exiting, to be restarted" in caplog.text


INJECT_A_DEVICE_ASSERT = """
import sys
import torch
sys.path.insert(0, "tests")
from test_worker import lstm_step_task
from batchmaker.common.config import load_config
from batchmaker.common.slots import ZERO_SLOT
from batchmaker.worker.backend import DeviceFault
from batchmaker.worker.main import load_cells
from batchmaker.worker.startup import make_backend

config = load_config(sys.argv[1])
specs, cells, kinds = load_cells(config, "cuda:0")
backend = make_backend("cuda:0", specs, cells, kinds, 64, 64)
backend.warm_up()
with backend._calls.on_stream():  # an index the host never checked: the kernel asserts
    torch.zeros(4, device="cuda:0")[torch.tensor([99], device="cuda:0")]
try:
    for task_id in range(1, 100):
        backend.issue(lstm_step_task(task_id, kinds, [2], [ZERO_SLOT], [10], None))
        backend.wait_for_signal(task_id - 1, 1.0)
except DeviceFault as exc:
    print("fault:", exc)
"""


@pytest.mark.cuda
def test_a_device_side_assert_raises_device_fault(tmp_path: Path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    config = write_config(tmp_path, SMALL_LSTM)
    process = subprocess.run(
        [sys.executable, "-c", INJECT_A_DEVICE_ASSERT, str(config.path)],
        capture_output=True, text=True, check=False, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert "fault: cuda:0 failed" in process.stdout, process.stderr
