"""`./scripts/bench servers`: what several servers behind one client give, on this machine.

Real servers (`batchmaker serve`, one CPU worker each) on 127.0.0.2, .3 and .4, loopback addresses
standing for three hosts, serve a small LSTM (hidden 64) on WMT sentence lengths. The load runs through
the client library in a process of its own (bench/client_load.py), so its CPU is measured apart.

1. Throughput with 1, 2 and 3 servers behind one AsyncClient, in a closed loop keeping `WINDOW`
   requests outstanding per server. A closed loop finds each capacity in one run, where an open loop
   would need a sweep of rates per server count (several times the runs, on a machine shared with
   others); `WINDOW` per server keeps each server's batches as full with three servers as with one.
   The cores each process role used over the same seconds show where the machine's cores went.
2. The client's own CPU per request at one open-loop rate (`STEADY` of the lowest throughput above):
   AsyncClient given one address, given all three, and the raw DEALER generator of the other presets
   (frames encoded beforehand, replies decoded after the run) against one server.
3. Failover at that rate through one AsyncClient given every standing server, with the library's
   default health probe: kill -9 of one whole server (supervisor, manager, worker); in a full run also
   SIGSTOP of one (a host that stops answering but keeps its connections open, which only the health
   probe notices); and SIGTERM of one, which drains. A full run replaces each lost server (a new one on
   the same host) so that every fault hits one server of three; a quick run skips SIGSTOP and drains
   one of the two left. Every resent answer and a sample of the others are checked against the
   model's unbatched reference.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Self

import numpy as np
import torch

from batchmaker.bench import client_load, servers_report
from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.generator import open_loop as raw_open_loop
from batchmaker.bench.generator import poisson_schedule, request_frames
from batchmaker.bench.progress import Progress
from batchmaker.bench.run import ROOT, git, machine
from batchmaker.bench.verify import compare
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model, init_missing_weights
from batchmaker.manager.commands.launcher import ServerProcess, free_port_on, roles

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
WINDOW = 128  # requests outstanding per server in the closed loop: two full batches
STEADY = 0.4  # the open-loop rate, as a fraction of the lowest closed-loop throughput: one server left keeps up
WORKLOAD = "LSTM hidden 64 on WMT lengths, one CPU worker per server"

SERVER = """
[server]
address = "tcp://127.0.0.1:{port}"
cpu_workers = 1
threads_per_worker = 1
max_queued_requests = 4000
max_queue_delay_ms = 0
"""  # each server of a fleet: one CPU worker, refusal by expected wait off
CONFIG = SERVER + """
[models.lstm]
builder = "batchmaker.common.models.lstm:build"
weights = "{weights}/servers-lstm-h64.pt"
vocab_size = 8192
embedding_size = 64
hidden_size = 64
max_length = 400
batch_sizes = [1, 2, 4, 8, 16, 32, 64]
"""


@dataclass(frozen=True)
class Plan:
    """Seconds of closed-loop warm-up and measurement, of the open-loop cost runs, of the fault runs and
    before the fault; and how many answers of a fault run are checked besides every resent one."""

    warmup: float
    saturated: float
    steady: float
    fault_run: float
    fault_at: float
    checked: int


QUICK = Plan(warmup=0.5, saturated=1.5, steady=1.5, fault_run=3.0, fault_at=1.0, checked=40)
FULL = Plan(warmup=2.0, saturated=10.0, steady=10.0, fault_run=15.0, fault_at=5.0, checked=200)
FAULTS = {"kill -9": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP, "SIGTERM (drain)": signal.SIGTERM}


class Fleet:
    """The servers of a run, each writing its log to the run's directory; closing stops those still running."""

    def __init__(self, config: Path, directory: Path):
        self.config = config
        self.directory = directory
        self.servers: list[ServerProcess] = []
        self._logs: list[IO] = []

    def start(self, hosts: list[str], ports: list[int | None] | None = None) -> list[ServerProcess]:
        """One server per host (on the given ports, else free ones), started together; returned once all are ready."""
        started = []
        for host, port in zip(hosts, ports or [None] * len(hosts), strict=True):
            log = (self.directory / f"{host}-{len(self._logs)}.log").open("w")
            self._logs.append(log)
            started.append((ServerProcess(self.config, host, log, port), log.name))
        self.servers += [server for server, _ in started]
        for server, log_name in started:
            try:
                server.wait_ready(timeout=180)
            except SystemExit as exc:
                raise SystemExit(f"server {server.address}: {exc}; its log is {log_name}") from None
        return [server for server, _ in started]

    def pids(self) -> dict[int, str]:
        """The processes of every running server, by role, for CPU accounting."""
        return {pid: role for server in self.servers for pid, role in roles(server.process).items()}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        with ThreadPoolExecutor(len(self.servers) or 1) as pool:  # each drains for a second or two: all at once
            leftovers = [pid for pids in pool.map(ServerProcess.stop, self.servers) for pid in pids]
        for log in self._logs:
            log.close()
        if leftovers:
            raise SystemExit(f"server processes left after stopping: {leftovers}")


def _write_config(directory: Path) -> Path:
    path = directory / "servers.toml"
    path.write_text(CONFIG.format(port=free_port_on("127.0.0.1"), weights=ROOT / "weights"))
    init_missing_weights(load_config(path))
    return path


def _addresses(servers: list[ServerProcess]) -> list[str]:
    return [server.address for server in servers]


def _fault(name: str, signum: int, target: ServerProcess, at: float) -> client_load.Fault:
    """The fault's signal goes to the whole server, children first, or for SIGTERM to its supervisor alone."""
    processes = roles(target.process)
    manager = next(pid for pid, role in processes.items() if role == "manager")
    pids = [target.process.pid] if signum == signal.SIGTERM else list(reversed(processes))
    return client_load.Fault(name, at, signum, pids, target.address, manager)


