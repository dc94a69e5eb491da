"""The Open Inference Protocol over HTTP/REST (KServe v2), on aiohttp.

JSON tensors, and the binary tensor data extension: a body whose first `Inference-Header-Content-Length`
bytes are the JSON request, followed by the inputs that say `binary_data_size`, in order; outputs asked for
with `binary_data` (or all of them, with the request parameter `binary_data_output`) come back the same way.
"""

from __future__ import annotations

import json
import logging
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from batchmaker.common.frontdoor_config import HttpConfig, split_host_port
from batchmaker.common.protocol import BAD_REQUEST, INTERNAL, INVALID_INPUT, UNKNOWN_MODEL, echo

from .errors import TOO_LARGE, DoorError
from .gateway import Gateway, InferRequest, InferResult, trace_context
from .guards import Call, Credentials
from .metrics import DoorMetrics
from .tensors import datatype_of, from_bytes, from_json, to_bytes, to_json

log = logging.getLogger("batchmaker.frontdoor")
HEADER_LENGTH = "Inference-Header-Content-Length"
MODEL, VERSIONED = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
LOAD, UNLOAD = "/v2/repository/models/{model}/load", "/v2/repository/models/{model}/unload"
HEALTH_ROUTES = ("/v2/health/live", "/v2/health/ready", "/metrics", MODEL + "/ready", VERSIONED + "/ready")
# Each route's kind of call (frontdoor/guards.py); a route not named here is a SERVICE call.
CALLS = {**dict.fromkeys(HEALTH_ROUTES, Call.HEALTH), LOAD: Call.CONTROL, UNLOAD: Call.CONTROL}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: DoorError) -> web.Response:
    """An OIP error body, with Retry-After (whole seconds, rounded up) when the server said when to come back."""
    headers = {}
    if error.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
    return web.json_response({"error": error.text}, status=error.http_status, headers=headers)


