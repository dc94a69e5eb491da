"""The Open Inference Protocol over gRPC: Triton's `inference.GRPCInferenceService`, on grpc.aio.

Inputs come as `raw_input_contents` (every input, in order) or as typed `contents`; outputs always go back as
`raw_output_contents`. ModelStreamInfer answers each request of the stream, a streamed model's partial
replies first, each response saying `triton_final_response` (Triton's decoupled convention); a sequence's
requests on a stream run in the order sent (frontdoor.grpc_stream).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from batchmaker.common.frontdoor_config import GrpcConfig
from batchmaker.common.protocol import INTERNAL, INVALID_INPUT, echo

from . import inference_pb2 as pb
from . import inference_pb2_grpc
from .errors import DoorError
from .gateway import Gateway, InferRequest, InferResult, trace_context
from .grpc_stream import StreamCall
from .guards import Call, Credentials
from .metrics import DoorMetrics
from .sequences import sequence_session
from .tensors import datatype_of, from_bytes, from_json, to_bytes

log = logging.getLogger("batchmaker.frontdoor")

# The typed contents field of each datatype (FP16 travels as raw contents only, as in Triton).
CONTENTS_FIELDS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


class GrpcDoor(inference_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, gateway: Gateway, metrics: DoorMetrics, config: GrpcConfig):
        self.gateway = gateway
        self.metrics = metrics
        self.config = config
        self.credentials = Credentials.of(
            "grpc", config.address, config.security, "the metadata 'authorization: Bearer {}'"
        )

    async def _enter(self, context: grpc.aio.ServicerContext, method: str, call: Call = Call.SERVICE) -> None:
        """Count the call and check its credential (frontdoor/guards.py)."""
        self.metrics.request("grpc", method)
        authorization = str(dict(context.invocation_metadata() or ()).get("authorization", ""))
        try:
            self.credentials.check(call, authorization)
        except DoorError as error:
            await self._abort(context, error)

    async def _abort(self, context: grpc.aio.ServicerContext, error: DoorError) -> None:
        self.metrics.error("grpc", error.code)
        await context.abort(getattr(grpc.StatusCode, error.grpc_code), error.text)

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        await self._enter(context, "ServerLive", Call.HEALTH)
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        await self._enter(context, "ServerReady", Call.HEALTH)
        return pb.ServerReadyResponse(ready=await self.gateway.ready())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        await self._enter(context, "ModelReady", Call.HEALTH)
        try:
            await self.gateway.model_version(request.name, request.version)
        except DoorError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=await self.gateway.ready())

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        await self._enter(context, "ServerMetadata")
        return pb.ServerMetadataResponse(**self.gateway.server_metadata())

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        await self._enter(context, "ModelMetadata")
        try:
            model = await self.gateway.model_version(request.name, request.version)
        except DoorError as error:
            await self._abort(context, error)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=model.name,
            versions=model.versions,
            platform="batchmaker",
            inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in model.inputs],
            outputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in model.outputs],
        )

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        await self._enter(context, "ModelInfer")
        started = time.perf_counter()
        try:
            return to_response(await self.gateway.infer(_traced(parse_infer(request), context)))
        except DoorError as error:
            await self._abort(context, error)
        finally:
            self.metrics.latency("grpc", time.perf_counter() - started)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request of the stream runs as it arrives, a sequence's after the sequence's previous one; the
        responses go out as they come (frontdoor.grpc_stream). The call ends once the client ends its side and
        every request is answered, or with RESOURCE_EXHAUSTED once it passes its bounds."""
        await self._enter(context, "ModelStreamInfer")
        call: StreamCall[pb.ModelInferRequest, pb.ModelStreamInferResponse] = StreamCall(
            lambda request: self._stream_one(request, context),
            _sequence_of,
            self.config.max_stream_requests,
            self.config.max_stream_replies,
            lambda error: self.metrics.error("grpc", error.code),
        )
        try:
            async for response in call.replies(requests):
                yield response
        except DoorError as error:  # counted when it happened
            await context.abort(getattr(grpc.StatusCode, error.grpc_code), error.text)

    async def _stream_one(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """The responses to one request of a stream: its partial ones, its final one, or its error."""
        started = time.perf_counter()
        try:
            async for result in self.gateway.stream(_traced(parse_infer(request), context)):
                yield pb.ModelStreamInferResponse(infer_response=to_response(result))
        except Exception as exc:  # the stream goes on: this request's error is its response
            error = exc if isinstance(exc, DoorError) else DoorError(INTERNAL, f"{type(exc).__name__}: {exc}")
            if error is not exc:
                log.exception("a streamed request failed")
            self.metrics.error("grpc", error.code)
            failed = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
            yield pb.ModelStreamInferResponse(error_message=error.text, infer_response=failed)
        finally:
            self.metrics.latency("grpc", time.perf_counter() - started)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "batchmaker has no Triton model configuration: see ModelMetadata"
        )

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "per-model statistics are in the Prometheus metrics")

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        await self._enter(context, "RepositoryIndex")
        try:
            entries = await self.gateway.repository_index(request.ready)
        except DoorError as error:
            await self._abort(context, error)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**entry) for entry in entries])

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        """A new version of the model, answered once it serves (docs/protocol.md, "Model repository")."""
        await self._enter(context, "RepositoryModelLoad", Call.CONTROL)
        try:
            parameters = {key: _value(parameter) for key, parameter in request.parameters.items()}
            await self.gateway.load(request.model_name, parameters)
        except DoorError as error:
            await self._abort(context, error)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        await self._enter(context, "RepositoryModelUnload", Call.CONTROL)
        try:
            await self.gateway.unload(request.model_name)
        except DoorError as error:
            await self._abort(context, error)
        return pb.RepositoryModelUnloadResponse()


