"""`batchmaker serve --http ADDRESS --grpc ADDRESS` as a user runs it: the front door comes up with the server,
answers both protocols, and stops with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import SMALL_LSTM, free_port, wait_until, write_config
from oip_server import TOLERANCE
from test_serve_cli import batchmaker

from batchmaker.common.models import build_model
from batchmaker.manager.commands.launcher import stop_server


def test_serve_flags_open_the_front_door(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    http, grpc = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    server = batchmaker(
        "serve", str(config.path), "--workers", "1", "--http", http, "--grpc", grpc, cwd=tmp_path, log=log
    )
    try:
        wait_until(
            lambda: f"(OIP HTTP on {http}, gRPC on {grpc})" in log.read_text() or server.poll() is not None, "ready"
        )
        assert server.poll() is None, log.read_text()
        item = httpclient.InferInput("tokens", [3], "INT64")
        item.set_data_from_numpy(np.array([5, 17, 342], dtype=np.int64))
        h = httpclient.InferenceServerClient(http).infer("lstm", [item]).as_numpy("h")
        model = build_model(config.models["lstm"])
        assert np.abs(h - model.reference(model.load_weights(), {"tokens": [5, 17, 342]})["h"]).max() <= TOLERANCE
        assert grpcclient.InferenceServerClient(grpc).is_server_ready()
    finally:
        assert stop_server(server) == []
