"""The front door's one path to the server: OIP requests, as both transports parse them, become ZeroMQ
requests on one AsyncClient (docs/protocol.md), and their replies or errors come back in OIP terms.

The manager's `models` reply says which inputs and outputs each model has, which gives the model metadata and
the mapping of OIP tensors onto a model's inputs (a tree's arrays are the tensors `tree.tokens` and
`tree.parents`). Inference uses the reply as last read, read again for a model it does not name (one loaded
since); the metadata, readiness and repository calls read it afresh, since versions come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import itertools
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchmaker.clients import AsyncClient
from batchmaker.clients.errors import RequestTooLarge, ServerError
from batchmaker.clients.messages import wire_value
from batchmaker.clients.streams import Partial
from batchmaker.common.protocol import INVALID_INPUT, UNAVAILABLE, UNKNOWN_MODEL, decode_outputs, echo

from . import repository
from .errors import TOO_LARGE, DoorError
from .sequences import session_fields
from .tensors import datatype_of

SERVER_NAME = "batchmaker"
EXTENSIONS = ("binary_tensor_data", "sequence", "model_repository")
TRACE_CONTEXT = ("traceparent", "tracestate")  # W3C Trace Context: HTTP headers, gRPC metadata, ZeroMQ fields
READY_TIMEOUT_S = 2.0  # a manager that does not answer health this soon is not ready (a probe must not hang)


@dataclass
class InferRequest:
    """An inference request as either transport parsed it."""

    model: str
    version: str
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None = None  # the outputs asked for; None: all
    parameters: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    trace: dict[str, str] = field(default_factory=dict)  # the caller's trace context (`trace_context`)


@dataclass
class InferResult:
    """Outputs of a request (all of them, or a streamed request's partial ones), as OIP tensors by name."""

    model: str
    id: str
    outputs: dict[str, np.ndarray]
    final: bool = True
    restarted: bool = False  # a streamed request started over (its worker was lost): earlier partials are void
    version: str = ""  # the version that served it; a partial's: the version asked for, if any


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: list[int]


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    described_inputs: dict[str, Any]
    streams: bool
    versions: list[str]  # the ready ones, oldest first


class Gateway:
    """Owns the AsyncClient to the manager and the facts read from it."""

    def __init__(self, address: str, curve: tuple[str, str] | None, timeout_s: float):
        # No retries: an OVERLOADED refusal is the HTTP client's to retry (429, Retry-After), not ours.
        self.client = AsyncClient(address, timeout=timeout_s, curve=curve, max_retries=0)
        self._models: dict[str, ModelMetadata] | None = None
        self._ids = itertools.count(1)

    async def close(self) -> None:
        await self.client.close()

    # -- health and metadata ------------------------------------------------------------------
    async def ready(self) -> bool:
        """The manager answers, every configured worker is up and the server is not draining."""
        try:
            health = await self._ask(asyncio.wait_for(self.client.health(), READY_TIMEOUT_S))
        except DoorError:
            return False
        return health.get("status") == "ready" and bool(health.get("workers"))

    def server_metadata(self) -> dict[str, Any]:
        return {
            "name": SERVER_NAME,
            "version": importlib.metadata.version("batchmaker"),
            "extensions": list(EXTENSIONS),
        }

    async def model(self, name: str) -> ModelMetadata:
        """A served model's metadata as last read (read again for a name not known); UNKNOWN_MODEL for another."""
        if self._models is None or name not in self._models:
            await self._read_models()
        return self._known(name)

    async def model_version(self, name: str, version: str) -> ModelMetadata:
        """A served model's metadata read now; UNKNOWN_MODEL unless `version`, when given, is ready."""
        await self._read_models()
        model = self._known(name)
        if version and version not in model.versions:
            shown = version if version.isascii() and version.isdigit() else echo(version)  # as the server says it
            raise DoorError(
                UNKNOWN_MODEL, f"model {name!r} has no ready version {shown}; ready: {', '.join(model.versions)}"
            )
        return model

    async def _read_models(self) -> dict[str, Any]:
        reply = await self._ask(self.client.models())
        self._models = {model: _metadata(model, entry) for model, entry in reply["models"].items()}
        return reply

    def _known(self, name: str) -> ModelMetadata:
        assert self._models is not None
        model = self._models.get(name)
        if model is None:
            served = ", ".join(sorted(self._models))
            raise DoorError(UNKNOWN_MODEL, f"no model named {echo(name)} is served; the models are: {served}")
        return model

    # -- the model repository extension -------------------------------------------------------
    async def repository_index(self, ready_only: bool) -> list[dict[str, str]]:
        return repository.index(await self._read_models(), ready_only)

    async def load(self, name: str, parameters: dict[str, Any]) -> str:
        """Load a new version of `name` (docs/protocol.md, "Versions"); its number once it serves."""
        message = {"op": "load", "model": name, **repository.load_fields(name, parameters)}
        reply = await self._ask(self.client.call(message))
        self._models = None  # the new version's description is read on the next request
        return str(reply["version"])

    async def unload(self, name: str) -> None:
        """Stop serving `name`: its versions finish what they started, then leave the workers."""
        await self._ask(self.client.call({"op": "unload", "model": name}))
        self._models = None

    # -- inference ----------------------------------------------------------------------------
    async def infer(self, request: InferRequest) -> InferResult:
        """Run one request; a caller cancelled meanwhile (its client went away) cancels it on the server."""
        model = await self.model(request.model)
        wanted = _wanted_outputs(model, request.outputs)
        message = {"op": "infer", "model": model.name, "inputs": _server_inputs(model, request.inputs)}
        message |= _admission_fields(request.parameters) | session_fields(request.parameters) | _routing_fields(request)
        request_id = f"oip-{next(self._ids)}"
        try:
            reply = await self._ask(self.client.call({**message, "id": request_id}))
        except asyncio.CancelledError:
            cancel = asyncio.ensure_future(self.client.cancel(request_id))
            cancel.add_done_callback(_ignore_outcome)
            raise
        outputs = _selected(decode_outputs(reply.get("outputs") or {}), wanted)
        return InferResult(model.name, request.id, outputs, version=str(reply.get("version", "")))

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResult]:
        """Each partial reply of a model that streams as it is decoded, then the final one; other models and
        sequences' requests give their one final reply. Closing the iterator early cancels the request."""
        model = await self.model(request.model)
        if not model.streams or session_fields(request.parameters):
            yield await self.infer(request)
            return
        wanted = _wanted_outputs(model, request.outputs)
        fields = _admission_fields(request.parameters)
        inputs = _server_inputs(model, request.inputs)
        asked = _routing_fields(request).get("version")
        items = self.client.stream(
            model.name, inputs, fields.get("deadline_ms"), fields.get("priority"), asked, request.trace
        )
        async with contextlib.aclosing(items):
            try:
                async for item in items:
                    partial = isinstance(item, Partial)
                    outputs = _selected(item.outputs, wanted)
                    restarted = partial and item.restarted
                    version = request.version if partial else str(item.version)
                    yield InferResult(model.name, request.id, outputs, not partial, restarted, version=version)
            except Exception as exc:
                raise _door_error(exc) from None

    async def _ask(self, call: Any) -> dict[str, Any]:
        try:
            return await call
        except Exception as exc:
            raise _door_error(exc) from None


