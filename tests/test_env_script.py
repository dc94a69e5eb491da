"""scripts/_env.sh chooses the torch build and the extras each script runs on, and builds the project with the
environment's setuptools: driven offline, with a fake interpreter (and pip) and a fake nvidia-smi."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("demo", "serve", "test")  # the scripts whose extras are checked
BASH = shutil.which("bash")
CPU = "torch==2.13.0+cpu"
CPU_INDEX = ["--index-url", "https://download.pytorch.org/whl/cpu"]
BUILD = ["install", "setuptools>=68"]  # pyproject.toml's build requirement, for the build without isolation

# A stand-in for python3 and for a virtualenv's python: runs `-c` code as the real interpreter would (with the
# version FAKE_PYTHON_VERSION claims, a torch at FAKE_TORCH_VERSION or none, and in a virtualenv when the folder
# above its own holds a pyvenv.cfg), records every `-m pip` call, answers `pip install --dry-run` with
# FAKE_DRY_RUN_RC, and makes `-m venv [--system-site-packages] DIR` a virtualenv holding another copy of itself.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, shutil, sys, types
args = sys.argv[1:]
if args[0] == "-c":
    sys.argv = ["-c", *args[2:]]
    sys.version_info = tuple(int(part) for part in os.environ["FAKE_PYTHON_VERSION"].split("."))
    sys.modules["torch"] = None  # ModuleNotFoundError, unless a fake torch takes its place
    if "FAKE_TORCH_VERSION" in os.environ:
        sys.modules["torch"] = types.SimpleNamespace(__version__=os.environ["FAKE_TORCH_VERSION"])
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.prefix = prefix if os.path.exists(os.path.join(prefix, "pyvenv.cfg")) else sys.base_prefix
    exec(args[1])
elif args[:2] == ["-m", "venv"]:
    os.makedirs(os.path.join(args[-1], "bin"))
    shutil.copy(__file__, os.path.join(args[-1], "bin", "python"))
    with open(os.path.join(args[-1], "pyvenv.cfg"), "w") as cfg:
        cfg.write(f"include-system-site-packages = {{str('--system-site-packages' in args).lower()}}\\n")
elif args[:2] == ["-m", "pip"]:
    with open(os.environ["FAKE_PIP_LOG"], "a") as log:
        log.write(json.dumps(args[2:]) + "\\n")
    sys.exit(int(os.environ.get("FAKE_DRY_RUN_RC", "0")) if "--dry-run" in args else 0)
else:
    sys.exit(f"unexpected call: {{args}}")
"""


