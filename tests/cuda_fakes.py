"""A CUDA runtime for machines without a GPU that checks what it stands in for.

`FakeRuntime` replaces worker/cuda_runtime.py in `StreamCalls` and `CudaBackend`. Its streams
run what is enqueued at once, unless held (a hung device); its events and counter follow
them. It records every call it gets with the stream it ran on, and `Recorder`, a dispatch
mode, adds every tensor operation on a "cuda" device with the current stream of that device,
so a test can check stream order. It refuses what CUDA would get wrong silently: an
asynchronous copy from or to host memory that is not pinned, rows of the wrong shape. It
tracks which stream last wrote each device buffer, and `Recorder.hazards` lists each read
on another stream with nothing ordering the two. `fail()` poisons the context as a
device-side assert does: every later call raises `torch.AcceleratorError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numpy.lib.array_utils import byte_bounds
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from batchmaker.worker.backend import TORCH_DTYPES
from batchmaker.worker.cuda_runtime import CudaRuntime


@dataclass(eq=False)
class FakeStream:
    device: torch.device
    name: str
    held: bool = False
    enqueued: int = 0
    done: int = 0
    pending: list[Callable[[], None]] = field(default_factory=list)
    check: Callable[[], None] = lambda: None  # raises once the context is poisoned

    def query(self) -> bool:
        self.check()
        return self.done == self.enqueued

    def __repr__(self) -> str:
        return f"<{self.name} stream on {self.device}>"


class FakeEvent:
    def __init__(self, runtime: FakeRuntime):
        self._runtime = runtime
        self.stream: FakeStream | None = None
        self._at = 0

    def record(self, stream: FakeStream) -> None:
        self._runtime.check()
        self.stream, self._at = stream, stream.enqueued

    def query(self) -> bool:
        self._runtime.check()
        return self.stream is None or self.stream.done >= self._at


@dataclass
class Call:
    what: str  # an aten operation, or one of the runtime's: upload, download, signal, open, ...
    stream: FakeStream | None


class FakeRuntime(CudaRuntime):
    """Two GPUs by default; `peer_access` lists the (device, peer) pairs that have it."""

    def __init__(self, gpus: int = 2, peer_access: frozenset[tuple[int, int]] = frozenset()):
        self.gpus = gpus
        self.peer_access = peer_access
        self.default = {index: FakeStream(torch.device("cuda", index), "default") for index in range(gpus)}
        self._current = dict(self.default)
        self._active: list[FakeStream] = []
        self.streams = 0
        self.calls: list[Call] = []
        self.synchronized = 0
        self.opened: list[tuple[list[Any], int]] = []
        self.refuse_open: Exception | None = None  # raised by `open`, as for a peer that has died
        self.pinned_tensors: list[torch.Tensor] = []
        self._pinned_arrays: list[np.ndarray] = []
        self.registered: list[np.ndarray] = []
        self._fault: str | None = None

    # -- faults
    def fail(self, message: str = "CUDA error: device-side assert triggered") -> None:
        self._fault = message

    def check(self) -> None:
        if self._fault is not None:
            raise torch.AcceleratorError(self._fault)

    # -- streams
    def current(self, device: torch.device) -> FakeStream:
        return self._current[device.index]

    def prepare(self, device: torch.device) -> None:
        self.calls.append(Call("prepare", None))

    def stream(self, device: torch.device) -> FakeStream:
        self.streams += 1
        return FakeStream(device, f"stream {self.streams}", check=self.check)

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        index = stream.device.index
        before = self._current[index]
        self._current[index] = stream
        self._active.append(stream)
        try:
            yield
        finally:
            self._current[index] = before
            self._active.pop()

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def synchronize(self, device: torch.device) -> None:
        self.check()
        self.synchronized += 1
        self.calls.append(Call("synchronize", None))

    def enqueue(self, what: str, device: torch.device, action: Callable[[], None] = lambda: None) -> None:
        self.check()
        stream = self.current(device)
        self.calls.append(Call(what, stream))
        stream.enqueued += 1
        stream.pending.append(action)
        if not stream.held:
            self.run(stream)

    def run(self, stream: FakeStream) -> None:
        """Let a held stream go: it runs everything enqueued on it."""
        stream.held = False
        while stream.pending:
            stream.pending.pop(0)()
            stream.done += 1

    def hold(self) -> None:
        """A kernel that holds the stream made current last, as a hung device would: it and what follows
        it wait for `run`."""
        stream = self._active[-1]
        stream.held = True
        self.enqueue("hold", stream.device)

    # -- host memory
    def pinned(self, nbytes: int) -> tuple[torch.Tensor, np.ndarray]:
        with _disable_current_modes():  # host memory: no device operation, for any mode to see
            tensor = torch.zeros(nbytes, dtype=torch.uint8)
            self.pinned_tensors.append(tensor)
            self._pinned_arrays.append(tensor.numpy())
        return tensor, self._pinned_arrays[-1]

    def pin(self, array: np.ndarray) -> None:
        self.registered.append(array)

    def unpin(self, array: np.ndarray) -> None:
        self.registered = [known for known in self.registered if known is not array]

    def is_pinned(self, array: np.ndarray) -> bool:
        pinned = self._pinned_arrays + self.registered
        return any(np.shares_memory(array, known) and _within(array, known) for known in pinned)

    def upload(self, device: torch.Tensor, host: torch.Tensor, start: int) -> None:
        assert any(host is tensor for tensor in self.pinned_tensors), "an asynchronous upload from unpinned memory"
        assert device.device.type == "cuda" and 0 <= start and start + device.nbytes <= host.nbytes
        self.enqueue("upload", device.device)

    def download(self, host: np.ndarray, rows: torch.Tensor) -> None:
        assert self.is_pinned(host), "an asynchronous download into unpinned memory"
        assert rows.device.type == "cuda", f"downloaded rows are on {rows.device}"
        assert tuple(rows.shape) == host.shape and rows.dtype == TORCH_DTYPES[host.dtype.name]
        self.enqueue("download", rows.device)

    def write_counter(self, counter: np.ndarray, sequence: torch.Tensor, value: int) -> None:
        assert self.is_pinned(counter), "the counter is not pinned"
        self.enqueue("signal", sequence.device, lambda: counter.__setitem__(0, value))

    # -- devices and IPC
    def export(self, tensor: torch.Tensor) -> list[Any]:
        return [f"memory {len(self.calls)}", tensor.nbytes, 0, "counter", 0, "event", True]

    def open(self, handle: list[Any], device: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self.check()
        if self.refuse_open is not None:
            raise self.refuse_open
        self.opened.append((handle, device))
        return torch.zeros(shape, dtype=dtype, device=torch.device("cuda", device))

    def uuid(self, index: int) -> str:
        assert 0 <= index < self.gpus, f"no GPU {index}"
        return f"GPU-{index:08x}"

    def device_count(self) -> int:
        return self.gpus

    def can_access_peer(self, device: int, peer: int) -> bool:
        assert 0 <= peer < self.gpus, f"no GPU {peer}"
        return (device, peer) in self.peer_access


def _within(array: np.ndarray, known: np.ndarray) -> bool:
    start, end = byte_bounds(array)
    known_start, known_end = byte_bounds(known)
    return known_start <= start and end <= known_end


class Recorder(TorchDispatchMode):
    """Adds every tensor operation on a "cuda" device to the runtime's calls, with its device's current
    stream, and notes each read of a buffer last written on another stream with no synchronize since."""

    def __init__(self, runtime: FakeRuntime):
        super().__init__()
        self._runtime = runtime
        self._writers: dict[int, FakeStream] = {}
        self.hazards: list[str] = []
        self._synchronized = runtime.synchronized

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [value for value in [*args, *kwargs.values()] if isinstance(value, torch.Tensor)]
        devices = [t.device for t in tensors if t.device.type == "cuda"]
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "cuda":
            devices.append(kwargs["device"])
        if not devices or func is torch.ops.prim.device.default:
            return func(*args, **kwargs)
        self._runtime.check()
        device = devices[-1]  # a copy to another device runs on the destination's stream
        stream = self._runtime.current(device)
        if self._runtime.synchronized > self._synchronized:  # everything written before is complete
            self._writers.clear()
            self._synchronized = self._runtime.synchronized
        copy = func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout, torch.ops.aten.copy_.default)
        for tensor in tensors:
            writer = self._writers.get(_storage(tensor))
            if writer is not None and writer is not stream and not copy:  # torch orders cross-device copies
                self.hazards.append(f"{func} on {stream} reads what {writer} wrote")
        self._runtime.calls.append(Call(str(func), stream))
        result = func(*args, **kwargs)
        inputs = {_storage(t) for t in tensors}
        written = [
            args[i] for i, arg in enumerate(func._schema.arguments) if arg.alias_info and arg.alias_info.is_write
        ]
        written += [t for t in _tensors(result) if _storage(t) not in inputs]
        for tensor in written:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                self._writers[_storage(tensor)] = self._runtime.current(tensor.device)
        return result


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    return []
