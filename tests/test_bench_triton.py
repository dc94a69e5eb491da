"""Triton's setups for `bench http`: what each one is and refuses, the model configuration and repository a
sequence setup writes for `tritonserver` (in Triton's own configuration format), and, where Triton runs here (an
environment with the `triton` extra, numpy < 2), every setup's answers against the reference model and its
failures to start as skips naming why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_LSTM, write_config

from batchmaker.bench import http, oip_load, triton_lstm, triton_sequence, triton_setups
from batchmaker.bench.http import Load, Plan
from batchmaker.bench.verify import compare_replies
from batchmaker.common.models import build_model

TOLERANCE = 1e-5


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        (("ragged", None, 1, None), "Triton has no ragged batcher here \\(only dynamic, sequence\\)"),
        (("dynamic", "direct", 1, None), "the dynamic batcher takes whole sentences, with no strategy"),
        (("sequence", "newest", 1, 4), "needs a strategy \\(oldest, direct\\) and at least one token a request"),
        (("sequence", "direct", 1, 0), "needs a strategy \\(oldest, direct\\) .* not direct and 0"),
        (("sequence", "direct", 0, 4), "Triton needs at least one model instance, not 0"),
    ],
)
def test_a_setup_that_cannot_be_is_refused_before_anything_starts(fields: tuple, error: str):
    with pytest.raises(ValueError, match=error):
        triton_setups.Setup("bad", *fields)


@pytest.mark.parametrize(
    ("option", "error"), [("--triton-instances=0", "model instance"), ("--triton-tokens=0", "token")]
)
def test_bench_http_refuses_a_setting_that_cannot_be_before_it_serves_anything(option: str, error: str, tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "batchmaker.bench", "http", "--quick", option, "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.startswith("http: ") and error in done.stderr
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_the_setups_are_one_instance_a_core_and_the_settings_given():
    dynamic, oldest, direct = triton_setups.setups()
    assert (dynamic.instances, direct.instances, oldest.instances) == (triton_setups.cores(),) * 2 + (1,)
    assert (direct.strategy, direct.tokens_per_request, oldest.strategy, oldest.tokens_per_request) == (
        "direct", 8, "oldest", 1
    )
    assert direct.text() == (
        f"sequence batcher, direct strategy, max batch 64, no queue delay, {triton_setups.cores()} model instance"
        f"{'s' if triton_setups.cores() > 1 else ''}, 8 tokens a request"
    )
    assert dynamic.text().startswith("dynamic batcher, max batch 64, 2 ms queue delay, ")
    assert dynamic.text().endswith(", one request a sentence")
    _, one, three = triton_setups.setups(instances=3, tokens_per_request=16)
    assert (three.instances, three.tokens_per_request, one.instances) == (3, 16, 1)
    assert three.record() == {
        "name": "sequence direct", "batcher": "sequence", "strategy": "direct", "instances": 3,
        "tokens_per_request": 16, "max_batch": 64, "max_queue_delay_us": 0, "text": three.text(),
    }  # fmt: skip


@pytest.mark.parametrize("setup", triton_setups.setups(instances=2)[1:], ids=lambda setup: setup.name)
def test_a_sequence_setups_model_configuration_is_tritons_own_format(tmp_path: Path, setup: triton_setups.Setup):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = write_config(tmp_path, SMALL_LSTM)
    parsed = text_format.Parse(triton_sequence.config_pbtxt(config.path, setup), model_config_pb2.ModelConfig())
    batching = parsed.sequence_batching
    assert parsed.backend == "python" and parsed.max_batch_size == 64
    assert batching.WhichOneof("strategy_choice") == setup.strategy
    assert getattr(batching, setup.strategy).max_queue_delay_microseconds == 0
    kinds = {control.name: control.control[0].kind for control in batching.control_input}
    assert kinds == {
        "START": model_config_pb2.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START,
        "END": model_config_pb2.ModelSequenceBatching.Control.CONTROL_SEQUENCE_END,
        "CORRID": model_config_pb2.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID,
        "READY": model_config_pb2.ModelSequenceBatching.Control.CONTROL_SEQUENCE_READY,
    }
    (tokens,) = parsed.input
    assert list(tokens.dims) == [-1] and tokens.allow_ragged_batch  # a sentence's last request may be shorter
    assert [(output.name, list(output.dims)) for output in parsed.output] == [("h", [64]), ("c", [64])]
    (group,) = parsed.instance_group
    assert group.count == setup.instances and group.kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert parsed.parameters["config"].string_value == str(config.path.resolve())


@pytest.mark.skipif(triton_lstm.missing() is not None, reason=f"Triton cannot run here: {triton_lstm.missing()}")
def test_a_sequence_setup_writes_a_model_repository_that_tritonserver_is_pointed_at(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM).path
    direct = triton_setups.setups(instances=2)[2]
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    command = triton_sequence.command(config, workspace, ["1", "2", "3"], direct)
    model = workspace / "models" / "lstm"
    assert (model / "config.pbtxt").read_text() == triton_sequence.config_pbtxt(config, direct)
    assert (model / "1" / "model.py").read_bytes() == triton_sequence.MODEL_PY.read_bytes()
    assert (workspace / "backends" / "python" / "triton_python_backend_stub").is_file()
    assert Path(command[0]).name == "tritonserver" and f"--model-repository={workspace / 'models'}" in command
    assert command[-3:] == ["--grpc-port=1", "--http-port=2", "--metrics-port=3"]


@pytest.mark.skipif(triton_lstm.missing() is None, reason="Triton runs here")
def test_each_setup_is_a_skip_naming_what_is_missing(tmp_path: Path):
    config = write_config(tmp_path, SMALL_LSTM).path
    load = Load.of(Plan((10.0,), seconds=0.5, verify_requests=1), [{"tokens": [5, 17]}])
    for setup in triton_setups.setups():
        skipped = {"setup": setup.record(), "skipped": triton_lstm.missing()}
        assert http.run_triton(config, setup, load, [], []) == skipped


@pytest.mark.skipif(triton_lstm.missing() is not None, reason=f"Triton cannot run here: {triton_lstm.missing()}")
@pytest.mark.parametrize("setup", triton_setups.setups(instances=2)[1:], ids=lambda setup: setup.name)
def test_the_sequence_batcher_answers_every_sentence_as_the_reference_and_refuses_a_bad_request_alone(
    tmp_path: Path, setup: triton_setups.Setup
):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    config = write_config(tmp_path, SMALL_LSTM)
    model = build_model(config.models["lstm"])
    state = model.load_weights()
    sentences = [[5, 17, 342, 9], [3] * 30, [999], [7, 10**6, 8], *([[1, 2, 3]] * 8), list(range(11))]  # 10**6: beyond
    with triton_lstm.TritonLSTM(config.path, setup) as triton:
        calls = setup.tokens_per_request
        target = oip_load.Target(triton.address, "lstm", http.OUTPUTS, batched=True, tokens_per_call=calls)
        # All at once: the direct strategy's batches then hold null requests for the slots between sequences.
        run = oip_load.open_loop(target, sentences, np.zeros(len(sentences)), keep_outputs=True)
        with grpcclient.InferenceServerClient(triton.address) as client:

            def send(tokens: list[int], start: bool) -> dict:
                tensor = target.tensor(tokens)
                return client.infer("lstm", [tensor], sequence_id=77, sequence_start=start, sequence_end=False)

            send([5, 6], start=True)
            with pytest.raises(InferenceServerException, match="token 1000 is outside the vocabulary \\(0 to 999\\)"):
                send([4, 1000], start=False)
            with pytest.raises(InferenceServerException, match="sequence 77 has no state: a request of it was refused"):
                send([5], start=False)
            with pytest.raises(InferenceServerException, match="a request of a sequence needs at least one token"):
                send([], start=True)
            send([5], start=True)  # the id starts afresh
    assert run.errors[3] is not None and run.errors.count(None) == len(sentences) - 1
    good = [i for i in range(len(sentences)) if i != 3]
    expected = [model.reference(state, {"tokens": sentences[i]}) for i in good]
    check = compare_replies(expected, [run.outputs[i] for i in good])
    assert check["ok"] and check["checked"] == len(good) and check["max_abs_error"] <= TOLERANCE


@pytest.mark.skipif(triton_lstm.missing() is not None, reason=f"Triton cannot run here: {triton_lstm.missing()}")
@pytest.mark.parametrize("setup", triton_setups.setups(instances=2), ids=lambda setup: setup.name)
def test_triton_that_fails_to_start_is_a_skip_naming_its_log(tmp_path: Path, setup: triton_setups.Setup):
    config = write_config(tmp_path, SMALL_LSTM).path
    (tmp_path / "lstm.pt").unlink()  # Triton's model cannot load its weights
    load = Load.of(Plan((10.0,), seconds=0.5, verify_requests=1), [{"tokens": [5, 17]}])
    skipped = http.run_triton(config, setup, load, [], [])["skipped"]
    assert skipped.startswith("Triton exited with status") and "lstm.pt" in skipped and "(log: " in skipped


@pytest.mark.skipif(triton_lstm.missing() is not None, reason=f"Triton cannot run here: {triton_lstm.missing()}")
def test_a_model_repository_that_cannot_be_written_is_a_skip_saying_why(tmp_path: Path, monkeypatch):
    config = write_config(tmp_path, SMALL_LSTM).path
    monkeypatch.setattr(triton_sequence, "MODEL_PY", tmp_path / "absent.py")
    load = Load.of(Plan((10.0,), seconds=0.5, verify_requests=1), [{"tokens": [5, 17]}])
    skipped = http.run_triton(config, triton_setups.setups()[2], load, [], [])["skipped"]
    assert skipped.startswith("Triton's sequence batcher cannot be set up: ") and "absent.py" in skipped