class Checkout:
    """A copy of the scripts and pyproject.toml in a temporary folder, with a PATH that holds only what they need."""

    def __init__(self, tmp_path: Path):
        self.root = tmp_path / "checkout"
        (self.root / "scripts").mkdir(parents=True)
        for script in ("_env.sh", *SCRIPTS):
            shutil.copy(ROOT / "scripts" / script, self.root / "scripts" / script)
        shutil.copy(ROOT / "pyproject.toml", self.root / "pyproject.toml")
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for tool in ("dirname", "cat", "sed", "grep"):
            (self.bin / tool).symlink_to(shutil.which(tool))
        self.python = tmp_path / "python3"
        self.python.write_text(FAKE_PYTHON)
        self.python.chmod(0o755)
        self.pip_log = tmp_path / "pip.log"
        self.env = {
            "PATH": str(self.bin),
            "HOME": str(tmp_path),
            "BATCHMAKER_PYTHON": str(self.python),
            "FAKE_PYTHON_VERSION": "3.11.7",
            "FAKE_PIP_LOG": str(self.pip_log),
        }

    @property
    def stamp(self) -> Path:
        return self.root / ".venv" / ".batchmaker-installed"

    def stamped(self, venv: Path | None = None) -> tuple[str, str]:
        """The torch spec and the extras the stamp of `venv` (default: .venv) records."""
        spec, extras = ((venv or self.root / ".venv") / ".batchmaker-installed").read_text().splitlines()
        return spec, extras.removeprefix("extras=")

    def add_nvidia_driver(self) -> None:
        smi = self.bin / "nvidia-smi"
        smi.write_text("#!/bin/sh\nexit 0\n")
        smi.chmod(0o755)

    def add_virtualenv(self) -> Path:
        """A virtualenv of the user's, outside the checkout, whose python is the fake one."""
        venv = self.root.parent / "user-venv"
        (venv / "bin").mkdir(parents=True)
        shutil.copy(self.python, venv / "bin" / "python")
        (venv / "pyvenv.cfg").write_text("include-system-site-packages = false\n")
        return venv

    def source(self, job_extras: str = "", **env: str | None) -> subprocess.CompletedProcess:
        """Source _env.sh in a fresh shell as a script needing `job_extras` does, with `env` added (None removes
        a variable); returns the finished process (pip calls go to pip_calls())."""
        return self.run(["-c", 'JOB_EXTRAS="$2"; source "$1"', "_", str(self.root / "scripts" / "_env.sh"), job_extras],
                        **env)  # fmt: skip

    def run(self, arguments: list[str], **env: str | None) -> subprocess.CompletedProcess:
        """bash with these arguments, in the environment `source` describes."""
        self.pip_log.unlink(missing_ok=True)
        return subprocess.run(
            [BASH, *arguments],
            env={name: value for name, value in {**self.env, **env}.items() if value is not None},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def pip_calls(self) -> list[list[str]]:
        if not self.pip_log.exists():
            return []
        return [json.loads(line) for line in self.pip_log.read_text().splitlines()]


def installs(calls: list[list[str]]) -> list[list[str]]:
    """The pip calls that install something, without the flags every call carries."""
    quiet = {"--quiet", "--disable-pip-version-check"}
    return [[a for a in call if a not in quiet] for call in calls if call[0] == "install" and "--dry-run" not in call]


@pytest.fixture
def checkout(tmp_path: Path) -> Checkout:
    if BASH is None:
        pytest.skip("bash not found")
    return Checkout(tmp_path)


def project(checkout: Checkout, extras: str = "") -> list[list[str]]:
    """The installs of the project with these extras: its build requirement, then the project without isolation."""
    return [BUILD, ["install", "--no-build-isolation", "-e", f"{checkout.root}{f'[{extras}]' if extras else ''}"]]


def sees_system_site_packages(venv: Path) -> bool:
    return "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()


def test_without_a_driver_the_cpu_build_comes_from_the_configured_indexes(checkout):
    result = checkout.source()
    assert result.returncode == 0, result.stderr
    assert (checkout.root / ".venv" / "bin" / "python").exists()
    calls = checkout.pip_calls()
    assert ["install", "--quiet", "--disable-pip-version-check", "--dry-run", "--no-deps", CPU] in calls
    assert installs(calls) == [["install", CPU], *project(checkout)]
    assert checkout.stamped()[0] == CPU


def test_without_a_driver_a_cpu_build_pip_cannot_find_comes_from_pytorchs_cpu_index(checkout):
    result = checkout.source(FAKE_DRY_RUN_RC="1")
    assert result.returncode == 0, result.stderr
    assert installs(checkout.pip_calls()) == [["install", CPU, *CPU_INDEX], *project(checkout)]
    assert checkout.stamped()[0] == CPU


def test_with_a_driver_the_cuda_build_comes_from_pypi(checkout):
    checkout.add_nvidia_driver()
    result = checkout.source()
    assert result.returncode == 0, result.stderr
    calls = checkout.pip_calls()
    assert not any("--dry-run" in call for call in calls)
    assert installs(calls) == [["install", "torch==2.13.0"], *project(checkout)]
    assert checkout.stamped()[0] == "torch==2.13.0"


def test_batchmaker_torch_overrides_the_choice(checkout):
    checkout.add_nvidia_driver()
    spec = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124"
    result = checkout.source(BATCHMAKER_TORCH=spec)
    assert result.returncode == 0, result.stderr
    assert installs(checkout.pip_calls()) == [["install", *spec.split()], *project(checkout)]
    assert checkout.stamped()[0] == spec


def test_an_up_to_date_virtualenv_is_left_alone(checkout):
    assert checkout.source().returncode == 0
    result = checkout.source()
    assert result.returncode == 0, result.stderr
    assert checkout.pip_calls() == []


def test_a_newer_pyproject_reinstalls_the_project_but_keeps_torch(checkout):
    assert checkout.source().returncode == 0
    stamp_time = checkout.stamp.stat().st_mtime
    os.utime(checkout.root / "pyproject.toml", (stamp_time + 10, stamp_time + 10))
    result = checkout.source()
    assert result.returncode == 0, result.stderr
    calls = checkout.pip_calls()
    assert not any(call[0] == "uninstall" for call in calls)
    assert installs(calls) == [["install", CPU], *project(checkout)]


def test_a_changed_torch_spec_replaces_the_installed_build(checkout):
    assert checkout.source().returncode == 0
    checkout.add_nvidia_driver()
    result = checkout.source()
    assert result.returncode == 0, result.stderr
    assert "removing the torch installed for it" in result.stderr
    calls = checkout.pip_calls()
    assert calls[0] == ["uninstall", "--quiet", "--yes", "torch"]
    assert installs(calls) == [["install", "torch==2.13.0"], *project(checkout)]
    assert checkout.stamped()[0] == "torch==2.13.0"


def test_an_old_python_is_refused_before_anything_is_installed(checkout):
    result = checkout.source(FAKE_PYTHON_VERSION="3.10.12")
    assert result.returncode != 0
    assert "Python 3.10" in result.stderr and "needs Python >= 3.11" in result.stderr
    assert not (checkout.root / ".venv").exists()
    assert checkout.pip_calls() == []


def test_a_virtualenv_made_by_an_old_python_is_refused(checkout):
    assert checkout.source().returncode == 0
    result = checkout.source(FAKE_PYTHON_VERSION="3.9.2")
    assert result.returncode != 0
    assert "Python 3.9" in result.stderr and str(checkout.root / ".venv") in result.stderr
    assert checkout.pip_calls() == []


def test_a_missing_python_is_named(checkout):
    result = checkout.source(BATCHMAKER_PYTHON="python3.11-nowhere")
    assert result.returncode != 0
    assert "python3.11-nowhere not found" in result.stderr and "needs Python >= 3.11" in result.stderr


FOUND = "the interpreter's own torch"  # the stamp when the scripts use the interpreter's torch


def test_a_torch_in_range_is_used_where_it_is_even_with_a_driver(checkout):
    checkout.add_nvidia_driver()
    result = checkout.source(FAKE_TORCH_VERSION="2.11.0+cu126")
    assert result.returncode == 0, result.stderr
    assert "using torch 2.11.0+cu126" in result.stderr
    assert sees_system_site_packages(checkout.root / ".venv")
    calls = checkout.pip_calls()
    assert not any(call[0] == "uninstall" for call in calls)
    assert installs(calls) == project(checkout)
    assert checkout.stamped()[0] == FOUND


def test_a_prerelease_build_at_the_lower_bound_is_in_range(checkout):
    result = checkout.source(FAKE_TORCH_VERSION="2.8.0a0+5228986")  # as vendor images number their builds
    assert result.returncode == 0, result.stderr
    assert installs(checkout.pip_calls()) == project(checkout)


def test_an_active_virtualenv_with_torch_gets_the_project_itself(checkout):
    venv = checkout.add_virtualenv()
    result = checkout.source(BATCHMAKER_PYTHON=None, VIRTUAL_ENV=str(venv), FAKE_TORCH_VERSION="2.11.0")
    assert result.returncode == 0, result.stderr
    assert not (checkout.root / ".venv").exists()
    assert installs(checkout.pip_calls()) == project(checkout)
    assert checkout.stamped(venv)[0] == FOUND
    result = checkout.source(BATCHMAKER_PYTHON=None, VIRTUAL_ENV=str(venv), FAKE_TORCH_VERSION="2.11.0")
    assert result.returncode == 0, result.stderr
    assert checkout.pip_calls() == []


def test_a_torch_below_the_range_is_refused_with_the_ways_out(checkout):
    result = checkout.source(FAKE_TORCH_VERSION="2.5.1+cu121")
    assert result.returncode != 0
    assert "imports torch 2.5.1+cu121" in result.stderr and "needs torch >= 2.8" in result.stderr
    assert "Upgrade that torch" in result.stderr and "BATCHMAKER_TORCH" in result.stderr
    assert not (checkout.root / ".venv").exists()
    assert checkout.pip_calls() == []


def test_batchmaker_torch_installs_past_an_old_torch(checkout):
    spec = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
    result = checkout.source(FAKE_TORCH_VERSION="2.5.1", BATCHMAKER_TORCH=spec)
    assert result.returncode == 0, result.stderr
    assert not sees_system_site_packages(checkout.root / ".venv")
    assert installs(checkout.pip_calls()) == [["install", *spec.split()], *project(checkout)]


def test_without_torch_or_a_driver_the_venv_is_its_own(checkout):
    result = checkout.source()
    assert result.returncode == 0, result.stderr
    assert not sees_system_site_packages(checkout.root / ".venv")
    assert installs(checkout.pip_calls()) == [["install", CPU], *project(checkout)]


@pytest.mark.parametrize("torch_version", [None, "2.11.0"])
def test_a_wheel_folder_makes_every_install_offline(checkout, tmp_path, torch_version):
    wheels = str(tmp_path / "wheels")
    result = checkout.source(BATCHMAKER_WHEELS=wheels, FAKE_TORCH_VERSION=torch_version, FAKE_DRY_RUN_RC="1")
    assert result.returncode == 0, result.stderr
    calls = checkout.pip_calls()
    assert all(call[0] == "install" for call in calls)
    assert all(call[:5] == ["install", "--quiet", "--disable-pip-version-check", "--no-index", "--find-links"]
               and call[5] == wheels for call in calls)
    offline = ["--no-index", "--find-links", wheels]
    torch = [] if torch_version else [["install", *offline, CPU]]  # no fallback to PyTorch's index offline
    assert installs(calls) == [
        *torch,
        ["install", *offline, "setuptools>=68"],
        ["install", *offline, "--no-build-isolation", "-e", str(checkout.root)],
    ]


def test_the_interpreters_torch_is_never_uninstalled(checkout):
    assert checkout.source(FAKE_TORCH_VERSION="2.11.0").returncode == 0
    checkout.add_nvidia_driver()  # would change the spec the scripts install: .venv keeps the interpreter's torch
    result = checkout.source(FAKE_TORCH_VERSION="2.11.0")
    assert result.returncode == 0, result.stderr
    assert checkout.pip_calls() == []
    spec = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
    result = checkout.source(FAKE_TORCH_VERSION="2.11.0", BATCHMAKER_TORCH=spec)
    assert result.returncode == 0, result.stderr
    calls = checkout.pip_calls()
    assert not any(call[0] == "uninstall" for call in calls)
    assert installs(calls) == [["install", *spec.split()], *project(checkout)]
    # Back to the interpreter's torch: the one the scripts installed goes, and nothing else.
    result = checkout.source(FAKE_TORCH_VERSION="2.11.0")
    assert result.returncode == 0, result.stderr
    calls = checkout.pip_calls()
    assert calls[0] == ["uninstall", "--quiet", "--yes", "torch"]
    assert installs(calls) == project(checkout)
    assert checkout.stamped()[0] == FOUND


def test_an_active_virtualenvs_torch_is_never_uninstalled(checkout):
    venv = checkout.add_virtualenv()
    env = {"BATCHMAKER_PYTHON": None, "VIRTUAL_ENV": str(venv), "FAKE_TORCH_VERSION": "2.11.0"}
    assert checkout.source(**env).returncode == 0
    checkout.add_nvidia_driver()
    result = checkout.source(**env)
    assert result.returncode == 0, result.stderr
    assert checkout.pip_calls() == []


def test_the_images_install_the_server_with_the_front_door_and_without_the_test_and_bench_extras(checkout):
    result = checkout.source(BATCHMAKER_EXTRAS="oip")
    assert result.returncode == 0, result.stderr
    assert installs(checkout.pip_calls()) == [["install", CPU], *project(checkout, "oip")]
    assert checkout.stamped() == (CPU, "oip")
    for image in ("cpu", "cuda"):
        assert (
            "BATCHMAKER_EXTRAS=oip bash -c 'source scripts/_env.sh'"
            in (ROOT / "deploy" / f"{image}.Dockerfile").read_text()
        )



def test_the_demo_and_the_server_install_the_runtime_dependencies_and_the_tests_their_extras(checkout):
    """Each script as it is: the pip calls it makes before it runs its job (here, a fake python that runs no job)."""
    checkout.add_nvidia_driver()
    spec = "torch==2.13.0"
    for script, extras in (("demo", ""), ("serve", ""), ("test", "test,bench")):
        shutil.rmtree(checkout.root / ".venv", ignore_errors=True)
        checkout.run([str(checkout.root / "scripts" / script)])
        assert installs(checkout.pip_calls()) == [["install", spec], *project(checkout, extras)], script
        assert checkout.stamped() == (spec, extras)


def test_a_venv_made_for_the_demo_gets_the_test_extras_when_the_tests_run(checkout):
    assert checkout.source("").returncode == 0
    assert checkout.stamped() == (CPU, "")
    result = checkout.source("test,bench")
    assert result.returncode == 0, result.stderr
    calls = checkout.pip_calls()
    assert installs(calls) == [["install", CPU], *project(checkout, "test,bench")]
    assert not any(call[0] == "uninstall" for call in calls)
    assert checkout.stamped() == (CPU, "test,bench")
    for extras in ("", "test", "test,bench"):  # what is installed covers them: nothing to do
        assert checkout.source(extras).returncode == 0
        assert checkout.pip_calls() == [], extras
    result = checkout.source("", BATCHMAKER_EXTRAS="oip")  # another extra joins those there, which stay
    assert result.returncode == 0, result.stderr
    assert installs(checkout.pip_calls()) == [["install", CPU], *project(checkout, "test,bench,oip")]
    assert checkout.stamped() == (CPU, "test,bench,oip")


def test_batchmaker_extras_adds_to_the_scripts_own(checkout):
    result = checkout.source("test,bench", BATCHMAKER_EXTRAS="oip,bench")
    assert result.returncode == 0, result.stderr
    assert installs(checkout.pip_calls()) == [["install", CPU], *project(checkout, "test,bench,oip")]


def test_a_stamp_without_extras_installs_them_once_for_a_script_that_needs_them(checkout):
    assert checkout.source("").returncode == 0
    checkout.stamp.write_text(CPU + "\n")  # as the scripts wrote it before they recorded the extras
    assert checkout.source("").returncode == 0
    assert checkout.pip_calls() == []
    assert checkout.source("test,bench").returncode == 0
    assert installs(checkout.pip_calls()) == [["install", CPU], *project(checkout, "test,bench")]
    assert checkout.stamped() == (CPU, "test,bench")