def parse_infer(request: pb.ModelInferRequest) -> InferRequest:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise DoorError(
            INVALID_INPUT, f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input"
        )
    inputs = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name in inputs:
            raise DoorError(INVALID_INPUT, f"input {echo(tensor.name)} is given twice")
        shape = list(tensor.shape)
        if raw:
            inputs[tensor.name] = from_bytes(tensor.name, tensor.datatype, shape, raw[index])
        else:
            field = CONTENTS_FIELDS.get(tensor.datatype)
            if field is None:
                raise DoorError(
                    INVALID_INPUT, f"input {echo(tensor.name)}: {echo(tensor.datatype)} needs raw_input_contents"
                )
            inputs[tensor.name] = from_json(tensor.name, tensor.datatype, shape, list(getattr(tensor.contents, field)))
    return InferRequest(
        model=request.model_name,
        version=request.model_version,
        inputs=inputs,
        outputs=[output.name for output in request.outputs] or None,
        parameters={key: _value(parameter) for key, parameter in request.parameters.items()},
        id=request.id,
    )


def _sequence_of(request: pb.ModelInferRequest) -> str | None:
    """The sequence a stream's request belongs to (its server session), which orders it after the stream's
    earlier requests of that sequence; None outside a sequence, or for a sequence_id its own answer refuses."""
    if "sequence_id" not in request.parameters:
        return None
    try:
        return sequence_session({"sequence_id": _value(request.parameters["sequence_id"])})
    except DoorError:
        return None


def _traced(request: InferRequest, context: grpc.aio.ServicerContext) -> InferRequest:
    """The request with its caller's trace context, from the call's metadata."""
    request.trace = trace_context(dict(context.invocation_metadata() or ()))
    return request


def _value(parameter: pb.InferParameter | pb.ModelRepositoryParameter) -> Any:
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def to_response(result: InferResult) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=result.model, model_version=result.version, id=result.id)
    for name, array in result.outputs.items():
        response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=list(array.shape))
        response.raw_output_contents.append(to_bytes(array))
    response.parameters["triton_final_response"].bool_param = result.final
    if result.restarted:
        response.parameters["batchmaker_restarted"].bool_param = True
    return response


def server_credentials(config: GrpcConfig) -> grpc.ServerCredentials | None:
    """TLS for the port, checking client certificates against `tls_client_ca` when given."""
    security = config.security
    if security.tls_cert is None:
        return None
    ca = security.tls_client_ca.read_bytes() if security.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(security.tls_key.read_bytes(), security.tls_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )
