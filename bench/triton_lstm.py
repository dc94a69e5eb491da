"""Triton Inference Server serving the bench LSTM as torch's nn.Embedding + nn.LSTM, for `bench http` to drive
with the same load as batchmaker's gRPC front door.

Triton comes from the optional `nvidia-pytriton` package (`pip install 'batchmaker[triton]'`), whose wheel ships
a `tritonserver` binary that runs on CPU. It serves the model in one of the setups of bench/triton_setups.py. The
dynamic batcher is bound through pytriton in a process of its own (`python -m batchmaker.bench.triton_lstm`), so
that its CPU time is counted apart from the load's; the sequence batcher, which pytriton cannot configure, is that
binary serving a model repository (bench/triton_sequence.py).
When the package is missing or Triton does not start, `TritonLSTM` raises `TritonUnavailable` with the reason,
which the benchmark records as a skip.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Self

import numpy as np
import psutil

from batchmaker.bench import triton_sequence
from batchmaker.bench.triton_setups import Setup
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model
from batchmaker.manager.commands.launcher import free_port_on, stop_server

START_TIMEOUT_S = 120.0
PYTRITON_NUMPY_BELOW = 2  # nvidia-pytriton 0.7 requires numpy < 2


class TritonUnavailable(RuntimeError):
    """Triton cannot be run here; the message says why."""


def missing() -> str | None:
    """Why Triton cannot run here without starting it (the packages absent), or None."""
    for module, package in (("pytriton", "nvidia-pytriton"), ("tritonclient.grpc", "tritonclient[grpc]")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{package} is not installed (pip install 'batchmaker[triton]')"
    numpy = version("numpy")
    if int(numpy.split(".")[0]) >= PYTRITON_NUMPY_BELOW:
        # Its tensors then come back empty: the test extra's numpy 2 and pytriton do not share an environment.
        return f"nvidia-pytriton {version('nvidia-pytriton')} needs numpy < {PYTRITON_NUMPY_BELOW}, not {numpy}"
    return None


def _environment(*libraries: str) -> dict[str, str]:
    """Our environment, with this interpreter's libpython first on the library path, then `libraries`:
    pytriton's Python backend stub links libpython3.X by name and would otherwise load the system's, which may be
    another patch release than the standard library it then imports (a pyenv or venv interpreter beside a
    distribution's Python)."""
    paths = [sysconfig.get_config_var("LIBDIR") or "", *libraries, os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(p for p in paths if p)}


class TritonLSTM:
    """Triton serving model `lstm` of the batchmaker config at `config` (its weights file) as `setup` says.

    `address` is its gRPC endpoint; `pids()` its processes (tritonserver, its Python backend stubs, and with the
    dynamic batcher the pytriton host that started them) for CPU accounting."""

    def __init__(self, config: Path, setup: Setup):
        reason = missing()
        if reason:
            raise TritonUnavailable(reason)
        self.address = f"127.0.0.1:{free_port_on('127.0.0.1')}"
        self.version = ""  # Triton's, once it is ready
        ports = [self.address.rpartition(":")[2], str(free_port_on("127.0.0.1")), str(free_port_on("127.0.0.1"))]
        self._workspace = tempfile.TemporaryDirectory(prefix="batchmaker-bench-triton-")  # the sequence batcher's
        if setup.batcher == "sequence":
            try:
                command = triton_sequence.command(config, Path(self._workspace.name), ports, setup)
            except OSError as exc:  # the wheel lacks what the model repository needs (a stub for this Python)
                self._workspace.cleanup()
                raise TritonUnavailable(f"Triton's sequence batcher cannot be set up: {exc}") from None
            environment = {**_environment(triton_sequence.library_path()), "PATH": triton_sequence.search_path()}
        else:
            command = [sys.executable, "-m", "batchmaker.bench.triton_lstm", str(config), *ports]
            command += [f"--{option}={value}" for option, value in _dynamic_options(setup).items()]
            environment = _environment()
        # The output, open for Triton's lifetime; close() deletes it unless Triton failed to start.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="batchmaker-bench-triton-", suffix=".log", delete=False
        )
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=environment)

    def __enter__(self) -> Self:
        try:
            self._wait_ready()
        except TritonUnavailable:
            self.close(keep_log=True)
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _wait_ready(self) -> None:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + START_TIMEOUT_S
        with grpcclient.InferenceServerClient(self.address) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise TritonUnavailable(f"Triton exited with status {self._process.returncode}: {self._tail()}")
                with contextlib.suppress(InferenceServerException):  # not listening yet
                    if client.is_model_ready("lstm"):
                        self.version = client.get_server_metadata().version
                        return
                time.sleep(0.3)
        raise TritonUnavailable(f"Triton's lstm was not ready within {START_TIMEOUT_S:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        """Why a model failed to load, else the last error Triton logged, or its last line; and where its whole
        log is. (Triton serving a model repository logs errors after the load's as it exits.)"""
        lines = [line for line in Path(self._log.name).read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("E") or "Error" in line]
        load = [line for line in lines if "failed to load '" in line]  # Triton's line naming the model
        reason = (load[:1] or errors or lines or ["(no output)"])[-1]
        return f"{reason[:400]} (log: {self._log.name})"

    def pids(self) -> dict[int, str]:
        try:
            root = psutil.Process(self._process.pid)
            return {p.pid: "triton" for p in [root, *root.children(recursive=True)]}
        except psutil.NoSuchProcess:
            return {}

    def close(self, keep_log: bool = False) -> None:
        leftovers = stop_server(self._process)
        self._log.close()
        self._workspace.cleanup()
        if leftovers:
            raise SystemExit(f"Triton processes left after stopping: {leftovers}; its log is {self._log.name}")
        if not keep_log:
            Path(self._log.name).unlink(missing_ok=True)


def _dynamic_options(setup: Setup) -> dict[str, int]:
    """The options of `python -m batchmaker.bench.triton_lstm` that carry a dynamic batcher's setup."""
    return {"instances": setup.instances, "max-batch": setup.max_batch, "max-queue-delay-us": setup.max_queue_delay_us}


def _serve(config_path: Path, ports: tuple[int, int, int], instances: int, max_batch: int, delay_us: int) -> None:
    """Bind nn.Embedding + nn.LSTM with the config's weights to Triton's dynamic batcher, `instances` model
    instances (pytriton runs each in a thread of this process, which torch leaves while it computes), and serve
    until SIGINT."""
    import torch
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    torch.set_num_threads(1)  # as a batchmaker CPU worker in the benchmarks (threads_per_worker = 1)
    model = build_model(load_config(config_path).models["lstm"])
    module = torch.nn.Module()
    module.embedding = torch.nn.Embedding(model.vocab_size, model.embedding_size)
    module.lstm = torch.nn.LSTM(model.embedding_size, model.hidden_size, batch_first=True)
    module.load_state_dict(model.load_weights())  # the state_dict names batchmaker's chain LSTM serves

    @batch
    def infer(tokens: np.ndarray) -> dict[str, np.ndarray]:
        """A batch of equally long token sequences (Triton batches only requests of one shape)."""
        with torch.inference_mode():
            _, (h, c) = module.lstm(module.embedding(torch.from_numpy(tokens)))
        return {"h": h[-1].numpy(), "c": c[-1].numpy()}

    hidden = model.hidden_size
    grpc_port, http_port, metrics_port = ports
    with Triton(config=TritonConfig(grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port)) as triton:
        triton.bind(
            model_name="lstm",
            infer_func=[infer] * instances,
            inputs=[Tensor(name="tokens", dtype=np.int64, shape=(-1,))],
            outputs=[
                Tensor(name="h", dtype=np.float32, shape=(hidden,)),
                Tensor(name="c", dtype=np.float32, shape=(hidden,)),
            ],
            config=ModelConfig(
                max_batch_size=max_batch, batcher=DynamicBatcher(max_queue_delay_microseconds=delay_us)
            ),
        )
        triton.serve()


def main() -> None:
    parser = argparse.ArgumentParser(description="Triton serving a batchmaker config's lstm (for bench http)")
    parser.add_argument("config", type=Path)
    parser.add_argument("grpc_port", type=int)
    parser.add_argument("http_port", type=int)
    parser.add_argument("metrics_port", type=int)
    for option in _dynamic_options(Setup("dynamic", "dynamic", None, 1, None)):  # the setup's, every one needed
        parser.add_argument(f"--{option}", type=int, required=True)
    args = parser.parse_args()
    ports = (args.grpc_port, args.http_port, args.metrics_port)
    _serve(args.config, ports, args.instances, args.max_batch, args.max_queue_delay_us)


if __name__ == "__main__":
    main()
