"""Start-up mistakes a new user makes, through the real command line (`python -m batchmaker.manager.commands.cli serve`
in a subprocess, from a folder of the user's own): each fails before any process starts, with one
message that names the fix, and never invents, deletes or overwrites a weights file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from conftest import ROOT, free_port
from test_config import MODEL
from torch import nn

SERVE_TIMEOUT_S = 120  # a failure before any process starts takes about a second; this bounds a hang


def write_config(folder: Path, weights: str = "trained.pt", server: str = "", model: str = "") -> Path:
    """A config of the user's, model "mylstm", in `folder`; `server` and `model` add keys to those tables."""
    table = MODEL.replace("[models.lstm]", "[models.mylstm]").replace('"lstm.pt"', f'"{weights}"')
    path = folder / "lstm.toml"
    path.write_text(f'[server]\naddress = "tcp://127.0.0.1:{free_port()}"\n{server}\n{table}{model}\n')
    return path


def user_env() -> dict[str, str]:
    """The environment without PYTHONPATH: builders must import from the paths the server adds."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def serve(config: Path, *options: str, cwd: Path) -> subprocess.CompletedProcess:
    """`batchmaker serve` run from `cwd`, expected to fail at start."""
    command = [sys.executable, "-m", "batchmaker.manager.commands.cli", "serve", str(config), *options]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, env=user_env(), check=False
    )


class Trained(nn.Module):
    """A user's model, with attribute names of their own choosing."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.rnn = nn.LSTM(8, hidden)


def named_as_served(hidden: int = 16) -> nn.Module:
    module = nn.Module()
    module.embedding = nn.Embedding(50, 8)
    module.lstm = nn.LSTM(8, hidden)
    return module


