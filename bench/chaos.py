"""`./scripts/bench chaos`: three servers behind one AsyncClient, faulted one after another under load.

Real servers (`batchmaker serve`, one CPU worker each) on 127.0.0.2, .3 and .4 serve three models at
once, small enough for a shared two-core machine: an LSTM (hidden 64, WMT sentences), a TreeLSTM
(hidden 64, SST trees) and a Seq2Seq (hidden 64, WMT sentences, greedy decoding to EOS). One
AsyncClient with the library's defaults sends them Poisson arrivals at RATE per second, the model of
each drawn at random, for five minutes (`--quick`: one). The run is cut into equal windows: a quiet
one, then one per fault of FAULTS, each fault struck early in its window:

* kill -9 of a worker (its supervisor restarts it; the manager replays its requests);
* SIGSTOP of a worker for STOP_S, then SIGCONT;
* kill -9 of a manager (its supervisor stops the server: a replacement is started on its address);
* kill -9 of a whole server, as `kill -9` of its process group does: the supervisor alone (the manager
  and workers have groups of their own and drain as orphans), replaced once they have exited;
* SIGTERM of a server's supervisor: it drains and exits, and is replaced;
* a client that sends requests to a server and disconnects before their answers;
* a slow reader that sends requests and reads nothing for SLOW_PAUSE_S.

Every request of the main load is tallied in the window it was due in: answered ok, answered with an
error (by code), lost, answered twice by one server; every ok answer is checked against the model's
unbatched reference. The resident memory of each manager alive from the end of the quiet window to
the end of the run is compared (the faults spare the middle server's manager, so one always is).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import zmq
import zmq.asyncio

from batchmaker.bench import chaos_report
from batchmaker.bench.client_load import RecordingClient
from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.generator import poisson_schedule
from batchmaker.bench.presets import LSTM, SEQ2SEQ, TREELSTM
from batchmaker.bench.progress import Progress
from batchmaker.bench.report import finite
from batchmaker.bench.run import ROOT, git, machine
from batchmaker.bench.servers import HOSTS, SERVER, Fleet
from batchmaker.bench.verify import TOLERANCE, mismatch
from batchmaker.clients import ServerError
from batchmaker.clients.messages import infer_message, to_infer_reply
from batchmaker.clients.servers import Server, is_probe
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model, init_missing_weights
from batchmaker.common.protocol import encode
from batchmaker.manager.commands.launcher import ServerProcess, free_port_on, roles

RATE = 40.0  # requests per second offered: well within what two of the three servers serve
FULL_S, QUICK_S = 300.0, 60.0
STOP_S = 2.0  # a stopped worker's pause: shorter than the heartbeat timeout, so it is waited for, not written off
SIDE_REQUESTS = 40  # requests of the disconnecting client and of the slow reader
SLOW_PAUSE_S = 3.0
CLIENT_TIMEOUT_S = 60.0
EXIT_WAIT_S = 60.0  # for a faulted server's processes to exit before its replacement takes the address
DATA = {"lstm": "wmt", "seq2seq": "wmt", "treelstm": "sst"}


def _small(toml: str) -> str:
    """A preset's model at hidden and embedding size 64 (weights of their own)."""
    return toml.replace("_size = 256", "_size = 64").replace("-h256", "-h64")


CONFIG = SERVER + "drain_timeout_ms = 10000\n" + "".join(_small(toml) for toml in (LSTM, SEQ2SEQ, TREELSTM))


