"""Model versions and Triton's model repository extension through the Open Inference Protocol front door,
called with tritonclient.http and tritonclient.grpc against a real server: a reload under a steady load, a
sequence kept on its version, a load refused, an unload; every answer equals the reference of the version
that served it."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Self

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ROOT, SMALL_LSTM, stop_server, wait_until
from oip_server import Door, start_door
from test_frontdoor_docs import on_door
from test_frontdoor_http import post
from test_frontdoor_tracing import TAGGER
from test_model_control import assert_matches, reference, weights_file
from tritonclient.utils import InferenceServerException

TOKEN = "repository-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = {"authorization": f"Bearer {TOKEN}"}


def tokens_input(module: Any, tokens: np.ndarray) -> Any:
    item = module.InferInput("tokens", [len(tokens)], "INT64")
    item.set_data_from_numpy(tokens)
    return item


def weights_config(path: Path) -> str:
    """Triton's `config` parameter naming the weights file, as tritonclient's load_model sends it."""
    return json.dumps({"parameters": {"weights": {"string_value": str(path)}}})


def answer(result: Any) -> tuple[str, dict[str, np.ndarray]]:
    """The version that served a tritonclient result (HTTP's JSON, or gRPC's message) and its outputs."""
    response = result.get_response()
    version = response["model_version"] if isinstance(response, dict) else response.model_version
    return version, {name: result.as_numpy(name) for name in ("h", "c")}


class SteadyLoad:
    """Threads sending `lstm` requests back to back through the HTTP door until stopped; every answer kept."""

    def __init__(self, door: Door, threads: int = 3):
        self.answers: list[tuple[list[int], str, dict[str, np.ndarray]]] = []
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(door, seed), daemon=True) for seed in range(threads)]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def seen(self, version: str) -> int:
        return sum(1 for _, served, _ in list(self.answers) if served == version)

    def _run(self, door: Door, seed: int) -> None:
        triton = httpclient.InferenceServerClient(door.http)
        rng = np.random.default_rng(seed)
        while not self._stop.is_set():
            tokens = rng.integers(0, 1000, size=int(rng.integers(1, 40))).astype(np.int64)
            try:
                served, outputs = answer(triton.infer("lstm", [tokens_input(httpclient, tokens)], headers=AUTH))
                self.answers.append((tokens.tolist(), served, outputs))
            except Exception as exc:
                self.failures.append(exc)


def index(triton: httpclient.InferenceServerClient) -> dict[str, tuple[str, str]]:
    return {entry["version"]: (entry["state"], entry["reason"]) for entry in triton.get_model_repository_index(AUTH)}


@pytest.fixture
def served(tmp_path: Path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    token = 'token_file = "token"\n'
    door = start_door(tmp_path, SMALL_LSTM, http_extra=token, grpc_extra=token)
    yield door
    stop_server(door.server)


def test_a_reload_through_the_repository_under_load_fails_nothing_and_a_sequence_keeps_its_version(served: Door):
    door = served
    new = weights_file(door.config, "lstm-retrained.pt", seed=11)
    references = {"1": reference(door.config, door.config.models["lstm"].weights), "2": reference(door.config, new)}
    http = httpclient.InferenceServerClient(door.http)
    grpc = grpcclient.InferenceServerClient(door.grpc)
    first, rest = np.array([5, 6, 7], dtype=np.int64), np.array([8, 9], dtype=np.int64)

    def sequence_step(chunk: np.ndarray, **parameters: Any) -> Any:
        inputs = [tokens_input(grpcclient, chunk)]
        return grpc.infer("lstm", inputs, sequence_id=7, headers=GRPC_AUTH, **parameters)

    with SteadyLoad(door) as load:
        assert answer(sequence_step(first, sequence_start=True))[0] == "1"
        wait_until(lambda: load.seen("1") >= 10, "answers of version 1")
        grpc.load_model("lstm", config=weights_config(new), headers=GRPC_AUTH)
        wait_until(lambda: load.seen("2") >= 10, "answers of version 2")
        # The sequence still holds version 1: it drains, and serves no request that names it.
        assert index(http) == {"1": ("UNLOADING", "draining: it finishes the requests it started, then unloads"),
                               "2": ("READY", "")}  # fmt: skip
        grpc_index = grpc.get_model_repository_index(headers=GRPC_AUTH, as_json=True)["models"]
        assert {(e["version"], e["state"]) for e in grpc_index} == {("1", "UNLOADING"), ("2", "READY")}
        assert http.get_model_metadata("lstm", headers=AUTH)["versions"] == ["2"]
        assert http.get_model_metadata("lstm", "2", headers=AUTH)["versions"] == ["2"]
        assert grpc.get_model_metadata("lstm", "2", headers=GRPC_AUTH).versions == ["2"]
        assert http.is_model_ready("lstm", "2", headers=AUTH) and not http.is_model_ready("lstm", "1", headers=AUTH)
        assert grpc.is_model_ready("lstm", "2", headers=GRPC_AUTH)
        assert not grpc.is_model_ready("lstm", "1", headers=GRPC_AUTH)
        with pytest.raises(InferenceServerException) as gone:
            http.get_model_metadata("lstm", "1", headers=AUTH)
        assert gone.value.status() == "404" and "no ready version 1; ready: 2" in gone.value.message()
        with pytest.raises(InferenceServerException) as named:
            http.infer("lstm", [tokens_input(httpclient, rest)], model_version="1", headers=AUTH)
        assert named.value.status() == "404" and "no ready version 1; ready: 2" in named.value.message()
        with pytest.raises(InferenceServerException) as named_over_grpc:
            grpc.infer("lstm", [tokens_input(grpcclient, rest)], model_version="1", headers=GRPC_AUTH)
        assert named_over_grpc.value.status() == "StatusCode.NOT_FOUND"
        assert "no ready version 1; ready: 2" in named_over_grpc.value.message()
        pinned = answer(http.infer("lstm", [tokens_input(httpclient, rest)], model_version="2", headers=AUTH))
        over_grpc = answer(grpc.infer("lstm", [tokens_input(grpcclient, rest)], model_version="2", headers=GRPC_AUTH))
        with pytest.raises(InferenceServerException) as elsewhere:
            sequence_step(rest, model_version="2")
        assert elsewhere.value.status() == "StatusCode.INVALID_ARGUMENT"
        ended = answer(sequence_step(rest, sequence_end=True))
    assert not load.failures and load.seen("1") and load.seen("2")
    for tokens, version, outputs in load.answers:
        assert_matches(outputs, references[version]({"tokens": tokens}))
    assert pinned[0] == over_grpc[0] == "2"
    assert_matches(pinned[1], references["2"]({"tokens": rest.tolist()}))
    assert_matches(over_grpc[1], references["2"]({"tokens": rest.tolist()}))
    assert ended[0] == "1"  # started before the reload: it ends on the weights it started with
    assert_matches(ended[1], references["1"]({"tokens": [*first.tolist(), *rest.tolist()]}))
    wait_until(lambda: index(http)["1"] == ("UNAVAILABLE", "unloaded"), "version 1 unloaded once its sequence ended")

    http.unload_model("lstm", headers=AUTH)
    wait_until(lambda: set(index(http).values()) == {("UNAVAILABLE", "unloaded")}, "every version unloaded")
    for call in (
        lambda: http.infer("lstm", [tokens_input(httpclient, rest)], headers=AUTH),
        lambda: http.get_model_metadata("lstm", headers=AUTH),
    ):
        with pytest.raises(InferenceServerException) as unloaded:
            call()
        assert unloaded.value.status() == "404" and "no model named 'lstm'" in unloaded.value.message()
    with pytest.raises(InferenceServerException) as unloaded:
        grpc.infer("lstm", [tokens_input(grpcclient, rest)], headers=GRPC_AUTH)
    assert unloaded.value.status() == "StatusCode.NOT_FOUND"
    assert not http.is_model_ready("lstm", headers=AUTH)


def test_a_load_with_a_bad_weights_path_is_refused_and_the_old_version_serves_on(served: Door):
    door = served
    http = httpclient.InferenceServerClient(door.http)
    grpc = grpcclient.InferenceServerClient(door.grpc)
    missing = door.config.path.parent / "missing.pt"
    body = json.dumps({"parameters": {"weights": str(missing)}}).encode()
    status, refusal, _ = post(door, "/v2/repository/models/lstm/load", body, AUTH)
    assert status == 400 and refusal["error"].startswith("BAD_REQUEST: version 2 of model 'lstm'")
    assert str(missing) in refusal["error"]
    with pytest.raises(InferenceServerException) as refused:
        grpc.load_model("lstm", config=weights_config(missing), headers=GRPC_AUTH)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and str(missing) in refused.value.message()
    with pytest.raises(InferenceServerException) as refused_over_http:
        http.load_model("lstm", headers=AUTH, config=weights_config(missing))
    assert refused_over_http.value.status() == "400" and str(missing) in refused_over_http.value.message()
    entries = index(http)
    assert entries["1"] == ("READY", "")
    assert {entries[v][0] for v in ("2", "3", "4")} == {"UNAVAILABLE"} and str(missing) in entries["2"][1]
    status, ready, _ = post(door, "/v2/repository/index", b'{"ready": true}', AUTH)
    assert status == 200 and ready == [{"name": "lstm", "version": "1", "state": "READY", "reason": ""}]
    tokens = np.array([3, 1, 4, 1, 5], dtype=np.int64)
    version, outputs = answer(http.infer("lstm", [tokens_input(httpclient, tokens)], headers=AUTH))
    assert version == "1"
    assert_matches(outputs, reference(door.config, door.config.models["lstm"].weights)({"tokens": tokens.tolist()}))
    assert http.get_model_metadata("lstm", headers=AUTH)["versions"] == ["1"]
    grpc.unload_model("lstm", headers=GRPC_AUTH)
    with pytest.raises(InferenceServerException) as unloaded:
        grpc.infer("lstm", [tokens_input(grpcclient, tokens)], headers=GRPC_AUTH)
    assert unloaded.value.status() == "StatusCode.NOT_FOUND" and "no model named 'lstm'" in unloaded.value.message()


def test_the_repository_calls_need_the_token(served: Door):
    for path, body in [
        ("/v2/repository/index", b""),
        ("/v2/repository/models/lstm/load", b"{}"),
        ("/v2/repository/models/lstm/unload", b"{}"),
    ]:
        status, refusal, _ = post(served, path, body)
        assert status == 401 and refusal["error"].startswith("UNAUTHENTICATED")
    grpc = grpcclient.InferenceServerClient(served.grpc)
    for call in (lambda: grpc.unload_model("lstm"), lambda: grpc.get_model_repository_index()):
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    assert index(httpclient.InferenceServerClient(served.http)) == {"1": ("READY", "")}  # nothing changed


@pytest.mark.parametrize(
    "parameters, words",
    [
        ({"file:1/model.pt": "AAAA"}, "the server loads files from its own disk"),
        ({"weights": 5}, "load parameter weights must be a path (a string), got 5"),
        ({"colour": "blue"}, "unknown load parameter 'colour'; a load takes: weights, config_file, config"),
        ({"config": "{not json"}, "load parameter config is not JSON"),
        ({"config": "[1]"}, "load parameter config must be a JSON object"),
        ({"config": '{"max_batch_size": 8}'}, "config's 'max_batch_size' has no meaning here"),
        ({"config": '{"name": "gru"}'}, "config names model 'gru', not 'lstm'"),
        ({"config": '{"parameters": {"weights": "a.pt"}}'}, "config parameter 'weights' must be {\"string_value\""),
        (
            {"weights": "a.pt", "config": '{"parameters": {"weights": {"string_value": "b.pt"}}}'},
            "load parameter 'weights' is given twice",
        ),
    ],
)
def test_load_parameters_that_do_not_map_onto_a_load_are_refused(door: Door, parameters: dict, words: str):
    """Refused by the front door before the server is asked: the shared server's models stay as they are."""
    status, refusal, _ = post(door, "/v2/repository/models/lstm/load", json.dumps({"parameters": parameters}).encode())
    assert status == 400 and refusal["error"].startswith("INVALID_INPUT: ") and words in refusal["error"]