def assert_refused(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, result.stderr
    message = result.stderr
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert "Traceback" not in message and "delete" not in message, message
    return message


def test_a_missing_weights_file_is_refused_naming_the_path_and_never_created(tmp_path: Path):
    config = write_config(tmp_path, weights="lstm_trained.pt")
    result = serve(config, cwd=tmp_path)
    assert_refused(
        result, f"weights file {tmp_path / 'lstm_trained.pt'} does not exist", f"batchmaker init-weights {config}"
    )
    assert not (tmp_path / "lstm_trained.pt").exists()


def test_every_missing_or_mismatched_weights_file_is_named_in_one_error(tmp_path: Path):
    torch.save(named_as_served(hidden=32).state_dict(), tmp_path / "wide.pt")
    others = "".join(
        MODEL.replace("[models.lstm]", f"[models.{name}]").replace('"lstm.pt"', f'"{weights}"')
        for name, weights in (("second", "second.pt"), ("sized", "wide.pt"))
    )
    config = write_config(tmp_path, weights="first.pt", model=others)
    message = assert_refused(
        serve(config, cwd=tmp_path),
        "3 models cannot load their weights",
        f"[models.mylstm] weights file {tmp_path / 'first.pt'} does not exist",
        f"[models.second] weights file {tmp_path / 'second.pt'} does not exist",
        f"[models.sized] weights file {tmp_path / 'wide.pt'} does not fit the config's sizes",
    )
    assert message.count(f"batchmaker init-weights {config}") == 2
    assert not (tmp_path / "first.pt").exists() and not (tmp_path / "second.pt").exists()


def test_scripts_serve_resolves_the_config_from_the_callers_folder_and_invents_no_weights(tmp_path: Path):
    write_config(tmp_path, weights="lstm_trained.pt")
    result = subprocess.run(
        [str(ROOT / "scripts" / "serve"), "lstm.toml"], cwd=tmp_path, capture_output=True, text=True,
        timeout=SERVE_TIMEOUT_S, check=False,
    )
    assert_refused(result, f"weights file {tmp_path / 'lstm_trained.pt'} does not exist", "batchmaker init-weights")
    assert "created" not in result.stdout
    assert not (tmp_path / "lstm_trained.pt").exists()


def test_other_attribute_names_are_listed_with_the_renaming(tmp_path: Path):
    torch.save(Trained().state_dict(), tmp_path / "trained.pt")
    before = (tmp_path / "trained.pt").read_bytes()
    message = assert_refused(
        serve(write_config(tmp_path), cwd=tmp_path),
        "expected: embedding.weight, lstm.weight_ih_l0",
        "found:    emb.weight, rnn.weight_ih_l0",
        "emb. -> embedding., rnn. -> lstm.",
    )
    renamed = tmp_path / "trained-renamed.pt"
    command = message[message.index('python -c "') + len('python -c "') : message.rindex('"')]
    subprocess.run([sys.executable, "-c", command], check=True, timeout=60)  # the suggested conversion works
    assert set(torch.load(renamed, weights_only=True)) == set(named_as_served().state_dict())
    assert (tmp_path / "trained.pt").read_bytes() == before


def test_a_checkpoint_dict_names_the_key_holding_the_state_dict(tmp_path: Path):
    torch.save({"model": named_as_served().state_dict(), "epoch": 3}, tmp_path / "trained.pt")
    assert_refused(
        serve(write_config(tmp_path), cwd=tmp_path),
        "is a checkpoint dict with keys ['epoch', 'model']; its state dict is under 'model'",
        "[models.mylstm]",
    )


def test_a_pickled_module_is_explained(tmp_path: Path):
    torch.save(nn.LSTM(8, 16), tmp_path / "trained.pt")
    assert_refused(
        serve(write_config(tmp_path), cwd=tmp_path),
        "holds a pickled module (torch.nn.modules.rnn.LSTM), saved with torch.save(model)",
        "torch.save(model.state_dict(), PATH)",
    )


def test_weights_of_other_sizes_name_the_config_sizes(tmp_path: Path):
    torch.save(named_as_served(hidden=32).state_dict(), tmp_path / "trained.pt")
    config = write_config(tmp_path)
    assert_refused(
        serve(config, cwd=tmp_path),
        f"{config}: [models.mylstm]",
        "hidden_size = 16",
        "lstm.weight_hh_l0 is (128, 32) in the file, the config needs (64, 16)",
        "Set the sizes in [models.mylstm] to those the weights were trained with",
    )


def test_a_builder_that_does_not_import_names_pythonpath(tmp_path: Path):
    config = write_config(tmp_path, model="")
    config.write_text(config.read_text().replace("batchmaker.common.models.lstm:build", "mycells.mgu:build"))
    assert_refused(
        serve(config, cwd=tmp_path),
        "cannot import builder 'mycells.mgu:build': No module named 'mycells'",
        f"config's folder and the working directory ({tmp_path}",
        "PYTHONPATH",
    )


def test_a_model_key_typo_names_the_config_file(tmp_path: Path):
    config = write_config(tmp_path, model="hiden_size = 16")
    assert_refused(serve(config, cwd=tmp_path), f"{config}: [models.mylstm] unknown key(s) ['hiden_size']")


def test_a_busy_client_port_suggests_another_address(tmp_path: Path):
    torch.save(named_as_served().state_dict(), tmp_path / "trained.pt")
    config = write_config(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        result = serve(config, "--address", address, cwd=tmp_path)
    assert_refused(result, f"address {address} is in use", f"batchmaker serve {config} --address tcp://127.0.0.1:")


def test_a_busy_metrics_port_is_one_line_naming_the_port_and_the_option(tmp_path: Path):
    torch.save(named_as_served().state_dict(), tmp_path / "trained.pt")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(write_config(tmp_path, server=f'metrics_address = "127.0.0.1:{port}"'), cwd=tmp_path)
    message = assert_refused(result, f"port {port} is in use", "--metrics-address 127.0.0.1:")
    assert len(message.strip().splitlines()) == 1, message


def test_a_malformed_metrics_option_is_refused(tmp_path: Path):
    torch.save(named_as_served().state_dict(), tmp_path / "trained.pt")
    result = serve(write_config(tmp_path), "--metrics-address", "9100", cwd=tmp_path)
    assert_refused(result, '--metrics-address must look like "127.0.0.1:9100"')