class TallyingClient(RecordingClient):
    """A RecordingClient that also counts every reply by (server address, request id), to find a server
    answering one request twice."""

    def __init__(self, addresses: list[str], start: float, **options: Any):
        super().__init__(addresses, start, **options)
        self.replies: dict[Any, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def _on_reply(self, server: Server, reply: dict[str, Any]) -> None:
        if not is_probe(reply["id"]):
            self.replies[reply["id"]][server.address] += 1
        super()._on_reply(server, reply)


@dataclass
class Run:
    """The state the faults act on: the fleet, the server standing at each of the three addresses (and the
    replacements under way), the side clients' requests and their counts."""

    fleet: Fleet
    standing: list[ServerProcess]
    side_frames: list[bytes]
    side: dict[str, dict[str, int]] = field(default_factory=dict)
    replacing: dict[int, asyncio.Task[None]] = field(default_factory=dict)

    async def ready(self, index: int) -> ServerProcess:
        """The server at `index`, once a replacement under way there is ready."""
        if index in self.replacing:
            await self.replacing.pop(index)
        return self.standing[index]

    async def pid(self, index: int, role: str) -> int:
        server = await self.ready(index)
        return next(pid for pid, found in roles(server.process).items() if found == role)

    def replace(self, index: int, processes: list[psutil.Process]) -> None:
        """Start, in the background, a new server on the address of the faulted one once `processes` (its) exit."""
        self.replacing[index] = asyncio.create_task(self._replace(index, processes))

    async def _replace(self, index: int, processes: list[psutil.Process]) -> None:
        _, alive = await asyncio.to_thread(psutil.wait_procs, processes, EXIT_WAIT_S)
        if alive:
            raise SystemExit(f"{self.standing[index].address}: processes {[p.pid for p in alive]} did not exit")
        old = self.standing[index]
        port = int(old.address.rpartition(":")[2])
        (self.standing[index],) = await asyncio.to_thread(self.fleet.start, [old.host], [port])

    async def settle(self) -> None:
        """Wait for every replacement under way."""
        for index in list(self.replacing):
            await self.ready(index)


async def kill_worker(run: Run, index: int) -> None:
    os.kill(await run.pid(index, "worker"), signal.SIGKILL)


async def stop_worker(run: Run, index: int) -> None:
    worker = await run.pid(index, "worker")
    os.kill(worker, signal.SIGSTOP)
    await asyncio.sleep(STOP_S)
    os.kill(worker, signal.SIGCONT)


async def kill_manager(run: Run, index: int) -> None:
    manager = await run.pid(index, "manager")
    processes = run.standing[index].processes()
    os.kill(manager, signal.SIGKILL)
    run.replace(index, processes)


async def kill_server(run: Run, index: int) -> None:
    server = await run.ready(index)
    processes = server.processes()
    server.process.kill()  # the supervisor alone: its process group holds nothing else
    run.replace(index, processes)


async def drain(run: Run, index: int) -> None:
    server = await run.ready(index)
    processes = server.processes()
    server.process.send_signal(signal.SIGTERM)
    run.replace(index, processes)


def _side_socket(address: str, options: dict[int, int]) -> zmq.asyncio.Socket:
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    for option, value in options.items():
        socket.setsockopt(option, value)
    socket.connect(address)
    return socket


async def disconnecting_client(run: Run, index: int) -> None:
    """Send requests, wait for the first answer (the server is working on them), close without reading more."""
    frames = run.side_frames
    socket = _side_socket((await run.ready(index)).address, {zmq.LINGER: 0})
    for frame in frames:
        await socket.send(frame)
    answered = int(await socket.poll(int(CLIENT_TIMEOUT_S * 1000)) != 0)
    socket.close()
    run.side["disconnecting client"] = {"sent": len(frames), "answered": answered, "expected": 1}


async def slow_reader(run: Run, index: int) -> None:
    """Send requests with a receive queue of one message, read nothing for SLOW_PAUSE_S, then read every answer."""
    frames = run.side_frames
    socket = _side_socket((await run.ready(index)).address, {zmq.LINGER: 0, zmq.RCVHWM: 1, zmq.RCVBUF: 4096})
    for frame in frames:
        await socket.send(frame)
    await asyncio.sleep(SLOW_PAUSE_S)
    answered = 0
    while answered < len(frames) and await socket.poll(int(CLIENT_TIMEOUT_S * 1000)):
        await socket.recv()
        answered += 1
    socket.close()
    run.side["slow reader"] = {"sent": len(frames), "answered": answered, "expected": len(frames)}


Action = Callable[[Run, int], Awaitable[None]]
# (name, action, index of the server it strikes): the middle server's manager is never faulted.
FAULTS: list[tuple[str, Action, int]] = [
    ("kill -9 worker", kill_worker, 0),
    ("SIGSTOP/SIGCONT worker", stop_worker, 1),
    ("kill -9 manager", kill_manager, 2),
    ("client disconnects mid-request", disconnecting_client, 1),
    ("kill -9 whole server", kill_server, 0),
    ("slow reader", slow_reader, 1),
    ("SIGTERM drain", drain, 2),
]
QUIET = "none (quiet start)"


def _workload(count: int, rng: np.random.Generator) -> list[tuple[str, dict[str, Any]]]:
    data = {name: DATASETS[name]() for name in set(DATA.values())}
    models = rng.choice(sorted(DATA), size=count)
    return [(str(m), data[DATA[m]][int(rng.integers(len(data[DATA[m]])))]) for m in models]


def _manager_rss(run: Run) -> dict[str, int]:
    found = {}
    for server in run.standing:
        for pid, role in roles(server.process).items():
            if role == "manager":
                try:
                    found[f"{server.address} pid {pid}"] = psutil.Process(pid).memory_info().rss
                except psutil.NoSuchProcess:
                    pass
    return found


async def _load(run: Run, work: list[tuple[str, dict[str, Any]]], due: np.ndarray, window: float,
                progress: Progress) -> dict[str, Any]:
    """The main load and the faults on one clock; what became of each request, and the managers' memory."""
    start = time.monotonic()
    client = TallyingClient([s.address for s in run.standing], start, timeout=CLIENT_TIMEOUT_S)
    outcomes: list[str] = [chaos_report.LOST] * len(due)
    outputs: list[dict[str, Any] | None] = [None] * len(due)

    async def one(index: int) -> None:
        model, inputs = work[index]
        try:
            reply = await client.call({**infer_message(model, inputs, None, None), "id": index})
            outputs[index], outcomes[index] = to_infer_reply(reply).outputs, chaos_report.OK
        except ServerError as exc:
            outcomes[index] = exc.code
        except (TimeoutError, ConnectionError):
            pass  # LOST

    async def script() -> dict[str, int]:
        await asyncio.sleep(max(0.0, start + window - time.monotonic()))
        rss = _manager_rss(run)
        for number, (name, action, index) in enumerate(FAULTS, start=1):
            await asyncio.sleep(max(0.0, start + (number + 0.25) * window - time.monotonic()))
            progress.note(f"chaos: {name} on {run.standing[index].address}")
            await action(run, index)
            progress.advance()
        await run.settle()
        return rss

    async with client:
        faults = asyncio.create_task(script())
        calls = []
        for index, at in enumerate(due):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            calls.append(asyncio.create_task(one(index)))
        await asyncio.gather(*calls)
        rss_start = await faults
    return {
        "outcomes": outcomes,
        "outputs": outputs,
        "answered_twice": [
            chaos_report.replies_beyond_sends(
                [a for _, a in client.sends.get(i, [])], client.replies.get(i, collections.Counter())
            )
            for i in range(len(due))
        ],
        "resent": client.resent,
        "set_aside": client.set_aside,
        "rss": (rss_start, _manager_rss(run)),
    }


def _wrong(
    config_path: Path, work: list[tuple[str, dict[str, Any]]], outputs: list[dict[str, Any] | None]
) -> list[bool]:
    """Per request: whether its ok answer differs from the unbatched reference."""
    torch.set_num_threads(1)  # tiny models: a second thread only spins against the servers
    config = load_config(config_path)
    models = {name: build_model(config.models[name]) for name in DATA}
    states = {name: model.load_weights() for name, model in models.items()}
    wrong = []
    for (name, inputs), served in zip(work, outputs, strict=True):
        if served is None:
            wrong.append(False)
            continue
        error, problem = mismatch(models[name], states[name], inputs, served)
        wrong.append(error > TOLERANCE or problem is not None)
    return wrong


def run(quick: bool) -> dict[str, Any]:
    seconds = QUICK_S if quick else FULL_S
    window = seconds / (len(FAULTS) + 1)
    started = time.time()
    rng = np.random.default_rng(0)
    due = poisson_schedule(RATE, seconds, rng)
    work = _workload(len(due), rng)
    progress = Progress(len(FAULTS) + 2)
    with tempfile.TemporaryDirectory(prefix="batchmaker-chaos-") as tmp:
        config_path = Path(tmp) / "chaos.toml"
        config_path.write_text(CONFIG.format(port=free_port_on("127.0.0.1"), weights=ROOT / "weights"))
        init_missing_weights(load_config(config_path))
        with Fleet(config_path, Path(tmp)) as fleet:
            progress.note(f"chaos: starting {len(HOSTS)} servers")
            side = [
                encode({**infer_message(m, x, None, None), "id": i}) for i, (m, x) in enumerate(work[:SIDE_REQUESTS])
            ]
            state = Run(fleet, fleet.start(list(HOSTS)), side)
            progress.advance()
            loaded = asyncio.run(_load(state, work, due, window, progress))
        progress.note("chaos: checking every ok answer against the reference")
        wrong = _wrong(config_path, work, loaded["outputs"])
    progress.advance()
    progress.close()
    names = [QUIET, *(name for name, _, _ in FAULTS)]
    requests = [
        chaos_report.Request(min(int(at // window), len(FAULTS)), outcome, twice, bad)
        for at, outcome, twice, bad in zip(due, loaded["outcomes"], loaded["answered_twice"], wrong, strict=True)
    ]
    rows = chaos_report.tally(names, requests)
    for row, (_, _, index) in zip(rows[1:], FAULTS, strict=True):
        row["target"] = HOSTS[index]
    return {
        "preset": "chaos",
        "quick": quick,
        "commit": git("rev-parse", "HEAD"),
        "describe": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "seconds_of_load": seconds,
        "window_s": window,
        "rate_rps": RATE,
        "requests": len(due),
        "resent": loaded["resent"],
        "set_aside": loaded["set_aside"],
        "faults": rows,
        "side_clients": state.side,
        "manager_rss": chaos_report.rss_growth(*loaded["rss"]),
        "seconds": time.time() - started,
    }


def main(quick: bool, out: Path) -> bool:
    """Run, write out/chaos.json, print the table; False if a goal was missed."""
    result = run(quick)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "chaos.json"
    path.write_text(json.dumps(finite(result), indent=1))
    print(f"\n## chaos: {result['requests']} requests at {RATE:g}/s over {result['seconds_of_load']:g} s, "
          f"one fault per {result['window_s']:.1f} s window ({result['resent']} resent)\n")
    print(chaos_report.table(result))
    print(f"wrote {path}")
    found = chaos_report.problems(result)
    for problem in found:
        print(f"chaos: {problem}", file=sys.stderr)
    return not found
