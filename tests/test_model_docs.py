"""docs/models.md's code runs as written: its Python blocks make a module that serves, through the
real `batchmaker` command, from a folder of its own, with the doc's config; its answers equal its
reference, and the plan override compiles to the same plans as the unfold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, free_port
from test_serve_cli import batchmaker

from batchmaker.clients import Client, ServerError
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model
from batchmaker.common.plan import compile_graph
from batchmaker.manager.commands.launcher import stop_server, wait_until_ready

DOC = ROOT / "docs" / "models.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), flags=re.DOTALL | re.MULTILINE)


def write_doc_model(folder: Path) -> Path:
    """mgu.py from the doc's Python blocks, in order, and mgu.toml from its TOML blocks with a free port."""
    (folder / "mgu.py").write_text("\n\n".join(blocks("python")))
    toml = "\n".join(blocks("toml"))
    config = folder / "mgu.toml"
    config.write_text(f'[server]\naddress = "tcp://127.0.0.1:{free_port()}"\ncpu_workers = 1\n\n{toml}')
    return config


def test_the_docs_model_serves_and_equals_its_reference(tmp_path: Path):
    config_path = write_doc_model(tmp_path)
    subprocess.run([Path(sys.executable).parent / "batchmaker", "init-weights", config_path], cwd=tmp_path, check=True)
    config = load_config(config_path)
    model, vectors = (build_model(config.models[name]) for name in ("mgu", "mgu_vectors"))
    state, vector_state = model.load_weights(), vectors.load_weights()
    server = batchmaker("serve", str(config_path), cwd=tmp_path, log=tmp_path / "serve.log")
    try:
        wait_until_ready(config.server.address, server, timeout=120)
        rng = np.random.default_rng(3)
        with Client(config.server.address, timeout=30) as client:
            for length in (1, 5, 17):
                tokens = rng.integers(0, 1000, size=length).tolist()
                served = client.infer("mgu", {"tokens": tokens}).outputs["h"]
                assert np.abs(served - model.reference(state, {"tokens": tokens})["h"]).max() <= 1e-5
                x = rng.random((length, 12))  # float64: the client sends it as float32
                for sent in (x, x.astype(np.float32), x.astype(np.float32).tolist()):
                    served = client.infer("mgu_vectors", {"x": sent}).outputs["h"]
                    expected = vectors.reference(vector_state, {"x": x.astype(np.float32).tolist()})["h"]
                    assert np.abs(served - expected).max() <= 1e-5
            with pytest.raises(ServerError, match=r"INVALID_INPUT: x must have shape \[T, 12\]"):
                client.infer("mgu_vectors", {"x": [[1.0, 2.0]]})  # rows of 2 numbers, not 12
    finally:
        assert stop_server(server) == []


def test_the_docs_plan_override_compiles_like_the_unfold(tmp_path: Path):
    config = load_config(write_doc_model(tmp_path))
    namespace: dict = {}
    exec(compile((tmp_path / "mgu.py").read_text(), str(tmp_path / "mgu.py"), "exec"), namespace)  # noqa: S102
    model = namespace["CachedMGUModel"](config.models["mgu"])
    inputs = {"tokens": [7, 3, 9, 9]}
    cached, compiled = model.plan(inputs), compile_graph(model.unfold(inputs), model.cell_types, model.name)
    assert cached.plan is model.plan({"tokens": [1, 2, 3, 4]}).plan  # one plan per length
    assert [values.tolist() for values in cached.externals.values()] == [
        v.tolist() for v in compiled.externals.values()
    ]
