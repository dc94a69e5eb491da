"""The batchmaker-client distribution: installed alone into a fresh virtualenv, it talks to a server without torch;
and both distributions install one import package, batchmaker, and nothing else at the top of site-packages.

Slow-ish (it builds virtualenvs and installs pyzmq, msgpack and numpy from the
package index), so it is marked `slow`; it stays in the default run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, RunningServer

from batchmaker.clients.text import DEFAULT_VOCAB, Vocabulary
from batchmaker.common.models import build_model

pytestmark = pytest.mark.slow

CHECK = """
import importlib.util, json, sys
import batchmaker, batchmaker.clients.cli, batchmaker.clients.loadgen
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or \
m.startswith(("batchmaker.manager", "batchmaker.worker")))
with batchmaker.Client(sys.argv[1], timeout=60) as client:
    reply = client.infer("lstm", {"tokens": [5, 17, 342, 9]})
print(json.dumps({
    "loaded": loaded,
    "torch_installed": importlib.util.find_spec("torch") is not None,
    "common": sorted(m for m in sys.modules if m.startswith("batchmaker.common")),
    "clients_file": batchmaker.clients.__file__,
    "h": reply.outputs["h"].tolist(),
}))
"""


def run_isolated(command: list[str | Path], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run outside this checkout: no PYTHONPATH, another working directory, so only the installed copy is found."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(command, cwd=cwd, env=env, check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with batchmaker-client installed from a copy of this checkout (the build writes files)."""
    base = tmp_path_factory.mktemp("client-dist")
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    for folder in ("dist/client", "batchmaker", "clients", "common", "data/wmt16-ende"):
        shutil.copytree(ROOT / folder, base / "src" / folder, ignore=ignore)
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", base / "src" / "dist" / "client"],
        check=True,
    )
    return env_dir


def test_installed_client_has_no_torch_and_talks_to_a_server(client_venv: Path, lstm_server: RunningServer) -> None:
    python = client_venv / "bin" / "python"
    result = run_isolated([python, "-c", CHECK, lstm_server.address], client_venv)
    found = json.loads(result.stdout)
    assert found["loaded"] == [] and found["torch_installed"] is False
    assert found["common"] == ["batchmaker.common", "batchmaker.common.auth", "batchmaker.common.protocol"]
    assert str(client_venv) in found["clients_file"]  # the installed copy, not this checkout

    model = build_model(lstm_server.config.models["lstm"])
    expected = model.reference(model.load_weights(), {"tokens": [5, 17, 342, 9]})["h"]
    assert np.abs(np.asarray(found["h"], np.float32) - expected).max() <= 1e-5


def test_installed_command_line_client(client_venv: Path, lstm_server: RunningServer) -> None:
    command = client_venv / "bin" / "batchmaker-client"
    result = run_isolated(
        [command, "infer", "--address", lstm_server.address, "--model", "lstm", "--tokens", "5 17 342 9"], client_venv
    )
    assert result.stdout.startswith("h: float32 shape [64]")
    refused = run_isolated([command, "health", "--address", "x", "--address", "x"], client_venv, check=False)
    assert refused.returncode == 1 and refused.stderr.startswith("error USAGE: ")
    assert run_isolated([command, "--help"], client_venv).stdout.startswith("usage: batchmaker-client ")


def test_installed_command_line_client_reads_the_config_and_has_the_vocabulary(
    client_venv: Path, lstm_server: RunningServer
) -> None:
    """--config read without torch, and --text with the vocabulary the distribution installs."""
    command = client_venv / "bin" / "batchmaker-client"
    sentence = "the report ."
    ids = Vocabulary(DEFAULT_VOCAB).encode(sentence)
    assert max(ids) < 1000  # the small LSTM's vocabulary
    result = run_isolated(
        [command, "infer", "--config", lstm_server.config.path, "--model", "lstm", "--text", sentence, "--json"],
        client_venv,
    )
    model = build_model(lstm_server.config.models["lstm"])
    expected = model.reference(model.load_weights(), {"tokens": ids})["h"]
    assert np.abs(np.asarray(json.loads(result.stdout)["outputs"]["h"], np.float32) - expected).max() <= 1e-5


def installed_tops(env_dir: Path, distribution: str) -> set[str]:
    """What a distribution installed at the top of site-packages, as its RECORD lists it (scripts left out)."""
    site = next((env_dir / "lib").glob("python*/site-packages"))
    record = next(site.glob(f"{distribution}-*.dist-info")) / "RECORD"
    paths = [line.split(",")[0] for line in record.read_text().splitlines() if line]
    return {path.split("/")[0] for path in paths if not path.startswith("..")}


def test_the_client_distribution_installs_batchmaker_only(client_venv: Path) -> None:
    assert installed_tops(client_venv, "batchmaker_client") == {"batchmaker", "batchmaker_client-0.1.0.dist-info"}


def test_the_server_wheel_installs_batchmaker_only(tmp_path: Path) -> None:
    """Built from a copy of this checkout and installed without its dependencies (torch is not needed to look)."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    for folder in ("batchmaker", "manager", "worker", "common", "clients", "bench", "frontdoor"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    run_isolated([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", tmp_path / "wheels", source], tmp_path)
    (wheel,) = (tmp_path / "wheels").glob("batchmaker-*.whl")
    run_isolated([*pip, "install", "--quiet", "--no-deps", wheel], tmp_path)
    assert installed_tops(env_dir, "batchmaker") == {"batchmaker", "batchmaker-0.1.0.dist-info"}

