"""Who may call what on the front door, against a real server with tritonclient.http, tritonclient.grpc and curl:
loading and unloading models takes the control token ([http] / [grpc] control_token_file) and no other, is off
on a listener that is not loopback when there is none, and the health calls answer anyone over both transports.
(On loopback without a control token, load and unload take the token as every call does:
tests/test_frontdoor_repository.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import SMALL_LSTM, stop_server
from oip_server import Door, start_door
from tritonclient.utils import InferenceServerException

from batchmaker.frontdoor.errors import FORBIDDEN, DoorError
from batchmaker.frontdoor.guards import Call, Credentials

TOKEN, CONTROL_TOKEN = "inference-token", "control-token"
AUTH, CONTROL = {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": f"Bearer {CONTROL_TOKEN}"}
GRPC_AUTH, GRPC_CONTROL = {"authorization": f"Bearer {TOKEN}"}, {"authorization": f"Bearer {CONTROL_TOKEN}"}
TOKENS = 'token_file = "token"\n'
BOTH_TOKENS = TOKENS + 'control_token_file = "control-token"\n'


def write_tokens(directory: Path) -> Path:
    (directory / "token").write_text(TOKEN + "\n")
    (directory / "control-token").write_text(CONTROL_TOKEN + "\n")
    return directory


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    """On loopback, with both tokens on both ports."""
    directory = write_tokens(tmp_path_factory.mktemp("guarded"))
    door = start_door(directory, SMALL_LSTM, http_extra=BOTH_TOKENS, grpc_extra=BOTH_TOKENS)
    yield door
    stop_server(door.server)


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    """Listening on every address, with the token and no control token."""
    directory = write_tokens(tmp_path_factory.mktemp("exposed"))
    door = start_door(directory, SMALL_LSTM, http_extra=TOKENS, grpc_extra=TOKENS, host="0.0.0.0")
    yield door
    stop_server(door.server)


def curl(url: str, *options: str) -> tuple[int, dict]:
    """A call with curl: its status and its JSON answer."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not on PATH")
    done = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", *options, url], capture_output=True, text=True, check=True
    )
    body, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(body)


def post_with(door: Door, path: str, token: str) -> tuple[int, dict]:
    return curl(f"http://{door.http}{path}", "-X", "POST", "-H", f"Authorization: Bearer {token}")


def versions(door: Door) -> dict[str, str]:
    """Each version of lstm and its state, from the repository index."""
    entries = httpclient.InferenceServerClient(door.http).get_model_repository_index(headers=AUTH)
    return {entry["version"]: entry["state"] for entry in entries}


def refusal(call: Callable[..., Any], *args: Any, **kwargs: Any) -> InferenceServerException:
    """The error a tritonclient call raises."""
    with pytest.raises(InferenceServerException) as refused:
        call(*args, **kwargs)
    return refused.value


def test_load_and_unload_take_the_control_token_and_no_other(guarded: Door):
    http = httpclient.InferenceServerClient(guarded.http)
    grpc = grpcclient.InferenceServerClient(guarded.grpc)
    for headers, metadata in (({}, {}), (AUTH, GRPC_AUTH)):
        refused = refusal(http.load_model, "lstm", headers=headers)
        assert refused.status() == "401" and "[http] control_token_file" in refused.message()
        refused = refusal(grpc.unload_model, "lstm", headers=metadata)
        assert refused.status() == "StatusCode.UNAUTHENTICATED"
        assert "the metadata 'authorization: Bearer <control token>'" in refused.message()
        assert "[grpc] control_token_file" in refused.message()
    status, answer = post_with(guarded, "/v2/repository/models/lstm/unload", TOKEN)
    assert status == 401 and answer["error"] == (
        "UNAUTHENTICATED: loading and unloading models needs the header 'Authorization: Bearer <control token>', "
        "with the token of [http] control_token_file"
    )
    assert versions(guarded) == {"1": "READY"}  # nothing refused changed a thing

    status, answer = post_with(guarded, "/v2/repository/models/lstm/load", CONTROL_TOKEN)
    assert (status, answer) == (200, {"name": "lstm", "version": "2"})
    grpc.load_model("lstm", headers=GRPC_CONTROL)
    assert versions(guarded)["3"] == "READY"
    refused = refusal(http.get_model_metadata, "lstm", headers=CONTROL)
    assert refused.status() == "401"  # the control token is not the token of other calls
    http.unload_model("lstm", headers=CONTROL)
    assert set(versions(guarded).values()) <= {"UNLOADING", "UNAVAILABLE"}


