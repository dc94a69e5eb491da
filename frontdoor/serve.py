"""A front door process's listeners on one event loop: aiohttp for [http], grpc.aio for [grpc]."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import grpc
from aiohttp import web

from batchmaker.common.config import Config
from batchmaker.common.frontdoor_config import body_limit

from . import inference_pb2_grpc
from .gateway import Gateway
from .grpc_server import GrpcDoor, server_credentials
from .http_server import HttpDoor
from .metrics import DoorMetrics

log = logging.getLogger("batchmaker.frontdoor")
PARENT_CHECK_S = 1.0
GRACE_S = 5.0  # beyond the drain timeout, for the last answers to be written
CLIENT_TIMEOUT_S = 3600.0  # a request without `timeout` waits for the server's answer; the drain bounds it


async def serve(config: Config, manager: str, parent_gone: Callable[[], bool]) -> int:
    """Listen until SIGTERM/SIGINT (or the supervisor is gone), then drain: both listeners close at once, and
    the requests in progress are answered within the server's drain timeout."""
    curve = config.server.curve
    keys = (str(curve.secret_key), str(curve.secret_key)) if curve is not None else None
    gateway = Gateway(manager, keys, CLIENT_TIMEOUT_S)
    metrics = DoorMetrics()
    drain_s = config.server.drain_timeout_ms / 1e3 + GRACE_S
    limit = body_limit(config.http, config.server.max_message_bytes)
    runner = await _start_http(config, gateway, metrics, drain_s, limit) if config.http is not None else None
    grpc_server = await _start_grpc(config, gateway, metrics, limit) if config.grpc is not None else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    while not stop.is_set() and not parent_gone():
        try:
            await asyncio.wait_for(stop.wait(), PARENT_CHECK_S)
        except TimeoutError:
            pass
    log.info("draining")
    stopping = [] if runner is None else [runner.cleanup()]
    stopping += [] if grpc_server is None else [grpc_server.stop(drain_s)]
    await asyncio.gather(*stopping)
    await gateway.close()
    return 0


async def _start_http(
    config: Config, gateway: Gateway, metrics: DoorMetrics, drain_s: float, max_body_bytes: int
) -> web.AppRunner:
    assert config.http is not None
    door = HttpDoor(gateway, metrics, config.http, max_body_bytes)
    # handler_cancellation: a client that disconnects cancels its handler, and so its request on the server.
    runner = web.AppRunner(door.app(), handler_cancellation=True, shutdown_timeout=drain_s, access_log=None)
    await runner.setup()
    host, port = door.listen_on()
    await web.TCPSite(runner, host, port, ssl_context=door.ssl_context(), reuse_port=True).start()
    log.info("OIP over HTTP on %s", config.http.address)
    return runner


async def _start_grpc(
    config: Config, gateway: Gateway, metrics: DoorMetrics, max_message_bytes: int
) -> grpc.aio.Server:
    """A message over `max_message_bytes` is refused by gRPC itself, RESOURCE_EXHAUSTED, before it is parsed.
    Replies have no limit: the server's outputs are as large as the model makes them."""
    assert config.grpc is not None
    options = [("grpc.max_receive_message_length", max_message_bytes), ("grpc.so_reuseport", 1)]
    server = grpc.aio.server(options=options)
    inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(GrpcDoor(gateway, metrics, config.grpc), server)
    credentials = server_credentials(config.grpc)
    if credentials is None:
        server.add_insecure_port(config.grpc.address)
    else:
        server.add_secure_port(config.grpc.address, credentials)
    await server.start()
    log.info("OIP over gRPC on %s", config.grpc.address)
    return server
