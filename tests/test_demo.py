"""scripts/demo.py: it serves on the address it is given, checks its answers, and keeps the server's log."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, free_port

from batchmaker.common.config import load_config
from batchmaker.common.models import init_missing_weights


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
    log = Path(re.search(r"server log +(\S+)", done.stdout).group(1))
    try:
        assert "serving lstm" in log.read_text()  # kept, as the demo says
    finally:
        log.unlink()
