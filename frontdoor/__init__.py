"""The Open Inference Protocol front door: HTTP/REST and gRPC (KServe v2, Triton) in front of the server's
ZeroMQ protocol, so that tritonclient, curl and HTTP load balancers call the server unchanged.

Run by the supervisor as `python -m batchmaker.frontdoor --config FILE` when the config has an [http] or
[grpc] table (docs/protocol.md, "Open Inference Protocol"); needs `pip install 'batchmaker[oip]'`.
"""

OIP_EXTRA_HINT = (
    "the [http] and [grpc] front door needs aiohttp, orjson, grpcio and protobuf: pip install 'batchmaker[oip]'"
)


def missing_oip_packages() -> list[str]:
    """The front door's libraries that are not installed (without importing them)."""
    import importlib.util

    modules = {"aiohttp": "aiohttp", "orjson": "orjson", "grpcio": "grpc", "protobuf": "google.protobuf"}
    missing = []
    for package, module in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ModuleNotFoundError, ValueError):  # a parent package (google) is missing, or the import is blocked
            found = False
        if not found:
            missing.append(package)
    return missing