class HttpDoor:
    """The routes, and the checks every request passes first: its credential, then its size.

    `max_body_bytes` is [http] max_body_bytes, else the manager's [server] max_message_bytes: a body over it
    is refused by its Content-Length before it is read, or once the bytes read pass it (chunked), never parsed."""

    def __init__(self, gateway: Gateway, metrics: DoorMetrics, config: HttpConfig, max_body_bytes: int):
        self.gateway = gateway
        self.metrics = metrics
        self.config = config
        self.max_body_bytes = max_body_bytes
        self.credentials = Credentials.of(
            "http", config.address, config.security, "the header 'Authorization: Bearer {}'"
        )

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=self.max_body_bytes)
        app.add_routes(
            [
                web.get("/v2/health/live", self.live),
                web.get("/v2/health/ready", self.ready),
                web.get("/v2", self.server_metadata),
                web.get("/metrics", self.scrape),
                *[web.get(base, self.model_metadata) for base in (MODEL, VERSIONED)],
                *[web.get(base + "/ready", self.model_ready) for base in (MODEL, VERSIONED)],
                *[web.post(base + "/infer", self.infer) for base in (MODEL, VERSIONED)],
                web.post("/v2/repository/index", self.repository_index),
                web.post(LOAD, self.load),
                web.post(UNLOAD, self.unload),
            ]
        )
        return app

    def ssl_context(self) -> ssl.SSLContext | None:
        security = self.config.security
        if security.tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(security.tls_cert, security.tls_key)
        if security.tls_client_ca is not None:
            context.load_verify_locations(security.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def listen_on(self) -> tuple[str, int]:
        return split_host_port(self.config.address, "[http] address")

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        self.metrics.request("http", endpoint)
        try:
            self.credentials.check(CALLS.get(endpoint, Call.SERVICE), request.headers.get("Authorization", ""))
            length = request.content_length
            if length is not None and length > self.max_body_bytes:
                raise self._too_large(f"{length} bytes")
            return await handler(request)
        except DoorError as error:
            self.metrics.error("http", error.code)
            return error_response(error)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.error("http", TOO_LARGE)
            return error_response(self._too_large(f"over {self.max_body_bytes} bytes"))
        except web.HTTPException as exc:  # aiohttp's own: no route, wrong method
            self.metrics.error("http", str(exc.status))
            return web.json_response({"error": exc.reason}, status=exc.status, headers=exc.headers)
        except Exception as exc:  # a failure of the front door itself: an OIP error, and the service goes on
            log.exception("request %s %s failed", request.method, request.path)
            self.metrics.error("http", INTERNAL)
            return error_response(DoorError(INTERNAL, f"the front door failed: {type(exc).__name__}: {exc}"))

    def _too_large(self, size: str) -> DoorError:
        return DoorError(
            TOO_LARGE,
            f"the body is {size}, over the front door's limit of {self.max_body_bytes} bytes "
            "([http] max_body_bytes, by default the server's [server] max_message_bytes); it was not read",
        )

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = await self.gateway.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self.gateway.server_metadata())

    async def scrape(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.text(), content_type="text/plain", charset="utf-8")

    async def model_metadata(self, request: web.Request) -> web.Response:
        model = await self.gateway.model_version(request.match_info["model"], request.match_info.get("version", ""))
        return web.json_response(
            {
                "name": model.name,
                "versions": model.versions,
                "platform": "batchmaker",
                "inputs": [vars(tensor) for tensor in model.inputs],
                "outputs": [vars(tensor) for tensor in model.outputs],
            }
        )

    async def model_ready(self, request: web.Request) -> web.Response:
        """A health call, open to anyone: a model or version that is not ready is 404 naming no other."""
        name, version = request.match_info["model"], request.match_info.get("version", "")
        try:
            model = await self.gateway.model_version(name, version)
        except DoorError as error:
            if error.code != UNKNOWN_MODEL:
                raise
            shown = f"version {echo(version)} of model {echo(name)}" if version else f"model {echo(name)}"
            raise DoorError(UNKNOWN_MODEL, f"{shown} is not ready") from None
        ready = await self.gateway.ready()
        return web.json_response({"name": model.name, "ready": ready}, status=200 if ready else 503)

    async def repository_index(self, request: web.Request) -> web.Response:
        """Triton's index: every version of every model, with its state (and why, when it does not serve)."""
        ready_only = (await _control_body(request)).get("ready", False)
        if not isinstance(ready_only, bool):
            raise DoorError(BAD_REQUEST, f"'ready' must be true or false, got {echo(ready_only)}")
        return web.json_response(await self.gateway.repository_index(ready_only))

    async def load(self, request: web.Request) -> web.Response:
        """A new version of the model, answered once it serves (docs/protocol.md, "Model repository")."""
        parameters = _parameters((await _control_body(request)).get("parameters"), "the load")
        version = await self.gateway.load(request.match_info["model"], parameters)
        return web.json_response({"name": request.match_info["model"], "version": version})

    async def unload(self, request: web.Request) -> web.Response:
        await _control_body(request)  # its parameters (Triton's unload_dependents) change nothing here
        await self.gateway.unload(request.match_info["model"])
        return web.json_response({})

    async def infer(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            body = await request.read()
            parsed, binary_outputs = parse_infer(request, body)
            parsed.trace = trace_context(request.headers)
            return infer_response(await self.gateway.infer(parsed), binary_outputs)
        finally:
            self.metrics.latency("http", time.perf_counter() - started)


def parse_infer(request: web.Request, body: bytes) -> tuple[InferRequest, set[str] | bool]:
    """An infer body as an InferRequest, and which outputs go back as binary data (True: all of them)."""
    header_length = request.headers.get(HEADER_LENGTH)
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise DoorError(BAD_REQUEST, f"{HEADER_LENGTH} {echo(header_length)} is not a length within the body")
        header, binary = body[: int(header_length)], memoryview(body)[int(header_length) :]
    try:
        document = json.loads(header)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DoorError(BAD_REQUEST, f"the request is not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), list):
        raise DoorError(BAD_REQUEST, "the request must be a JSON object with an 'inputs' list")
    parameters = _parameters(document.get("parameters"), "the request")
    inputs, offset = {}, 0
    for item in document["inputs"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise DoorError(BAD_REQUEST, "each input must be an object with a 'name'")
        name = item["name"]
        if name in inputs:
            raise DoorError(INVALID_INPUT, f"input {echo(name)} is given twice")
        size = _parameters(item.get("parameters"), f"input {echo(name)}").get("binary_data_size")
        if size is None:
            if "data" not in item:
                raise DoorError(INVALID_INPUT, f"input {echo(name)} has neither 'data' nor binary_data_size")
            inputs[name] = from_json(name, item.get("datatype"), item.get("shape"), item["data"])
        else:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise DoorError(
                    INVALID_INPUT, f"input {echo(name)}: binary_data_size {echo(size)} is past the body's end"
                )
            inputs[name] = from_bytes(name, item.get("datatype"), item.get("shape"), binary[offset : offset + size])
            offset += size
    if offset != len(binary):
        raise DoorError(INVALID_INPUT, f"{len(binary) - offset} bytes of binary data follow the inputs unclaimed")
    outputs, binary_outputs = _asked_outputs(document.get("outputs"), parameters.get("binary_data_output") is True)
    request_id = document.get("id", "")
    parsed = InferRequest(
        model=request.match_info["model"],
        version=request.match_info.get("version", ""),
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        id=request_id if isinstance(request_id, str) else "",
    )
    return parsed, binary_outputs


async def _control_body(request: web.Request) -> dict[str, Any]:
    """A repository call's JSON body; an empty body is an empty object, as tritonclient sends for the index."""
    body = await request.read()
    if not body.strip():
        return {}
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DoorError(BAD_REQUEST, f"the request is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise DoorError(BAD_REQUEST, "the request must be a JSON object")
    return document


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DoorError(BAD_REQUEST, f"the parameters of {where} must be an object")
    return value


def _asked_outputs(value: Any, binary_default: bool) -> tuple[list[str] | None, set[str] | bool]:
    if value is None:
        return None, binary_default
    if not isinstance(value, list) or not all(
        isinstance(item, dict) and isinstance(item.get("name"), str) for item in value
    ):
        raise DoorError(BAD_REQUEST, "'outputs' must be a list of objects with a 'name'")
    binary = set()
    for item in value:
        asked = _parameters(item.get("parameters"), f"output {echo(item['name'])}").get("binary_data", binary_default)
        if asked is True:
            binary.add(item["name"])
    return [item["name"] for item in value], binary


def infer_response(result: InferResult, binary_outputs: set[str] | bool) -> web.Response:
    """The OIP reply: JSON alone, or JSON then the binary outputs' bytes in order."""
    outputs, chunks = [], []
    for name, array in result.outputs.items():
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(array.dtype), "shape": list(array.shape)}
        if binary_outputs is True or (binary_outputs and name in binary_outputs):
            chunks.append(to_bytes(array))
            entry["parameters"] = {"binary_data_size": len(chunks[-1])}
        else:
            entry["data"] = to_json(array)
        outputs.append(entry)
    document: dict[str, Any] = {"model_name": result.model, "model_version": result.version, "outputs": outputs}
    if result.id:
        document["id"] = result.id
    header = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return web.Response(body=header, content_type="application/json")
    return web.Response(
        body=b"".join([header, *chunks]),
        content_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header))},
    )
