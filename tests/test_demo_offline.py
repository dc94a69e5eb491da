"""./scripts/demo on a GPU host without a package index: an NVIDIA driver (a fake nvidia-smi), an interpreter that
already has torch and the server's dependencies but no test tools, and pip told to use no index (PIP_NO_INDEX). The
scripts install the project against what is there, building it with the interpreter's setuptools, and the demo runs
to its checked answers: nothing is downloaded, and nothing the demo does not run on is asked for."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from conftest import ROOT, free_port
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow

HOST_TOOLS = ("pip", "setuptools")  # what the host's python has besides the server's dependencies


def dependency_closure(names: list[str]) -> list[metadata.Distribution]:
    """The distributions of this environment that `names` need, with theirs (extras left out)."""
    found: dict[str, metadata.Distribution] = {}
    pending = [Requirement(name) for name in names]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        distribution = metadata.distribution(requirement.name)
        key = distribution.metadata["Name"].lower()
        if key not in found:
            found[key] = distribution
            pending.extend(Requirement(text) for text in distribution.requires or ())
    return list(found.values())


def host_python(tmp_path: Path) -> Path:
    """A python whose packages are the server's dependencies (torch included), pip and setuptools, linked from this
    environment: a virtualenv with none of its own, and a .pth naming a folder of links to those alone."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    packages = tmp_path / "host-packages"
    packages.mkdir()
    for distribution in dependency_closure([*project["dependencies"], *HOST_TOOLS]):
        assert distribution.files is not None, f"{distribution.metadata['Name']} lists no files"
        tops = {file.parts[0] for file in distribution.files if file.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            source = Path(distribution.locate_file(top))
            if source.exists() and not (packages / top).exists():
                (packages / top).symlink_to(source)
    venv = tmp_path / "host"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "host-packages.pth").write_text(f"{packages}\n")
    return venv / "bin" / "python"


def checkout_copy(tmp_path: Path) -> Path:
    """The repository's files as they are in the working tree (without .venv, weights or results)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    copy = tmp_path / "checkout"
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def test_the_demo_runs_on_a_gpu_host_with_torch_and_no_package_index(tmp_path: Path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the repository's git checkout to copy it")
    python = host_python(tmp_path)
    lacks = subprocess.run([str(python), "-c", "import pytest"], capture_output=True, timeout=60, check=False)
    assert lacks.returncode != 0, "the host's python must lack the test tools for this test to mean anything"
    checkout = checkout_copy(tmp_path)
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (driver / "nvidia-smi").chmod(0o755)
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PIP_", "BATCHMAKER_")) and name not in ("VIRTUAL_ENV", "PYTHONPATH")
    }
    env |= {
        "PATH": f"{driver}{os.pathsep}{env['PATH']}",
        "BATCHMAKER_PYTHON": str(python),
        "PIP_NO_INDEX": "1",
        "PIP_CONFIG_FILE": os.devnull,
    }
    address = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [str(checkout / "scripts" / "demo"), "--address", address, "--duration", "2", "--rate", "20", "--verify", "10"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    log = re.search(r"server log +(\S+)", done.stdout)
    if log:
        Path(log.group(1)).unlink()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"using torch {metadata.version('torch')} of {python}" in done.stderr
    assert re.search(r"verified +10 replies against the reference model, 0 differ", done.stdout)
    assert done.stdout.strip().splitlines()[-1].startswith("DEMO PASSED: ")
    # Installed into the host's virtualenv, with no extras: the test tools are still missing there.
    stamp = (python.parent.parent / ".batchmaker-installed").read_text().splitlines()
    assert stamp == ["the interpreter's own torch", "extras="]
    assert not (checkout / ".venv").exists()
    lacks = subprocess.run([str(python), "-c", "import pytest"], capture_output=True, timeout=60, check=False)
    assert lacks.returncode != 0
