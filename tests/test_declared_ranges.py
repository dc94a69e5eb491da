"""pyproject.toml's lower bounds admit only versions that have the APIs the code relies on: each API below imports
here, and the bound declared for its distribution is at least the release that brought it."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import tomllib

import pytest
from conftest import ROOT

# (distribution, where pyproject.toml declares it, the release that brought the API, its module, its name)
APIS = [
    # worker/device_tasks.py: a CUDA error ends the worker
    ("torch", "dependencies", "2.8", "torch", "AcceleratorError"),
    # tests/cuda_fakes.py: a numpy 2 module
    ("numpy", "test", "2.0", "numpy.lib.array_utils", "byte_bounds"),
]


def release(version: str) -> tuple[int, int, int]:
    parts = tuple(int(part) for part in re.match(r"\d+(\.\d+)*", version)[0].split("."))
    return (*parts, 0, 0, 0)[:3]


def declared_minimum(distribution: str, where: str) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] if where == "dependencies" else project["optional-dependencies"][where]
    bounds = [m[1] for r in requirements if (m := re.fullmatch(rf"{distribution}>=([\d.]+)(,.*)?", r))]
    assert bounds, f"pyproject.toml declares no lower bound for {distribution} in {where}"
    return bounds[0]


@pytest.mark.parametrize(("distribution", "where", "brought_in", "module", "name"), APIS, ids=[api[0] for api in APIS])
def test_the_declared_lower_bound_has_the_api(distribution, where, brought_in, module, name):
    imported = importlib.import_module(module)
    assert hasattr(imported, name), f"{distribution} {importlib.metadata.version(distribution)} has no {module}.{name}"
    assert release(declared_minimum(distribution, where)) >= release(brought_in)
