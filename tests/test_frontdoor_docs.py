"""The front door's examples in docs/protocol.md and README.md run as written against a real server (its
ports put in for 8000 and 8001), and their answers equal the reference."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from conftest import ROOT
from oip_server import Door, close

DOCS = [ROOT / "docs" / "protocol.md", ROOT / "README.md"]


def blocks(language: str, containing: str) -> list[str]:
    found = []
    for doc in DOCS:
        found += re.findall(rf"^```{language}\n(.*?)^```", doc.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [block for block in found if containing in block]


def on_door(text: str, door: Door) -> str:
    return text.replace("127.0.0.1:8000", door.http).replace("127.0.0.1:8001", door.grpc)


def run_curl(block: str, door: Door) -> list[dict]:
    done = subprocess.run(["bash", "-e", "-c", on_door(block, door)], capture_output=True, text=True, check=True)
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert answers and all("error" not in answer for answer in answers), done.stdout
    return answers


def test_the_curl_examples_answer_as_the_reference(door: Door):
    if shutil.which("curl") is None:
        pytest.skip("curl is not on PATH")
    health, metadata, infer = run_curl(blocks("sh", "/v2/health/ready")[0], door)
    assert health == {"ready": True} and metadata["name"] == "lstm"
    assert close(
        np.array(infer["outputs"][0]["data"], dtype=np.float32), door.reference("lstm", {"tokens": [5, 17, 342]})["h"]
    )

    *_, last = run_curl(blocks("sh", "sequence_id")[0], door)
    whole = door.reference("lstm", {"tokens": [5, 17, 342, 8, 9, 40, 41, 42, 43]})["h_n"]
    assert close(np.array(last["outputs"][0]["data"], dtype=np.float32).reshape(1, -1), whole)

    [readme] = run_curl(blocks("sh", "5, 17, 342, 9")[0], door)
    h = next(output for output in readme["outputs"] if output["name"] == "h")
    assert close(np.array(h["data"], dtype=np.float32), door.reference("lstm", {"tokens": [5, 17, 342, 9]})["h"])


def test_the_readme_tritonclient_example_runs(door: Door):
    [block] = blocks("python", "tritonclient")
    namespace: dict = {}
    exec(compile(on_door(block, door), "README.md", "exec"), namespace)  # noqa: S102
    assert close(namespace["h"], door.reference("lstm", {"tokens": [5, 17, 342, 9]})["h"])