def test_health_calls_answer_without_a_token_and_the_rest_need_it(exposed: Door):
    http = httpclient.InferenceServerClient(exposed.http)
    grpc = grpcclient.InferenceServerClient(exposed.grpc)
    for headers in ({}, {"authorization": "Bearer wrong"}):
        assert grpc.is_server_live(headers=headers) and grpc.is_server_ready(headers=headers)
        assert grpc.is_model_ready("lstm", headers=headers) and grpc.is_model_ready("lstm", "1", headers=headers)
        assert not grpc.is_model_ready("missing", headers=headers)
        assert http.is_server_live(headers=headers) and http.is_server_ready(headers=headers)
        assert http.is_model_ready("lstm", headers=headers) and http.is_model_ready("lstm", "1", headers=headers)
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/lstm/ready"):
        assert curl(f"http://{exposed.http}{path}")[0] == 200
    # open to anyone, a model's readiness names no other model
    assert curl(f"http://{exposed.http}/v2/models/missing/ready") == (
        404,
        {"error": "UNKNOWN_MODEL: model 'missing' is not ready"},
    )
    assert curl(f"http://{exposed.http}/v2/models/lstm/versions/7/ready") == (
        404,
        {"error": "UNKNOWN_MODEL: version '7' of model 'lstm' is not ready"},
    )
    refused = refusal(grpc.get_server_metadata)
    assert refused.status() == "StatusCode.UNAUTHENTICATED"
    assert refused.message().endswith("this server needs the metadata 'authorization: Bearer <token>'")
    assert grpc.get_server_metadata(headers=GRPC_AUTH).name == "batchmaker"
    item = grpcclient.InferInput("tokens", [2], "INT64")
    item.set_data_from_numpy(np.array([3, 4], dtype=np.int64))
    assert refusal(grpc.infer, "lstm", [item]).status() == "StatusCode.UNAUTHENTICATED"
    status, answer = curl(f"http://{exposed.http}/v2")
    assert (
        status == 401
        and answer["error"] == "UNAUTHENTICATED: this server needs the header 'Authorization: Bearer <token>'"
    )


def test_without_a_control_token_load_and_unload_are_off_on_an_address_beyond_loopback(exposed: Door):
    http = httpclient.InferenceServerClient(exposed.http)
    grpc = grpcclient.InferenceServerClient(exposed.grpc)
    port = exposed.http.rpartition(":")[2]
    for path in ("load", "unload"):
        status, answer = post_with(exposed, f"/v2/repository/models/lstm/{path}", TOKEN)
        assert status == 403 and answer["error"] == (
            f"FORBIDDEN: loading and unloading models is off on 0.0.0.0:{port}, which is not a loopback address: "
            "set [http] control_token_file to a file holding a token of its own, and send the header "
            "'Authorization: Bearer <that token>'"
        )
    refused = refusal(http.unload_model, "lstm", headers=AUTH)
    assert refused.status() == "403"
    for call in (grpc.load_model, grpc.unload_model):
        refused = refusal(call, "lstm", headers=GRPC_AUTH)
        assert refused.status() == "StatusCode.PERMISSION_DENIED"
        assert "set [grpc] control_token_file" in refused.message()
    assert versions(exposed) == {"1": "READY"}  # the index is an ordinary call: the token is enough


@pytest.mark.parametrize(
    ("address", "open_without_a_control_token"),
    [("127.0.0.1:8000", True), ("127.9.9.9:8000", True), ("localhost:8000", True), ("[::1]:8001", True),
     ("0.0.0.0:8000", False), ("[::]:8001", False), ("10.1.2.3:8000", False), ("my-host:8000", False)],
)  # fmt: skip
def test_model_control_without_a_control_token_is_open_on_loopback_only(
    address: str, open_without_a_control_token: bool
):
    credentials = Credentials("http", address, "the header 'Authorization: Bearer {}'", None, None)
    credentials.check(Call.SERVICE, "")  # no token at all: every other call is open
    if open_without_a_control_token:
        credentials.check(Call.CONTROL, "")
    else:
        with pytest.raises(DoorError) as refused:
            credentials.check(Call.CONTROL, "")
        assert refused.value.code == FORBIDDEN and f"is off on {address}" in refused.value.message
