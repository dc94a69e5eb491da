"""Triton's sequence batcher serving the bench LSTM one token a request, which pytriton's Python API cannot
configure: a model repository written at run time (config.pbtxt and bench/triton_lstm_step.py as its Python
backend `model.py`), served by the `tritonserver` binary that the nvidia-pytriton wheel ships.

The sequence batcher's "oldest" strategy batches the next step of up to max_batch sequences at once; START, END
and CORRID tell the model where each sequence begins and ends and which state is whose.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from batchmaker.common.config import load_config

MODEL_PY = Path(__file__).with_name("triton_lstm_step.py")
MAX_CANDIDATE_SEQUENCES = 4096  # sequences the batcher holds at once; more wait for one to end
IDLE_SEQUENCE_US = 60_000_000  # a sequence with no request for this long is ended (a client gone mid-sentence)


def config_pbtxt(config: Path, max_batch: int, max_queue_delay_us: int) -> str:
    """The model configuration of `lstm`: one INT64 token in, the state after it out, per sequence step."""
    hidden = load_config(config).models["lstm"].params["hidden_size"]
    return f"""backend: "python"
max_batch_size: {max_batch}
parameters {{ key: "config" value {{ string_value: "{config.resolve()}" }} }}
sequence_batching {{
  max_sequence_idle_microseconds: {IDLE_SEQUENCE_US}
  oldest {{ max_candidate_sequences: {MAX_CANDIDATE_SEQUENCES} max_queue_delay_microseconds: {max_queue_delay_us} }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
}}
input [ {{ name: "tokens" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [
  {{ name: "h" data_type: TYPE_FP32 dims: [ {hidden} ] }},
  {{ name: "c" data_type: TYPE_FP32 dims: [ {hidden} ] }}
]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


def command(config: Path, workspace: Path, ports: list[str], max_batch: int, max_queue_delay_us: int) -> list[str]:
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
    (model / "config.pbtxt").write_text(config_pbtxt(config, max_batch, max_queue_delay_us))
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
