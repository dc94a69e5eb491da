"""What the command lines print, run as a user runs them (subprocesses, against a real server):
`models` in a few lines a model (or `--json`), a closed pipe that ends a command quietly, `stats`
that counts control calls apart from inference requests, `infer --session`, and `--text`'s vocabulary."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_LSTM, RunningServer, write_config
from test_cli_address import CLIENT, COMMANDS, TOKENS, infer_h, reference_h, run
from test_serve_cli import BATCHMAKER

from batchmaker.clients import ServerError
from batchmaker.clients.cli_output import CLOSED_PIPE_STATUS

PRINTING = [["health"], ["models"], ["models", "--json"], ["stats"], ["infer", "--model", "lstm", "--tokens", "1 2"]]


def at(server: RunningServer) -> dict[str, str]:
    return {"BATCHMAKER_ADDRESS": server.address}


def test_models_prints_a_few_lines_a_model_with_shapes_on_one_line(lstm_server: RunningServer):
    result = run([BATCHMAKER], "models", env=at(lstm_server))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "protocol version 1",
        "lstm: kind lstm, vocab_size 1000, random_weights",
        "  inputs:  tokens int64 [-1] (max_length 200), h0 float32 [1, 64] (optional), c0 float32 [1, 64] (optional)",
        "  outputs: h float32 [64], c float32 [64], h_n float32 [1, 64], c_n float32 [1, 64]",
        "  cells:   lstm/layer0 (batch_sizes [1, 2, 4, 8, 16, 32], priority 0)",
        "  versions: 1 ready",
    ]
    as_json = run(CLIENT, "models", "--json", env=at(lstm_server))
    with lstm_server.client() as client:
        expected = {key: value for key, value in client.models().items() if key not in ("id", "ok")}
    assert json.loads(as_json.stdout) == expected


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("subcommand", PRINTING)
def test_a_closed_pipe_ends_a_command_quietly(name: str, subcommand: list[str], lstm_server: RunningServer):
    result = run_into_closed_pipe([*COMMANDS[name], *subcommand], at(lstm_server))
    assert (result.returncode, result.stderr) == (CLOSED_PIPE_STATUS, "")


def test_a_closed_pipe_ends_init_weights_quietly(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM)
    config.models["lstm"].weights.unlink()  # so that it has a line to print
    result = run_into_closed_pipe([BATCHMAKER, "init-weights", str(config.path)], {})
    assert (result.returncode, result.stderr) == (CLOSED_PIPE_STATUS, "")
    assert config.models["lstm"].weights.exists()


def run_into_closed_pipe(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command with its stdout a pipe whose reader is gone, as in `batchmaker stats | head` once head has read."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        base = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "BATCHMAKER_ADDRESS")}
        return subprocess.run(
            command, env={**base, **env}, stdout=writer, stderr=subprocess.PIPE, text=True, timeout=120, check=False
        )
    finally:
        os.close(writer)


def test_stats_counts_control_calls_apart_from_requests(lstm_server: RunningServer):
    with lstm_server.client() as client:
        before = client.stats()
        assert run([BATCHMAKER], "models", env=at(lstm_server)).returncode == 0  # a health check, then models
        assert run([BATCHMAKER], "health", env=at(lstm_server)).returncode == 0  # a health check, then health
        assert infer_h(
            run([BATCHMAKER], "infer", "--model", "lstm", "--tokens", "1 2", "--json", env=at(lstm_server))
        ).shape == (64,)
        with pytest.raises(ServerError, match="BAD_REQUEST"):
            client.call({"op": "cancel"})  # a refused control call: still a control call
        with pytest.raises(ServerError, match="BAD_REQUEST"):
            client.call({"op": "reboot"})  # not an op at all: a refused request
        printed = run([BATCHMAKER], "stats", env=at(lstm_server))  # a health check, then stats
    assert printed.returncode == 0, printed.stderr
    after = json.loads(printed.stdout)
    calls = {op: after["control_calls"][op] - before["control_calls"][op] for op in after["control_calls"]}
    # each command's health check, and health itself
    assert calls == {"models": 1, "health": 5, "stats": 1, "cancel": 1, "load": 0, "unload": 0, "reload": 0}
    requests = {
        key: after["requests"].get(key, 0) - before["requests"].get(key, 0) for key in ("received", "ok", "BAD_REQUEST")
    }
    assert requests == {"received": 2, "ok": 1, "BAD_REQUEST": 1}
    assert after["requests"]["received"] == sum(n for key, n in after["requests"].items() if key != "received")


def session_infer(server: RunningServer, tokens: list[int], *session: str) -> dict:
    result = run(
        [BATCHMAKER], "infer", "--model", "lstm", "--tokens", " ".join(map(str, tokens)),
        "--json", *session, env=at(server),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_session_continues_across_calls_that_keep_nothing(lstm_server: RunningServer):
    first = session_infer(lstm_server, TOKENS[:2], "--session", "cli-chunks")
    assert first["session_step"] == 1
    second = session_infer(lstm_server, TOKENS[2:], "--session", "cli-chunks", "--session-step", "1", "--session-end")
    assert second["session_step"] == 2
    assert np.abs(np.asarray(second["outputs"]["h"], np.float32) - reference_h(lstm_server, TOKENS)).max() <= 1e-5
    again = session_infer(lstm_server, TOKENS[2:], "--session", "cli-chunks")  # ended: the name starts from zeros
    assert again["session_step"] == 1
    assert np.abs(np.asarray(again["outputs"]["h"], np.float32) - reference_h(lstm_server, TOKENS[2:])).max() <= 1e-5

    printed = run(
        [BATCHMAKER], "infer", "--model", "lstm", "--tokens", "7", "--session", "cli-chunks", "--session-end",
        env=at(lstm_server),
    )
    assert printed.returncode == 0 and printed.stdout.splitlines()[-1] == "session_step: 2", printed.stdout


def test_a_session_the_server_does_not_hold_is_lost_not_restarted(lstm_server: RunningServer):
    result = run(
        [BATCHMAKER], "infer", "--model", "lstm", "--tokens", "7", "--session", "cli-never", "--session-step", "3",
        env=at(lstm_server),
    )
    assert result.returncode == 1 and result.stderr.startswith("error SESSION_LOST: "), result.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--session-end"], "--session-end and --session-step go with a session: name it with --session NAME"),
        (["--session-step", "2"], "--session-end and --session-step go with a session: name it with --session NAME"),
        (["--session", "s", "--stream"], "--stream cannot carry a session"),
    ],
)
def test_session_options_without_a_session_or_with_a_stream_are_refused(
    options: list[str], message: str, lstm_server: RunningServer
):
    result = run([BATCHMAKER], "infer", "--model", "lstm", "--tokens", "7", *options, env=at(lstm_server))
    assert result.returncode == 1 and result.stderr.startswith(f"error USAGE: {message}"), result.stderr


def test_text_is_encoded_with_vocab_and_a_missing_vocabulary_names_the_option(
    lstm_server: RunningServer, tmp_path: Path
):
    sentence = "the committee approved the report"
    words = sorted(set(sentence.split()))
    vocabulary = tmp_path / "vocab.txt"
    vocabulary.write_text("<pad>\n<unk>\n<s>\n</s>\n" + "\n".join(words) + "\n")
    result = run(
        CLIENT, "infer", "--model", "lstm", "--text", sentence, "--vocab", str(vocabulary), "--json",
        env=at(lstm_server),
    )
    ids = [4 + words.index(word) for word in sentence.split()]
    assert np.abs(infer_h(result) - reference_h(lstm_server, ids)).max() <= 1e-5

    missing = tmp_path / "missing.txt"
    result = run(CLIENT, "infer", "--model", "lstm", "--text", sentence, "--vocab", str(missing), env=at(lstm_server))
    assert result.returncode == 1
    assert result.stderr.startswith(f"error USAGE: cannot read the vocabulary {missing} (No such file or directory)")
    assert "--vocab FILE" in result.stderr and "--tokens" in result.stderr, result.stderr
