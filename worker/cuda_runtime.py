"""The CUDA runtime as the GPU backend uses it: streams, events, pinned memory, host copies, IPC, devices.

Everything the backend asks of torch.cuda beyond tensor operations goes through `CudaRuntime`,
so that tests can hand the backend a fake runtime that records which stream each call ran
on and checks what real CUDA would not forgive (an unpinned asynchronous copy, a read of a
peer that was never opened). Only imported when a worker is started on a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

HostArray = np.ndarray  # host memory the device copies to or from: pinned, or registered with `pin`
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either

log = logging.getLogger("worker")


def expandable_segments(conf: str) -> bool:
    """Whether allocator settings (PYTORCH_CUDA_ALLOC_CONF's form) turn expandable segments on."""
    return any(part.replace(" ", "").lower() == "expandable_segments:true" for part in conf.split(","))


def arenas_shareable(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn expandable segments off for this process before CUDA starts: the arenas peers read are shared
    through cudaIpcGetMemHandle, which memory mapped in expandable segments does not support."""
    for variable in ALLOC_CONF_VARIABLES:
        conf = environ.get(variable, "")
        if expandable_segments(conf):
            kept = [
                part for part in conf.split(",") if not part.replace(" ", "").lower().startswith("expandable_segments")
            ]
            environ[variable] = ",".join(kept)
            log.warning(
                "%s asks for expandable segments; this worker turns them off so peers can map its arenas", variable
            )


class CudaRuntime:
    """torch.cuda, reduced to the calls the backend makes."""

    def prepare(self, device: torch.device) -> None:
        torch.cuda.init()
        torch.cuda.set_device(device)

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def use(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def synchronize(self, device: torch.device) -> None:
        """Wait for every stream of the device, the legacy default stream included."""
        torch.cuda.synchronize(device)

    def pinned(self, nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
        """Page-locked host bytes from torch's caching host allocator, as a tensor and a numpy view of it.
        The allocator reuses a block only after the copies that used it are done, and it knows of them
        only through the tensor: copy from it, and keep it as long as the view."""
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return tensor, tensor.numpy()

    def pin(self, array: HostArray) -> None:
        """Page-lock memory allocated elsewhere (an io arena in shared memory), so the device copies into it
        asynchronously, straight where the manager reads it."""
        status = int(torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0))
        if status != 0:  # cudaSuccess
            raise RuntimeError(f"cudaHostRegister of {array.nbytes} bytes failed with cudaError {status}")

    def unpin(self, array: HostArray) -> None:
        torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)

    def upload(self, device: torch.Tensor, host: torch.Tensor, start: int) -> None:
        """Enqueue the copy of `host` bytes from `start` (a tensor from `pinned`) to the bytes `device` on the
        current stream."""
        device.copy_(host.narrow(0, start, device.numel()), non_blocking=True)

    def download(self, host: HostArray, rows: torch.Tensor) -> None:
        """Enqueue device-to-host rows on the current stream; `host` is memory that lives as long as the
        process (an io arena, the counter) and is pinned or registered with `pin`."""
        torch.from_numpy(host).copy_(rows, non_blocking=True)

    def write_counter(self, counter: HostArray, sequence: torch.Tensor, value: int) -> None:
        """Enqueue `counter[0] = value` on the current stream, after everything enqueued before it."""
        sequence.fill_(value)
        self.download(counter, sequence)

    def export(self, tensor: torch.Tensor) -> list[Any]:
        """The CUDA IPC handle of a tensor's storage, without its device index (see `open`)."""
        _device, *rest = tensor.untyped_storage()._share_cuda_()
        return rest

    def open(self, handle: list[Any], device: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Map another process's memory in the context of local GPU `device`, with lazy peer access.

        The exporter's IPC event is not waited for (event_sync_required is cleared): opening it costs an
        event that torch never destroys, and the arenas were complete before their worker registered.
        """
        torch.cuda.init()  # a fresh process has no CUDA state yet; torch's own rebuild path does the same
        memory, size, offset, counter, counter_offset, event, _sync = handle
        storage = torch.UntypedStorage._new_shared_cuda(
            device, memory, size, offset, counter, counter_offset, event, False
        )
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, shape)

    def uuid(self, index: int) -> str:
        """A GPU's identity, the same in every process whatever CUDA_VISIBLE_DEVICES says."""
        return str(torch.cuda.get_device_properties(index).uuid)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def can_access_peer(self, device: int, peer: int) -> bool:
        return torch.cuda.can_device_access_peer(device, peer)

