"""`batchmaker serve` started as a user starts it (a subprocess, from a folder of their own, without
PYTHONPATH): a builder beside the config or in the working directory imports in every process,
random weights are announced, the metrics option works, and a cell of the wrong shape is named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import torch
from conftest import ROOT, free_port
from test_custom_model import ELMAN
from test_startup_errors import user_env

from batchmaker.clients import Client
from batchmaker.manager.commands.launcher import stop_server, wait_until_ready

BATCHMAKER = str(Path(sys.executable).parent / "batchmaker")
WRONG_SHAPE = '''
from torch import nn
from mycell import ElmanModel


class TooWide(nn.Module):
    def forward(self, tokens, h):
        return h.new_zeros(h.shape[0], h.shape[1] + 1)


class Wrong(ElmanModel):
    def make_cells(self, state):
        return {self.step_key: TooWide()}


def build(config):
    return Wrong(config)
'''


def user_config(folder: Path, builder: str) -> tuple[Path, str]:
    address = f"tcp://127.0.0.1:{free_port()}"
    path = folder / "mine.toml"
    path.write_text(
        f'[server]\naddress = "{address}"\ncpu_workers = 2\n' + ELMAN.replace("examples.elman:build", builder)
    )
    return path, address


def batchmaker(*args: str, cwd: Path, log: Path) -> subprocess.Popen:
    """The `batchmaker` command as installed (unlike `python -m`, it does not put the working directory on sys.path)."""
    with log.open("w") as output:  # the child has its own copy of the descriptor
        return subprocess.Popen([BATCHMAKER, *args], cwd=cwd, env=user_env(), stdout=output, stderr=subprocess.STDOUT)


def run_to_end(*args: str, cwd: Path, log: Path) -> int:
    return batchmaker(*args, cwd=cwd, log=log).wait(timeout=300)


def test_a_builder_beside_the_config_imports_in_every_process_and_random_weights_are_announced(tmp_path: Path):
    shutil.copy(ROOT / "examples" / "elman.py", tmp_path / "mycell.py")
    config, address = user_config(tmp_path, "mycell:build")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert run_to_end("init-weights", str(config), cwd=elsewhere, log=tmp_path / "init.log") == 0
    metrics_port = free_port()
    log = tmp_path / "serve.log"
    server = batchmaker("serve", str(config), "--metrics-address", f"127.0.0.1:{metrics_port}", cwd=elsewhere, log=log)
    try:
        wait_until_ready(address, server, timeout=120)
        with Client(address, timeout=30) as client:
            assert client.models()["models"]["elman"]["random_weights"] is True
            assert client.infer("elman", {"tokens": [1, 2, 3]}).outputs["h"].shape == (16,)
            assert_documented(client.stats())
            # a tensor, as a user has it
            served = client.infer("elman", {"tokens": torch.tensor([1, 2, 3])}).outputs["h"]
        printed = subprocess.run(
            [BATCHMAKER, "infer", "--address", address, "--model", "elman", "--tokens", "1 2 3", "--json"],
            capture_output=True, text=True, timeout=120, check=True,
        )
        assert json.loads(printed.stdout)["outputs"]["h"] == served.tolist()
        other_vocabulary = subprocess.run(
            [BATCHMAKER, "infer", "--address", address, "--model", "elman",
             "--text", "the committee approved the report"],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert "with the vocabulary" in other_vocabulary.stderr and "8192 words" in other_vocabulary.stderr
        assert "--vocab FILE" in other_vocabulary.stderr, other_vocabulary.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as reply:
            assert b"batchmaker_" in reply.read()
    finally:
        assert stop_server(server) == []
    text = log.read_text()
    assert "model 'elman' SERVES RANDOM WEIGHTS" in text and "cannot import" not in text, text


def test_a_builder_in_the_working_directory_imports(tmp_path: Path):
    config, address = user_config(tmp_path, "examples.elman:build")
    assert run_to_end("init-weights", str(config), cwd=ROOT, log=tmp_path / "init.log") == 0
    server = batchmaker("serve", str(config), cwd=ROOT, log=tmp_path / "serve.log")
    try:
        wait_until_ready(address, server, timeout=120)
        with Client(address, timeout=30) as client:
            reply = client.infer("elman", {"tokens": [4, 5]})
        assert np.isfinite(reply.outputs["h"]).all()
    finally:
        assert stop_server(server) == []


def test_a_cell_returning_the_wrong_shape_fails_warm_up_naming_its_cell_type(tmp_path: Path):
    shutil.copy(ROOT / "examples" / "elman.py", tmp_path / "mycell.py")
    (tmp_path / "wrong.py").write_text(WRONG_SHAPE)
    config, _ = user_config(tmp_path, "wrong:build")
    assert run_to_end("init-weights", str(config), cwd=tmp_path, log=tmp_path / "init.log") == 0
    log = tmp_path / "serve.log"
    assert run_to_end("serve", str(config), cwd=tmp_path, log=log) == 1
    text = log.read_text()
    assert "cell type 'elman/step' failed its warm-up run at batch size 1" in text, text
    assert "return (float32[batch, 16])" in text, text
    assert "leaked shared_memory" not in text and "Traceback" not in text, text



def assert_documented(stats: dict) -> None:
    """Every field of a real `stats` reply, and of its workers, is explained in docs/protocol.md."""
    doc = (ROOT / "docs" / "protocol.md").read_text()
    stats_table = doc[doc.index("The `stats` reply") :]
    fields = [*stats, *next(iter(stats["workers"].values()))]
    undocumented = [field for field in fields if field not in ("id", "ok") and f"`{field}`" not in stats_table]
    assert not undocumented, f"docs/protocol.md does not explain {undocumented}"
