"""`./scripts/bench door`: the front door's own CPU per request, over HTTP and over gRPC, one request at a time
and with many in flight (as a load balancer sends them), beside the ZeroMQ door of the same server.

One batchmaker server (the `lstm` preset) with its front door on HTTP and gRPC. For each way and each
concurrency, a load process keeps that many requests in flight (closed loop: each answer sends the next) over
WMT sentences: aiohttp posting OIP JSON, tritonclient's gRPC aio client, or the project's AsyncClient. After a
warm-up, it samples the CPU time of the front door's process, and of the whole server, around the measured
requests; the front door's p50 latency is set against the ZeroMQ door's at the same concurrency. The first
answers of every run are checked against the unbatched reference model.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchmaker.bench.client_load import in_event_loop
from batchmaker.bench.datasets import wmt
from batchmaker.bench.generator import spawned
from batchmaker.bench.presets import LSTM
from batchmaker.bench.run import git, machine, write_config
from batchmaker.bench.sweep import ServedPolicy
from batchmaker.bench.verify import compare_replies
from batchmaker.clients.loadgen import percentiles
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model
from batchmaker.manager.commands.launcher import cpu_seconds, free_port_on

MODEL = "lstm"
OUTPUTS = ("h", "c")
WAYS = ("zmq", "http", "grpc")
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...]  # requests kept in flight
    requests: int  # measured, per way and concurrency
    warmup: int  # sent first, not measured
    checked: int  # the first answers, compared with the reference


FULL = Plan((1, 8, 64), requests=3000, warmup=200, checked=64)
QUICK = Plan((1, 16), requests=300, warmup=50, checked=16)


@dataclass(frozen=True)
class Endpoints:
    zmq: str  # tcp://host:port
    http: str  # host:port
    grpc: str  # host:port


@dataclass
class Run:
    """A closed-loop run: latency of each measured request (seconds), errors, CPU seconds by role (sampled
    after the warm-up and after the last answer) and the outputs of the first requests."""

    latency: list[float]
    errors: int
    cpu_s: dict[str, float]
    outputs: list[dict[str, np.ndarray] | None]  # None: refused


Send = Callable[[int], Awaitable[dict[str, np.ndarray]]]


async def _zmq_sender(endpoints: Endpoints, sentences: list[list[int]]) -> tuple[Send, Callable[[], Awaitable[None]]]:
    from batchmaker.clients import AsyncClient

    client = AsyncClient(endpoints.zmq, timeout=TIMEOUT_S)
    arrays = [{"tokens": np.asarray(tokens, dtype=np.int64)} for tokens in sentences]

    async def send(index: int) -> dict[str, np.ndarray]:
        reply = await client.infer(MODEL, arrays[index % len(arrays)])
        return {name: np.asarray(reply.outputs[name]) for name in OUTPUTS}

    return send, client.close


async def _http_sender(endpoints: Endpoints, sentences: list[list[int]]) -> tuple[Send, Callable[[], Awaitable[None]]]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    url = f"http://{endpoints.http}/v2/models/{MODEL}/infer"
    bodies = [
        json.dumps({"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [len(tokens)], "data": tokens}]})
        for tokens in sentences
    ]

    async def send(index: int) -> dict[str, np.ndarray]:
        body = bodies[index % len(bodies)]
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            document = await response.json()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {document}")
        return {
            out["name"]: np.asarray(out["data"], dtype=np.float32).reshape(out["shape"]) for out in document["outputs"]
        }

    return send, session.close


async def _grpc_sender(endpoints: Endpoints, sentences: list[list[int]]) -> tuple[Send, Callable[[], Awaitable[None]]]:
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(endpoints.grpc)
    tensors = []
    for tokens in sentences:
        tensor = grpcclient.InferInput("tokens", [len(tokens)], "INT64")
        tensor.set_data_from_numpy(np.asarray(tokens, dtype=np.int64))
        tensors.append(tensor)
    wanted = [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]

    async def send(index: int) -> dict[str, np.ndarray]:
        result = await client.infer(MODEL, [tensors[index % len(tensors)]], outputs=wanted, client_timeout=TIMEOUT_S)
        return {name: result.as_numpy(name) for name in OUTPUTS}

    return send, client.close


SENDERS = {"zmq": _zmq_sender, "http": _http_sender, "grpc": _grpc_sender}


async def _closed_loop(
    way: str, endpoints: Endpoints, sentences: list[list[int]], plan: Plan, concurrency: int, pids: dict[int, str]
) -> Run:
    send, close = await SENDERS[way](endpoints, sentences)
    run = Run([], 0, {}, [None] * plan.checked)
    total = plan.warmup + plan.requests
    issued = 0
    before: dict[str, float] = {}

    async def lane() -> None:
        nonlocal issued, before
        while issued < total:
            index = issued
            issued += 1
            if index == plan.warmup:
                before = cpu_seconds(pids)
            started = time.perf_counter()
            try:
                outputs = await send(index)
            except Exception:  # counted: a refusal fails the run's check, not the benchmark
                run.errors += 1
                continue
            if index >= plan.warmup:
                run.latency.append(time.perf_counter() - started)
            if index < plan.checked:
                run.outputs[index] = outputs

    try:
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        after = cpu_seconds(pids)
    finally:
        await close()
    run.cpu_s = {role: seconds - before.get(role, 0.0) for role, seconds in after.items()}
    return run


def closed_loop(
    way: str, endpoints: Endpoints, sentences: list[list[int]], plan: Plan, concurrency: int, pids: dict[int, str]
) -> Run:
    """`plan.warmup + plan.requests` requests through `way`, `concurrency` at a time, from a process of its own."""
    return spawned(in_event_loop, _closed_loop, way, endpoints, sentences, plan, concurrency, pids)


def check(expected: list[dict[str, Any]], run: Run) -> dict[str, Any]:
    """The run's first answers against the reference's; a refused one fails the check."""
    refused = [index for index, outputs in enumerate(run.outputs) if outputs is None]
    if refused:
        return {"checked": 0, "max_abs_error": float("nan"), "wrong": [f"request {refused[0]} refused"], "ok": False}
    return compare_replies(expected, [outputs for outputs in run.outputs if outputs is not None])


def summary(run: Run, requests: int) -> dict[str, Any]:
    cpu = {role: seconds * 1e6 / requests for role, seconds in run.cpu_s.items()}
    return {
        "requests": requests,
        "errors": run.errors,
        "latency_ms": percentiles(np.asarray(run.latency) * 1e3),
        "cpu_us_per_request": {"frontdoor": cpu.get("frontdoor", 0.0), "server": sum(cpu.values())},
    }


def run(quick: bool) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    started = time.time()
    sentences = [request["tokens"] for request in wmt()]
    with tempfile.TemporaryDirectory(prefix="batchmaker-bench-door-") as tmp:
        config = write_config(LSTM, Path(tmp))
        model = build_model(load_config(config).models[MODEL])
        state = model.load_weights()
        expected = [model.reference(state, {"tokens": tokens}) for tokens in sentences[: plan.checked]]
        address = load_config(config).server.address
        endpoints = Endpoints(address, *(f"127.0.0.1:{free_port_on('127.0.0.1')}" for _ in range(2)))
        rows = []
        options = ("--http", endpoints.http, "--grpc", endpoints.grpc)
        with ServedPolicy(config, address, "cellular", MODEL, *options) as served:
            for concurrency in plan.concurrency:
                row: dict[str, Any] = {"concurrency": concurrency}
                for way in WAYS:
                    measured = closed_loop(way, endpoints, sentences, plan, concurrency, served.pids())
                    served.wait_idle()
                    row[way] = summary(measured, plan.requests)
                    row[way]["verify"] = check(expected, measured)
                for way in ("http", "grpc"):
                    row[way]["added_p50_ms"] = row[way]["latency_ms"]["p50"] - row["zmq"]["latency_ms"]["p50"]
                rows.append(row)
    return {
        "preset": "door",
        "description": "the front door's CPU per request over HTTP and gRPC, closed loop, beside the ZeroMQ door",
        "quick": quick,
        "commit": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "load": {"dataset": "wmt", "concurrency": list(plan.concurrency), "requests": plan.requests},
        "rows": rows,
        "seconds": time.time() - started,
    }


def wrong(result: dict[str, Any]) -> list[str]:
    """The runs whose answers differ from the reference's (or that were refused)."""
    return [
        f"{way} at concurrency {row['concurrency']}"
        for row in result["rows"]
        for way in WAYS
        if not row[way]["verify"]["ok"] or row[way]["errors"]
    ]


def table(result: dict[str, Any]) -> str:
    lines = [
        "| in flight | way | p50 ms | p99 ms | added p50 ms | front door CPU µs/req | server CPU µs/req |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for way in WAYS:
            cell = row[way]
            added = f"{cell['added_p50_ms']:+.2f}" if "added_p50_ms" in cell else ""
            door = f"{cell['cpu_us_per_request']['frontdoor']:.0f}" if way != "zmq" else ""
            lines.append(
                f"| {row['concurrency']} | {way} | {cell['latency_ms']['p50']:.2f} | {cell['latency_ms']['p99']:.2f} "
                f"| {added} | {door} | {cell['cpu_us_per_request']['server']:.0f} |"
            )
    return "\n".join(lines)
