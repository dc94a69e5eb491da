"""worker/cuda_runtime.py's own code, where it can run without a GPU: torch's CUDA entry points
replaced by ones that record their arguments."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchmaker.worker.cuda_runtime import CudaRuntime


def test_ipc_handles_are_opened_without_the_exporters_event(monkeypatch: pytest.MonkeyPatch):
    """torch opens the exporter's IPC event at every open and never destroys it: the backend does not ask
    for it (its arenas were complete before it registered)."""
    opened = []

    def new_shared_cuda(*args):
        opened.append(args)
        return torch.UntypedStorage(12 * 4)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", new_shared_cuda, raising=False)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    handle = ["memory", 48, 0, "counter", 0, "event", True]
    tensor = CudaRuntime().open(handle, 1, torch.float32, (4, 3))
    assert opened == [(1, "memory", 48, 0, "counter", 0, "event", False)]
    assert tuple(tensor.shape) == (4, 3)


def test_io_arenas_are_registered_whole_and_a_refusal_is_an_error(monkeypatch: pytest.MonkeyPatch):
    registered = []

    def register(pointer: int, size: int, flags: int) -> int:
        registered.append((pointer, size, flags))
        return 0 if len(registered) == 1 else 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=register))
    arena = np.zeros((16, 8), np.float32)
    CudaRuntime().pin(arena)
    assert registered == [(arena.ctypes.data, arena.nbytes, 0)]
    with pytest.raises(RuntimeError, match="cudaHostRegister of 512 bytes failed with cudaError 2"):
        CudaRuntime().pin(arena)
