"""The command line and the client as a new user meets them: `infer --json` prints the reply in full
for scripts, and torch tensors are accepted as inputs (finding the server: tests/test_cli_address.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_clients_offline import FakeServer

from batchmaker.clients.cli import main as cli_main
from batchmaker.clients.messages import infer_message


def test_infer_json_prints_every_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    server = FakeServer(f"ipc://{tmp_path}/server.ipc")
    try:
        tokens = " ".join(str(i) for i in range(20))
        assert cli_main(["infer", "--address", server.address, "--model", "lstm", "--tokens", tokens, "--json"]) == 0
    finally:
        server.close()
    reply = json.loads(capsys.readouterr().out)
    assert reply["outputs"]["h"] == [2.0 * i for i in range(20)]  # all 20, not a preview of 8
    assert reply["timing"] == {"queue_us": 10, "compute_us": 20, "total_us": 35}


def test_torch_tensors_travel_as_numpy_arrays():
    message = infer_message("m", {"tokens": torch.tensor([3, 4]), "tree": {"x": torch.zeros(2, 3)}}, None, None)
    assert isinstance(message["inputs"]["tokens"], np.ndarray) and message["inputs"]["tokens"].tolist() == [3, 4]
    assert message["inputs"]["tree"]["x"].shape == (2, 3)


def test_a_tensor_numpy_cannot_read_names_the_fix():
    with pytest.raises(TypeError, match=r"input 'x': cannot read the Tensor .*pass value.detach\(\).cpu\(\).numpy\(\)"):
        infer_message("m", {"x": torch.ones(3, requires_grad=True)}, None, None)
