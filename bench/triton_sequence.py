"""Triton's sequence batcher serving the bench LSTM a few tokens a request, which pytriton's Python API cannot
configure: a model repository written at run time (config.pbtxt and bench/triton_lstm_step.py as its Python
backend `model.py`), served by the `tritonserver` binary that the nvidia-pytriton wheel ships.

Both strategies batch the next request of up to max_batch sequences at once, and keep every request of a
sequence on one model instance: `oldest` picks the sequences with the oldest requests waiting, `direct` gives
each sequence a batch slot of an instance for its lifetime. START, END and CORRID tell the model where each
sequence begins and ends and which state is whose; READY is false in the `direct` strategy's null requests, which
stand in for the slots of a batch that have no request. The token input is ragged (`allow_ragged_batch`): a sentence's
last request may carry fewer tokens than the others, and the model gets each request's own.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from batchmaker.bench.triton_setups import Setup
from batchmaker.common.config import load_config

MODEL_PY = Path(__file__).with_name("triton_lstm_step.py")
MAX_CANDIDATE_SEQUENCES = 4096  # sequences the batcher holds at once; more wait for one to end
IDLE_SEQUENCE_US = 60_000_000  # a sequence with no request for this long is ended (a client gone mid-sentence)


def strategy_pbtxt(setup: Setup) -> str:
    """The sequence batcher's strategy block."""
    delay = f"max_queue_delay_microseconds: {setup.max_queue_delay_us}"
    if setup.strategy == "oldest":
        return f"oldest {{ max_candidate_sequences: {MAX_CANDIDATE_SEQUENCES} {delay} }}"
    return f"direct {{ {delay} }}"


def config_pbtxt(config: Path, setup: Setup) -> str:
    """The model configuration of `lstm` for a sequence `setup`: a few INT64 tokens of a sentence in, the state
    after the last of them out, per request."""
    hidden = load_config(config).models["lstm"].params["hidden_size"]
    return f"""backend: "python"
max_batch_size: {setup.max_batch}
parameters {{ key: "config" value {{ string_value: "{config.resolve()}" }} }}
sequence_batching {{
  max_sequence_idle_microseconds: {IDLE_SEQUENCE_US}
  {strategy_pbtxt(setup)}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
  ]
}}
input [ {{ name: "tokens" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true }} ]
output [
  {{ name: "h" data_type: TYPE_FP32 dims: [ {hidden} ] }},
  {{ name: "c" data_type: TYPE_FP32 dims: [ {hidden} ] }}
]
instance_group [ {{ kind: KIND_CPU count: {setup.instances} }} ]
"""


def command(config: Path, workspace: Path, ports: list[str], setup: Setup) -> list[str]:
    """Write the model repository and the Python backend under `workspace`; the tritonserver command serving
    them on `ports` (gRPC, HTTP, metrics)."""
    from pytriton.utils.distribution import get_root_module_path, get_stub_path

    shipped = get_root_module_path() / "tritonserver"
    backends = workspace / "backends"
    shutil.copytree(shipped / "backends", backends)
    # The backend stub built for this interpreter's Python, where Triton's Python backend looks for it.
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy(get_stub_path(version), backends / "python" / "triton_python_backend_stub")
    model = workspace / "models" / "lstm"
    (model / "1").mkdir(parents=True)
    shutil.copy(MODEL_PY, model / "1" / "model.py")
    (model / "config.pbtxt").write_text(config_pbtxt(config, setup))
    grpc, http, metrics = ports
    return [
        str(shipped / "bin" / "tritonserver"),
        f"--model-repository={workspace / 'models'}",
        f"--backend-directory={backends}",
        f"--grpc-port={grpc}",
        f"--http-port={http}",
        f"--metrics-port={metrics}",
    ]


def library_path() -> str:
    """Where tritonserver's own shared libraries are, in the nvidia-pytriton wheel."""
    from pytriton.utils.distribution import get_libs_path

    return str(get_libs_path())


def search_path() -> str:
    """PATH with this interpreter's environment first: the backend stub runs model.py with the Python it finds
    there, which has torch and batchmaker."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
