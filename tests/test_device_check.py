"""scripts/device-check: the stages that need no GPU pass here, a failing or hung stage is reported as such,
and a CUDA worker turns off the allocator setting that would keep peers from mapping its arenas."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from batchmaker.worker.cuda_runtime import arenas_shareable, expandable_segments

sys.path.insert(0, str(ROOT / "scripts"))
from device_check import run_stage


def test_a_cuda_worker_turns_expandable_segments_off_and_keeps_the_other_settings():
    environ = {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:True",
        "PYTORCH_ALLOC_CONF": "x:1",
    }
    assert expandable_segments(environ["PYTORCH_CUDA_ALLOC_CONF"])
    arenas_shareable(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_ALLOC_CONF": "x:1"}
    assert not expandable_segments("expandable_segments:False")


def test_without_a_gpu_the_environment_stage_fails_and_says_why(tmp_path: Path):
    with open(tmp_path / "log", "w") as log:
        report = run_stage("environment", tmp_path, log, 120, [])
    if report["results"].get("gpus"):
        pytest.skip("this machine has a GPU")
    assert not report["ok"] and "no CUDA device visible" in report["problems"][0]


def test_a_stage_that_outlives_its_timeout_fails_with_the_reason(tmp_path: Path):
    with open(tmp_path / "log", "w") as log:
        report = run_stage("served", tmp_path, log, 1, ["--cpu", "--quick"])
    assert not report["ok"] and report["problems"] == ["served timed out after 1 s (see device-check.log)"]


@pytest.mark.slow
def test_every_stage_that_needs_no_gpu_passes_on_cpu_workers(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--cpu", "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads((tmp_path / "device-check.json").read_text())
    assert report["passed"] and report["cpu"]
    stages = report["stages"]
    assert stages["counter"]["results"]["tasks"] == 1000
    assert stages["served"]["results"]["graphs off"]["rows read from peers"] > 0
    assert stages["throughput"]["results"]["H=256 served"]["cells/s"] > 0
    assert "== served" in (tmp_path / "device-check.log").read_text()
