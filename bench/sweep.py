"""One policy under increasing open-loop load: a real server process, a real client, one point per load."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Self

import numpy as np

from batchmaker.bench.generator import Replies, open_loop, poisson_schedule, request_frames
from batchmaker.clients import Client
from batchmaker.clients.loadgen import percentiles
from batchmaker.manager.commands.launcher import cpu_seconds, launch, roles, stop_server, wait_until_ready

CDF_POINTS = 101  # quantiles kept of the queueing and computation times (at moderate loads only)
IDLE_TIMEOUT_S = 120.0


def cdf(values: list[float]) -> list[float]:
    """The values at CDF_POINTS evenly spaced quantiles (enough to draw the curve, small to store)."""
    if not values:
        return []
    return [float(v) for v in np.quantile(values, np.linspace(0, 1, CDF_POINTS))]


class ServedPolicy:
    """The server started on a config with one policy; `measure` runs one load point against it."""

    def __init__(self, config: Path, address: str, policy: str, model: str, *options: str, ready_timeout: float = 180):
        """`options` go to `batchmaker serve` after the policy (e.g. `--address`); `ready_timeout` is how long
        the server may take to start (more models warm up for longer)."""
        self.address = address
        self.ready_timeout = ready_timeout
        self.policy = policy
        self.model = model
        # The server's output, open for its whole lifetime; close() deletes it once the server has stopped.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix=f"batchmaker-bench-{policy}-", suffix=".log", delete=False
        )
        self._server = launch(config, self._log, "--policy", policy, *options)

    def __enter__(self) -> Self:
        try:
            wait_until_ready(self.address, self._server, timeout=self.ready_timeout)
        except SystemExit as exc:
            self.close(keep_log=True)  # the log says why: it stays for the reader
            raise SystemExit(f"the {self.policy} server did not start ({exc}); its log is {self._log.name}") from None
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self, keep_log: bool = False) -> None:
        leftovers = stop_server(self._server)
        self._log.close()
        if leftovers:
            raise SystemExit(f"server processes left after stopping: {leftovers}")
        if not keep_log:
            Path(self._log.name).unlink(missing_ok=True)

    def stats(self) -> dict[str, Any]:
        with Client(self.address, timeout=10) as client:
            return client.stats()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the server's supervisor, manager and workers (all workers together)."""
        return cpu_seconds(roles(self._server))

    def pids(self) -> dict[int, str]:
        """The server's processes by pid, with their role ("manager", "worker", "frontdoor", ...)."""
        return roles(self._server)

    def wait_idle(self) -> None:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while time.monotonic() < deadline:
            stats = self.stats()
            if stats["requests_in_flight"] == 0:
                return
            time.sleep(0.2)
        raise SystemExit(f"the {self.policy} server still had requests in flight {IDLE_TIMEOUT_S:.0f} s after a load")

    def measure(
        self, inputs: list[dict[str, Any]], rate: float, seconds: float, seed: int, keep_cdf: bool = False
    ) -> dict[str, Any]:
        """Poisson arrivals at `rate` for `seconds`; throughput, latency, queueing, compute, batch size and
        how busy the workers' kernels were (and the CDFs of queueing and compute time, if asked)."""
        rng = np.random.default_rng(seed)
        due = poisson_schedule(rate, seconds, rng)
        order = rng.permutation(len(inputs))
        frames = request_frames(self.model, [inputs[order[i % len(order)]] for i in range(len(due))])
        before, cpu = self.stats(), self.cpu_seconds()
        replies = open_loop(self.address, frames, due, timeout=60)
        self.wait_idle()
        after = self.stats()
        result = point(replies, due, rate, before, after)
        result["server_cpu_s_per_request"] = {
            role: (seconds - cpu.get(role, 0.0)) / max(1, len(due)) for role, seconds in self.cpu_seconds().items()
        }
        if not keep_cdf:
            del result["cdf"]
        return result


def point(
    replies: Replies, due: np.ndarray, rate: float, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    """One load point: latency counts from each request's scheduled send."""
    ok = [i for i, reply in enumerate(replies.replies) if reply is not None and reply["ok"]]
    errors: dict[str, int] = {}
    for reply in replies.replies:
        code = "LOST" if reply is None else None if reply["ok"] else reply["error"]["code"]
        if code is not None:
            errors[code] = errors.get(code, 0) + 1
    latency = replies.received[ok] - due[ok]
    # Requests answered per second of the run; the run's span is measured from the first send plus
    # the quickest answer (the pipeline's own delay) to the last answer, so that a server keeping up
    # scores the offered rate and an overloaded one scores the rate at which it drains its backlog.
    span = float(np.nanmax(replies.received)) - float(latency.min()) if ok else 0.0
    tasks = after["tasks"] - before["tasks"]
    steps = after["steps"] - before["steps"]  # a multi-step task runs several batches
    cells = after["nodes"] - before["nodes"]
    queue_ms = [replies.replies[i]["timing"]["queue_us"] / 1e3 for i in ok]
    compute_ms = [replies.replies[i]["timing"]["compute_us"] / 1e3 for i in ok]
    return {
        "offered_rps": rate,
        "sent": len(due),
        "ok": len(ok),
        "errors": errors,
        "achieved_rps": len(ok) / span if span > 0 else 0.0,
        "latency_ms": percentiles(latency * 1e3),
        "queue_ms": percentiles(queue_ms),
        "compute_ms": percentiles(compute_ms),
        "mean_batch_size": cells / steps if steps else 0.0,
        "cells_run": cells,
        "tasks": tasks,
        "generator_cpu_s_per_request": replies.cpu_seconds / max(1, len(due)),
        "kernel_busy": kernel_busy(before, after, span),
        "cdf": {"queue_ms": cdf(queue_ms), "compute_ms": cdf(compute_ms)},
    }


def kernel_busy(before: dict[str, Any], after: dict[str, Any], span: float) -> float | None:
    """The fraction of the run's span the workers' kernels were busy, summed over workers (so up to their
    number; a worker that joined during the run counts from its start): near 1 a worker is saturated by
    compute, far below it starved by the control plane. None when a worker does not time its kernels (a
    GPU's), there is no worker, or nothing was answered."""
    workers = [*before["workers"].values(), *after["workers"].values()]
    if span <= 0 or not workers or any(worker["kernel_busy_s"] is None for worker in workers):
        return None
    start = {worker_id: worker["kernel_busy_s"] for worker_id, worker in before["workers"].items()}
    busy = sum(worker["kernel_busy_s"] - start.get(worker_id, 0.0) for worker_id, worker in after["workers"].items())
    return busy / span


def saturated(result: dict[str, Any]) -> bool:
    """The server did not keep up: it answered clearly fewer requests than were offered, or refused some."""
    refused = sum(result["errors"].values())
    return result["achieved_rps"] < 0.9 * result["offered_rps"] or refused > 0.01 * result["sent"]
