"""One policy under increasing open-loop load: a real server process, a real client, one point per load."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any, Self

import numpy as np
import psutil

from clients import Client
from clients.loadgen import Sample, percentiles, run_open_loop
from manager.launcher import launch, stop_server, wait_until_ready

CDF_POINTS = 101  # quantiles kept of the queueing and computation times (at moderate loads only)
IDLE_TIMEOUT_S = 120.0


def cdf(values: list[float]) -> list[float]:
    """The values at CDF_POINTS evenly spaced quantiles (enough to draw the curve, small to store)."""
    if not values:
        return []
    return [float(v) for v in np.quantile(values, np.linspace(0, 1, CDF_POINTS))]


class ServedPolicy:
    """The server started on a config with one policy; `measure` runs one load point against it."""

    def __init__(self, config: Path, address: str, policy: str, model: str, *options: str):
        """`options` go to `batchmaker serve` after the policy (e.g. `--address`)."""
        self.address = address
        self.policy = policy
        self.model = model
        # The server's output, open for its whole lifetime; close() deletes it once the server has stopped.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix=f"batchmaker-bench-{policy}-", suffix=".log", delete=False
        )
        self._server = launch(config, self._log, "--policy", policy, *options)

    def __enter__(self) -> Self:
        try:
            wait_until_ready(self.address, self._server, timeout=180)
        except SystemExit:
            self.close()
            raise SystemExit(f"the {self.policy} server did not start; its log is {self._log.name}") from None
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        leftovers = stop_server(self._server)
        if leftovers:
            raise SystemExit(f"server processes left after stopping: {leftovers}")
        Path(self._log.name).unlink(missing_ok=True)

    def processes(self) -> dict[str, psutil.Process]:
        """The server's processes by role ("supervisor", "manager", "worker"), to account for their CPU time."""
        supervisor = psutil.Process(self._server.pid)
        found = {"supervisor": supervisor}
        for child in supervisor.children():
            command = child.cmdline()
            role = command[command.index("-m") + 1] if "-m" in command else child.name()
            found[role if role not in found else f"{role} {child.pid}"] = child
        return found

    def stats(self) -> dict[str, Any]:
        with Client(self.address, timeout=10) as client:
            return client.stats()

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
        """Poisson arrivals at `rate` for `seconds`; throughput, latency, queueing, compute and batch size
        (and the CDFs of queueing and compute time, if asked)."""
        before = self.stats()
        samples = asyncio.run(
            run_open_loop(self.address, self.model, inputs, rate, seconds, seed=seed, timeout=60, keep_outputs=False)
        )
        self.wait_idle()
        after = self.stats()
        result = point(samples, rate, before, after)
        if not keep_cdf:
            del result["cdf"]
        return result


def point(samples: list[Sample], rate: float, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
    # Requests answered per second of the run; the run's span is measured from the first send plus
    # the quickest answer (the pipeline's own delay) to the last answer, so that a server keeping up
    # scores the offered rate and an overloaded one scores the rate at which it drains its backlog.
    span = max((s.received for s in samples), default=0.0) - min((s.latency for s in ok), default=0.0)
    tasks = after["tasks"] - before["tasks"]
    cells = after["nodes"] - before["nodes"]
    queue_ms = [s.timing["queue_us"] / 1e3 for s in ok]
    compute_ms = [s.timing["compute_us"] / 1e3 for s in ok]
    return {
        "offered_rps": rate,
        "sent": len(samples),
        "ok": len(ok),
        "errors": errors,
        "achieved_rps": len(ok) / span if span > 0 else 0.0,
        "latency_ms": percentiles([s.latency * 1e3 for s in ok]),
        "queue_ms": percentiles(queue_ms),
        "compute_ms": percentiles(compute_ms),
        "mean_batch_size": cells / tasks if tasks else 0.0,
        "cells_run": cells,
        "tasks": tasks,
        "cdf": {"queue_ms": cdf(queue_ms), "compute_ms": cdf(compute_ms)},
    }


def saturated(result: dict[str, Any]) -> bool:
    """The server did not keep up: it answered clearly fewer requests than were offered, or refused some."""
    refused = sum(result["errors"].values())
    return result["achieved_rps"] < 0.9 * result["offered_rps"] or refused > 0.01 * result["sent"]
