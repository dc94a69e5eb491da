"""scripts/demo.py: it serves on the address it is given, checks its answers, keeps the server's log, and prints
the results page's numbers for the same model beside its own, saying where they came from."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, free_port

from batchmaker.bench import yardstick
from batchmaker.bench.run import machine
from batchmaker.common.config import load_config
from batchmaker.common.models import init_missing_weights

REFERENCE = ROOT / "docs" / "benchmarks"


def test_the_demo_serves_on_its_address_and_keeps_its_log(tmp_path: Path):
    config = tmp_path / "default.toml"
    text = (ROOT / "configs" / "default.toml").read_text()
    config.write_text(text.replace('weights = "../weights/lstm-h256-random.pt"', f'weights = "{tmp_path}/lstm.pt"'))
    init_missing_weights(load_config(config))
    address = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--config", str(config), "--address", address,
         "--duration", "2", "--rate", "20", "--verify", "10"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"starting the server on {address}" in done.stdout
    assert re.search(r"verified +10 replies against the reference model", done.stdout)
    reference = json.loads((REFERENCE / "lstm.json").read_text())
    assert (
        f"reference       docs/benchmarks/lstm.json (commit {reference['commit']}): the cellular policy, "
        "the same model on the same sentences"
    ) in done.stdout
    peak = reference["summary"]["cellular"]["peak_throughput"]
    assert re.search(
        rf"at \d+ requests/s offered: latency p50 [\d.]+ +p90 [\d.]+ +p99 [\d.]+ ms; peak {peak:.0f}", done.stdout
    )
    assert "a lone request on an idle server: p50" in done.stdout
    same = all(machine()[key] == reference["machine"][key] for key in yardstick.SAME_MACHINE)
    assert ("same machine: yes" if same else "same machine: NO") in done.stdout
    log = Path(re.search(r"server log +(\S+)", done.stdout).group(1))
    try:
        assert "serving lstm" in log.read_text()  # kept, as the demo says
    finally:
        log.unlink()


def test_the_reference_says_when_it_is_missing_from_another_model_or_from_another_machine(tmp_path: Path):
    params = load_config(ROOT / "configs" / "default.toml").models["lstm"].params
    (missing,) = yardstick.lines(tmp_path, 200.0, params)
    assert missing.startswith("reference       none: ") and f"{tmp_path / 'lstm.json'} is missing" in missing

    (tmp_path / "lstm.json").write_text(json.dumps({"preset": "lstm", "policies": {"padded": {}}}))
    (unusable,) = yardstick.lines(tmp_path, 200.0, params)
    assert (
        f"reference       none: {tmp_path / 'lstm.json'} is not a lstm preset's JSON (KeyError: 'cellular')" == unusable
    )

    result = json.loads((REFERENCE / "lstm.json").read_text())
    result["machine"] = dict(machine(), cores=machine()["cores"] + 1)
    (tmp_path / "lstm.json").write_text(json.dumps(result))
    found = "\n".join(yardstick.lines(tmp_path, 200.0, dict(params, hidden_size=64)))
    assert "ANOTHER model (hidden_size 64 here, 256 there)" in found
    assert f"same machine: NO (cores {machine()['cores']} here, {machine()['cores'] + 1} there)" in found
    assert "a lone request on an idle server" not in found  # no idle.json there