def test_repository_calls_with_a_bad_body_or_a_model_not_served_are_refused(door: Door):
    for path in ("/v2/repository/index", "/v2/repository/models/lstm/load", "/v2/repository/models/lstm/unload"):
        status, refusal, _ = post(door, path, b"{not json")
        assert status == 400 and refusal["error"].startswith("BAD_REQUEST: the request is not JSON")
        status, refusal, _ = post(door, path, b"[]")
        assert status == 400 and refusal["error"] == "BAD_REQUEST: the request must be a JSON object"
    status, refusal, _ = post(door, "/v2/repository/index", b'{"ready": "yes"}')
    assert status == 400 and refusal["error"] == "BAD_REQUEST: 'ready' must be true or false, got 'yes'"
    status, refusal, _ = post(door, "/v2/repository/models/missing/unload", b"")
    assert status == 404 and refusal["error"].startswith("UNKNOWN_MODEL: no model named 'missing'")
    status, refusal, _ = post(door, "/v2/repository/models/missing/load", b"")
    assert status == 400 and "no model named 'missing' was served here" in refusal["error"]
    grpc = grpcclient.InferenceServerClient(door.grpc)
    with pytest.raises(InferenceServerException) as uploaded:
        grpc.load_model("lstm", config="{}", files={"file:1/model.pt": b"weights"})
    assert uploaded.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "the server loads files from its own disk" in uploaded.value.message()
    with pytest.raises(InferenceServerException) as unloaded:
        grpc.unload_model("missing")
    assert unloaded.value.status() == "StatusCode.NOT_FOUND"
    status, refusal, _ = post(door, "/v2/models/lstm/versions/first/infer", b'{"inputs": []}')
    assert status == 404 and "model 'lstm' has no version 'first': versions are 1, 2, ..." in refusal["error"]
    entries = httpclient.InferenceServerClient(door.http).get_model_repository_index()
    assert {entry["state"] for entry in entries} == {"READY"}  # nothing was loaded or unloaded