def _door_error(exc: Exception) -> DoorError:
    if isinstance(exc, DoorError):
        return exc
    if isinstance(exc, ServerError):
        return DoorError(exc.code, exc.message, exc.retry_after_ms)
    if isinstance(exc, RequestTooLarge):  # its own words name the door's internal id and client setting
        return DoorError(
            TOO_LARGE,
            f"the request's inputs take {exc.size} bytes as the server reads them, over the server's limit of "
            f"{exc.limit} bytes (server.max_message_bytes): send smaller inputs, or raise that limit in its config",
        )
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return DoorError(UNAVAILABLE, f"the server did not answer: {exc}")
    raise exc


def _metadata(name: str, entry: dict[str, Any]) -> ModelMetadata:
    return ModelMetadata(
        name=name,
        inputs=_tensors(entry.get("inputs", {})),
        outputs=_tensors(entry.get("outputs", {})),
        described_inputs=entry.get("inputs", {}),
        streams=entry.get("stream") is True,
        versions=repository.ready_versions(entry),
    )


def _tensors(described: dict[str, Any], prefix: str = "") -> list[Tensor]:
    """OIP tensors of a `models` entry's inputs or outputs: a member of a nested input (a tree's `tokens`) is
    its own tensor named `input.member`; a scalar is shape [1]."""
    tensors = []
    for name, spec in described.items():
        if not isinstance(spec, dict):
            continue
        if "dtype" in spec:
            tensors.append(Tensor(prefix + name, datatype_of(spec["dtype"]), list(spec.get("shape") or [1])))
        else:
            tensors += _tensors(spec, f"{prefix}{name}.")
    return tensors


