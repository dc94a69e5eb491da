"""docs/quickstart.md runs as written, in a folder of its own: its Python files and config are
saved under their names, and its commands run one by one with the project's `batchmaker` on PATH
(the server a command starts with `&` runs in the background until `kill %1`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, free_port

from batchmaker.manager.commands.launcher import stop_server

DOC = ROOT / "docs" / "quickstart.md"
DOC_PORT = "5600"
MAX_COMMANDS = 9  # "in under ten commands"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), flags=re.DOTALL | re.MULTILINE)


def test_the_quickstart_serves_a_trained_lstm_and_checks_its_answer(tmp_path: Path):
    port = str(free_port())
    for source in blocks("python"):
        name = source.splitlines()[0].removeprefix("# ")
        (tmp_path / name).write_text(source)
    (config,) = blocks("toml")
    (tmp_path / "mylstm.toml").write_text(config.replace(DOC_PORT, port))
    (commands,) = blocks("sh")
    lines = commands.strip().splitlines()
    assert len(lines) <= MAX_COMMANDS
    assert lines[0].startswith("source ") and lines[0].endswith("/.venv/bin/activate")  # what the PATH below does
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    server = None
    try:
        for line in lines[1:]:
            line = line.replace(DOC_PORT, port)
            if line.endswith(" &"):
                # no shell: it is the server
                server = subprocess.Popen(shlex.split(line.removesuffix(" &")), cwd=tmp_path, env=env)
            elif line == "kill %1":
                assert server is not None and stop_server(server) == []
                server = None
            else:
                result = subprocess.run(
                    line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
                )
                assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
                if line.startswith("python check.py"):
                    assert "the served answer is the trained model's" in result.stdout
                if line.startswith("python train.py"):
                    assert "SERVES RANDOM" not in result.stderr
    finally:
        if server is not None:
            stop_server(server)
    assert server is None, "the quickstart's commands leave the server running"