def test_the_deploy_guides_curl_example_loads_lists_and_unloads(tmp_path: Path):
    """The curl block of docs/deploy.md, "Rolling out new weights", run as written (its ports and weights path
    put in): lstm's version 2 serves the new weights' answers, and tagger is no longer served."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not on PATH")
    section = (ROOT / "docs" / "deploy.md").read_text().split("\n## Rolling out new weights\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    door = start_door(tmp_path, SMALL_LSTM + TAGGER)
    try:
        new = weights_file(door.config, "lstm-2026-11-26.pt", seed=3)
        script = on_door(block, door).replace("/models/lstm-2026-11-26.pt", str(new))
        done = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True, check=True)
        loaded, listed, unloaded = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        assert loaded == {"name": "lstm", "version": "2"} and unloaded == {}
        states = {(entry["name"], entry["version"]): entry["state"] for entry in listed}
        assert states[("lstm", "2")] == states[("tagger", "1")] == "READY"
        assert states[("lstm", "1")] in ("UNLOADING", "UNAVAILABLE")  # drained as soon as nothing uses it
        http = httpclient.InferenceServerClient(door.http)
        tokens = np.array([7, 7, 9], dtype=np.int64)
        version, outputs = answer(http.infer("lstm", [tokens_input(httpclient, tokens)]))
        assert version == "2"
        assert_matches(outputs, reference(door.config, new)({"tokens": tokens.tolist()}))
        assert not http.is_model_ready("tagger")
    finally:
        stop_server(door.server)