def _wanted_outputs(model: ModelMetadata, asked: list[str] | None) -> list[str] | None:
    if asked is None:
        return None
    known = [tensor.name for tensor in model.outputs]
    unknown = [name for name in asked if name not in known]
    if unknown:
        raise DoorError(
            INVALID_INPUT, f"model {model.name!r} has no output {echo(unknown[0])}; its outputs are: {', '.join(known)}"
        )
    return asked


def _server_inputs(model: ModelMetadata, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """The infer message's `inputs` for OIP tensors: a tree's member tensors gathered into its map, a
    scalar input as its one value, every other tensor as it came (float64 as float32, as the clients send)."""
    inputs: dict[str, Any] = {}
    for name, array in tensors.items():
        top, dot, member = name.partition(".")
        spec = model.described_inputs.get(top)
        if dot and isinstance(spec, dict) and "dtype" not in spec:
            if not isinstance(spec.get(member), dict):
                members = ", ".join(f"{top}.{key}" for key, value in spec.items() if isinstance(value, dict))
                raise DoorError(INVALID_INPUT, f"input {echo(name)} is not one of {top}'s tensors: {members}")
            inputs.setdefault(top, {})[member] = array.reshape(-1).tolist()
        elif isinstance(spec, dict) and spec.get("shape") == []:
            if array.size != 1:
                raise DoorError(INVALID_INPUT, f"input {echo(name)} is one value: shape [1], got {list(array.shape)}")
            inputs[name] = array.reshape(()).item()
        else:
            inputs[name] = _array_input(name, array)
    return inputs


def _array_input(name: str, array: np.ndarray) -> Any:
    try:
        return wire_value(name, array)
    except ValueError as exc:
        raise DoorError(INVALID_INPUT, str(exc)) from None


def _admission_fields(parameters: dict[str, Any]) -> dict[str, Any]:
    """`deadline_ms` from Triton's `timeout` (microseconds) and the request's `priority`."""
    fields: dict[str, Any] = {}
    for key in ("timeout", "priority"):
        value = parameters.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DoorError(INVALID_INPUT, f"parameter {key} must be a non-negative integer, got {echo(value)}")
        if key == "timeout":
            fields["deadline_ms"] = math.ceil(value / 1000)
        elif value:
            fields["priority"] = value
    return fields


def trace_context(carrier: Mapping[str, str]) -> dict[str, str]:
    """The caller's `traceparent` and `tracestate`, from HTTP headers or gRPC metadata, for the server's span to
    join the caller's trace (the front door makes no span of its own)."""
    return {key: str(carrier[key]) for key in TRACE_CONTEXT if key in carrier}


def _routing_fields(request: InferRequest) -> dict[str, Any]:
    """The infer message's `version` (the one the request names, if any) and the caller's trace context."""
    fields: dict[str, Any] = dict(request.trace)
    if request.version:
        if not (request.version.isascii() and request.version.isdigit()) or int(request.version) < 1:
            raise DoorError(
                UNKNOWN_MODEL, f"model {request.model!r} has no version {echo(request.version)}: versions are 1, 2, ..."
            )
        fields["version"] = int(request.version)
    return fields


def _flat(outputs: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """Reply outputs as OIP tensors: arrays as they are, a nested map's members as `name.member`."""
    flat: dict[str, np.ndarray] = {}
    for name, value in outputs.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{name}.")
        else:
            flat[prefix + name] = np.asarray(value)
    return flat


def _selected(outputs: dict[str, Any], wanted: list[str] | None) -> dict[str, np.ndarray]:
    flat = _flat(outputs)
    return flat if wanted is None else {name: flat[name] for name in wanted if name in flat}


def _ignore_outcome(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()