def _settle(target: ServerProcess, signum: int) -> int:
    """After a fault run: reap a killed server, kill a stopped one, wait for a drained one to exit; its status."""
    if signum == signal.SIGSTOP:
        target.kill_all()
    return target.process.wait(60)


def _draw(inputs: list[dict[str, Any]], count: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    return [inputs[i] for i in rng.integers(0, len(inputs), count)]


def _throughput(fleet: Fleet, inputs: list[dict[str, Any]], plan: Plan, progress: Progress) -> list[dict]:
    """Part 1: closed loop through one AsyncClient given the first 1, 2 and 3 servers."""
    rows = []
    for count in (1, 2, 3):
        progress.note(f"closed loop, {count} of {len(HOSTS)} servers")
        addresses = _addresses(fleet.servers[:count])
        run = client_load.saturate(addresses, "lstm", inputs, WINDOW, plan.warmup, plan.saturated, fleet.pids())
        rows.append(servers_report.throughput(count, run))
        progress.advance()
    return rows


def _client_costs(
    servers: list[ServerProcess], requests: list[dict[str, Any]], due: np.ndarray, progress: Progress
) -> list[dict]:
    """Part 2: the same open-loop schedule from the raw generator and from AsyncClient given one address, then all."""
    progress.note("open loop, raw DEALER")
    raw = raw_open_loop(servers[0].address, request_frames("lstm", requests), due)
    rows = [servers_report.client_cost("raw DEALER, 1 address", raw.cpu_seconds, due, raw.received, raw.lost)]
    progress.advance()
    for count in (1, len(servers)):
        name = f"AsyncClient, {count} address{'es' if count > 1 else ''}"
        progress.note(f"open loop, {name}")
        run = client_load.open_loop(_addresses(servers[:count]), "lstm", requests, due)
        failed = sum(error is not None for error in run.errors)
        rows.append(servers_report.client_cost(name, run.cpu_seconds, due, run.received, failed))
        progress.advance()
    return rows


def _failover(
    fleet: Fleet, quick: bool, inputs: list[dict[str, Any]], rate: float, plan: Plan, progress: Progress
) -> list[dict]:
    """Part 3: one fault per open-loop run, each to the first standing server; answers checked after each."""
    model = build_model(load_config(fleet.config).models["lstm"])
    state = model.load_weights()
    # The reference answers are tiny LSTMs: a second intra-op thread only spins against the servers on a
    # busy machine (80 answers took 20 s on two threads, 0.4 s on one, here under load).
    torch.set_num_threads(1)
    rng = np.random.default_rng(1)
    standing = list(fleet.servers)
    rows = []
    for name, signum in FAULTS.items():
        if quick and signum == signal.SIGSTOP:
            continue
        if not quick and len(standing) < len(HOSTS):
            progress.note("replacing the server lost")
            standing += fleet.start([host for host in HOSTS if host not in {server.host for server in standing}])
            progress.advance()
        target = standing[0]
        progress.note(f"open loop, {name} to {target.address}")
        due = poisson_schedule(rate, plan.fault_run, rng)
        requests = _draw(inputs, len(due), rng)
        fault = _fault(name, signum, target, plan.fault_at)
        run = client_load.open_loop(_addresses(standing), "lstm", requests, due, fault, keep_outputs=True)
        status = _settle(target, signum)
        resent = [i for i, sends in enumerate(run.sends) if len(sends) > 1]
        sample = rng.choice(len(due), size=min(plan.checked, len(due)), replace=False).tolist()
        checked = sorted(i for i in {*resent, *sample} if run.outputs[i] is not None)
        check = compare(model, state, [requests[i] for i in checked], [run.outputs[i] for i in checked])
        rows.append({**servers_report.fault(name, target.address, len(standing), run, check), "exit_status": status})
        standing.remove(target)
        progress.advance()
    return rows


def run(quick: bool) -> dict[str, Any]:
    """Every measurement of the preset (module docstring), as a JSON-ready result."""
    plan = QUICK if quick else FULL
    started = time.time()
    load_average = os.getloadavg()
    rng = np.random.default_rng(0)
    inputs = DATASETS["wmt"]()
    progress = Progress(9 if quick else 12)  # starting, 3 closed loops, 3 cost runs, the faults (and replacements)
    with (
        tempfile.TemporaryDirectory(prefix="batchmaker-servers-") as tmp,
        Fleet(_write_config(Path(tmp)), Path(tmp)) as fleet,
    ):
        progress.note(f"starting {len(HOSTS)} servers")
        fleet.start(list(HOSTS))
        progress.advance()
        throughput = _throughput(fleet, [inputs[i] for i in rng.permutation(len(inputs))], plan, progress)
        rate = STEADY * min(row["requests_per_s"] for row in throughput)
        due = poisson_schedule(rate, plan.steady, rng)
        costs = _client_costs(fleet.servers, _draw(inputs, len(due), rng), due, progress)
        faults = _failover(fleet, quick, inputs, rate, plan, progress)
    progress.close()
    return {
        "preset": "servers",
        "quick": quick,
        "commit": git("rev-parse", "HEAD"),
        "describe": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "load_average": list(load_average),
        "workload": WORKLOAD,
        "config": CONFIG.strip(),
        "plan": asdict(plan),
        "window": WINDOW,
        "throughput": throughput,
        "steady_rps": rate,
        "client_cost": costs,
        "faults": faults,
        "seconds": time.time() - started,
    }
