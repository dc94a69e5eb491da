"""`bench http`: what the Open Inference Protocol front door adds, and Triton on the same load.

The `lstm` preset's model and WMT sentences, at the same Poisson rates, sent three ways:

* through batchmaker's gRPC front door, by `tritonclient.grpc.aio` (bench/oip_load.py);
* through its ZeroMQ door, by the project's client (bench/client_load.py), on the same server: the front door's
  added p50/p99 latency is the difference, and its CPU per request comes from its process's CPU time;
* to Triton serving the same nn.Embedding + nn.LSTM (bench/triton_lstm.py), by the same tritonclient generator,
  in each setup of bench/triton_setups.py: its sequence batcher's `direct` strategy with one model instance a
  core and several tokens a request (the setup a capable Triton user would choose for this model on a CPU
  machine), its dynamic batcher (max batch 64, 2 ms queue delay), which joins only requests of one shape
  (pytriton offers no ragged batching), so on WMT's lengths it batches sentences of equal length only, and its
  sequence batcher's `oldest` strategy with one instance and one token a request. To the sequence batcher each
  sentence is a sequence of requests, and its latency is the whole sentence's. Each setup is recorded beside
  its numbers; Triton, when it is not installed or does not start, is recorded as skipped with the reason; its
  CPU is its whole process tree's (tritonserver, its Python backend stubs, and the process running the model).

The rates rise until a way fails: each way is sent every rate up to the first at which it answers with p90 over
P90_LIMIT_MS or refuses anything, and its peak is the highest rate it sustained. The peaks' ratios say what the
front door sustains against Triton and against the ZeroMQ door; the Triton ones are the JSON's `peers`
(bench/results.py), each with its setup, which the results page lists among other systems (quoting the strongest).

Every way's answers are checked against the unbatched reference model.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchmaker.bench import client_load, oip_load
from batchmaker.bench.client_load import OpenLoop
from batchmaker.bench.datasets import wmt
from batchmaker.bench.generator import poisson_schedule
from batchmaker.bench.oip_load import Target
from batchmaker.bench.presets import LSTM
from batchmaker.bench.run import git, machine, write_config
from batchmaker.bench.sweep import ServedPolicy
from batchmaker.bench.triton_lstm import TritonLSTM, TritonUnavailable
from batchmaker.bench.triton_setups import Setup, setups
from batchmaker.bench.verify import compare_replies
from batchmaker.clients.loadgen import percentiles
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model
from batchmaker.manager.commands.launcher import cpu_seconds, free_port_on

MODEL = "lstm"
OUTPUTS = ("h", "c")


@dataclass(frozen=True)
class Plan:
    rates: tuple[float, ...]  # offered requests per second
    seconds: float  # per rate
    verify_requests: int  # sent at once to each way, every answer checked


FULL = Plan(tuple(float(round(10 * 1.25**step)) for step in range(31)), seconds=6.0, verify_requests=60)  # to 8,078
QUICK = Plan((50.0, 150.0), seconds=2.0, verify_requests=12)  # under a minute with Triton
P90_LIMIT_MS = 100.0  # the latency a way must keep to sustain a rate


@dataclass(frozen=True)
class Load:
    """The requests of every rate, in order, the same for every way they are sent."""

    rates: tuple[float, ...]
    due: list[np.ndarray]
    inputs: list[list[dict[str, Any]]]

    @staticmethod
    def of(plan: Plan, dataset: list[dict[str, Any]]) -> Load:
        due, inputs = [], []
        for seed, rate in enumerate(plan.rates):
            rng = np.random.default_rng(seed)
            due.append(poisson_schedule(rate, plan.seconds, rng))
            order = rng.permutation(len(dataset))
            inputs.append([dataset[order[i % len(order)]] for i in range(len(due[-1]))])
        return Load(plan.rates, due, inputs)


def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two samples by role: the whole server's ("server": batchmaker's processes, or
    Triton's), and its front door process's where it has one."""
    spent = {role: seconds - before.get(role, 0.0) for role, seconds in after.items()}
    return {"server": sum(spent.values()), **{role: spent[role] for role in ("frontdoor",) if role in spent}}


def summary(run: OpenLoop, cpu_s: dict[str, float]) -> dict[str, Any]:
    """One way at one rate: latency from each request's scheduled send, refusals by code, and CPU milliseconds
    per request sent, of the server side by role (`cpu_s`, from `used`) and of the load's client."""
    ok = np.array([error is None for error in run.errors], dtype=bool)
    errors: dict[str, int] = {}
    for error in run.errors:
        if error is not None:
            errors[error] = errors.get(error, 0) + 1
    latency = (run.received - run.due)[ok]
    span = float(np.nanmax(run.received[ok])) - float(latency.min()) if ok.any() else 0.0
    count = max(1, len(run.due))
    return {
        "sent": len(run.due),
        "ok": int(ok.sum()),
        "errors": errors,
        "achieved_rps": int(ok.sum()) / span if span > 0 else 0.0,
        "latency_ms": percentiles(latency * 1e3),
        "cpu_ms_per_request": {
            **{role: s * 1e3 / count for role, s in cpu_s.items()},
            "client": run.cpu_seconds * 1e3 / count,
        },
    }


def sustained(row: dict[str, Any]) -> bool:
    """The way kept up at this rate: nothing refused or lost, p90 within P90_LIMIT_MS."""
    return row["ok"] == row["sent"] and row["latency_ms"]["p90"] <= P90_LIMIT_MS


def tokens(inputs: list[dict[str, Any]]) -> list[list[int]]:
    return [request["tokens"] for request in inputs]


def _verify_oip(target: Target, requests: list[dict[str, Any]], expected: list[dict[str, Any]]) -> dict[str, Any]:
    """All `requests` at once through gRPC (so that they batch), every answer against the reference's."""
    run = oip_load.open_loop(target, tokens(requests), np.zeros(len(requests)), keep_outputs=True)
    return check_run(run, expected)


def check_run(run: OpenLoop, expected: list[dict[str, Any]]) -> dict[str, Any]:
    refused = [f"request {i}: {error}" for i, error in enumerate(run.errors) if error is not None]
    if refused:
        return {"checked": 0, "max_abs_error": float("nan"), "wrong": refused[:3], "ok": False}
    return compare_replies(expected, [outputs or {} for outputs in run.outputs])


def run_doors(config: Path, load: Load, check: list[dict[str, Any]], expected: list[dict[str, Any]]) -> dict[str, Any]:
    """One batchmaker server (cellular) with its gRPC front door: each rate through ZeroMQ, then through gRPC,
    each door until it fails a rate."""
    address = load_config(config).server.address
    grpc = f"127.0.0.1:{free_port_on('127.0.0.1')}"
    door = Target(grpc, MODEL, OUTPUTS, batched=False)
    rows: list[dict[str, Any]] = []
    going = ["zmq", "grpc"]  # the doors that sustained every rate so far
    with ServedPolicy(config, address, "cellular", MODEL, "--grpc", grpc) as served:
        for rate, due, inputs in zip(load.rates, load.due, load.inputs):
            if not going:
                break
            row: dict[str, Any] = {"offered_rps": rate}
            for way in list(going):
                before = served.cpu_seconds()
                if way == "zmq":
                    run = client_load.open_loop([address], MODEL, inputs, due)
                else:
                    run = oip_load.open_loop(door, tokens(inputs), due)
                served.wait_idle()
                row[way] = summary(run, used(before, served.cpu_seconds()))
                if not sustained(row[way]):
                    going.remove(way)
            if "zmq" in row and "grpc" in row:
                added = {p: row["grpc"]["latency_ms"][p] - row["zmq"]["latency_ms"][p] for p in ("p50", "p99")}
                row["added_latency_ms"] = added
            rows.append(row)
        zmq_check = client_load.open_loop([address], MODEL, check, np.zeros(len(check)), keep_outputs=True)
        verify = {"zmq": check_run(zmq_check, expected), "grpc": _verify_oip(door, check, expected)}
    return {"rows": rows, "verify": verify}


def run_triton(
    config: Path, setup: Setup, load: Load, check: list[dict[str, Any]], expected: list[dict[str, Any]]
) -> dict[str, Any]:
    """Triton in `setup`, driven by the gRPC door's generator at each rate until it fails one; or why it was
    skipped. Either way with the setup."""
    record = {"setup": setup.record()}
    try:
        with TritonLSTM(config, setup) as triton:
            target = Target(triton.address, MODEL, OUTPUTS, batched=True, tokens_per_call=setup.tokens_per_request)
            rows = []
            for rate, due, inputs in zip(load.rates, load.due, load.inputs):
                before = cpu_seconds(triton.pids())
                run = oip_load.open_loop(target, tokens(inputs), due)
                rows.append({"offered_rps": rate, **summary(run, used(before, cpu_seconds(triton.pids())))})
                if not sustained(rows[-1]):
                    break
            return record | {"version": triton.version, "rows": rows, "verify": _verify_oip(target, check, expected)}
    except TritonUnavailable as exc:
        return record | {"skipped": str(exc)}


def way_rows(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each way's rows, in rising rate order, by its name in the report."""
    ways = {
        f"{name} door": [
            row[way] | {"offered_rps": row["offered_rps"]} for row in result["doors"]["rows"] if way in row
        ]
        for way, name in (("zmq", "zmq"), ("grpc", "gRPC"))
    }
    found = result["triton"]["setups"]
    return ways | {f"Triton {name}": section["rows"] for name, section in found.items() if "rows" in section}


def peak(rows: list[dict[str, Any]]) -> float | None:
    """The highest rate sustained (the rates rise), or None when not even the first was."""
    rates = [row["offered_rps"] for row in rows if sustained(row)]
    return max(rates) if rates else None


def p90_at(rows: list[dict[str, Any]], rate: float) -> float | None:
    return next((row["latency_ms"]["p90"] for row in rows if row["offered_rps"] == rate), None)


def peaks(result: dict[str, Any]) -> dict[str, Any]:
    """Each way's peak, and the gRPC door's over each other way's (where both sustained a rate)."""
    rows = way_rows(result)
    found = {way: peak(sent) for way, sent in rows.items()}
    door = found["gRPC door"]
    ratios = {f"gRPC door / {way}": door / rate for way, rate in found.items() if way != "gRPC door" and door and rate}
    return {"p90_limit_ms": P90_LIMIT_MS, "requests_per_s": found, "ratios": ratios}


def peers(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Triton's setups against the gRPC door, each at its peak, in bench/results.py's `peers` format with its
    setup; the p90s are both's at the lower of the two peaks."""
    rows, found = way_rows(result), result["peaks"]["requests_per_s"]
    door = found["gRPC door"]
    entries = []
    for name, section in result["triton"]["setups"].items():
        theirs = found.get(f"Triton {name}")
        if theirs is None or door is None:
            continue
        entries.append(
            {
                "name": f"Triton {section['version']}",
                "setup": section["setup"]["text"],
                "setting": "gRPC by tritonclient, a sentence's latency to the answer of its last request; Poisson "
                f"arrivals of WMT sentences, each at its highest rate with p90 <= {P90_LIMIT_MS:.0f} ms and nothing "
                "refused; cellular batching through its gRPC front door",
                "requests_per_s": theirs,
                "cellular_requests_per_s": door,
                "p90_ms": p90_at(rows[f"Triton {name}"], min(theirs, door)),
                "cellular_p90_ms": p90_at(rows["gRPC door"], min(theirs, door)),
            }
        )
    return entries


def run(quick: bool, triton_setups: tuple[Setup, ...] | None = None) -> dict[str, Any]:
    """The whole benchmark, Triton in `triton_setups` (default: bench/triton_setups.py's, one instance a core)."""
    plan = QUICK if quick else FULL
    triton_setups = setups() if triton_setups is None else triton_setups
    started = time.time()
    dataset = wmt()
    load = Load.of(plan, dataset)
    with tempfile.TemporaryDirectory(prefix="batchmaker-bench-http-") as tmp:
        config = write_config(LSTM, Path(tmp))
        model = build_model(load_config(config).models[MODEL])
        state = model.load_weights()
        check = dataset[: plan.verify_requests]
        expected = [model.reference(state, request) for request in check]
        doors = run_doors(config, load, check, expected)
        triton = {setup.name: run_triton(config, setup, load, check, expected) for setup in triton_setups}
    result = {
        "preset": "http",
        "description": "LSTM on WMT sentences through the gRPC front door, the ZeroMQ door, and Triton",
        "quick": quick,
        "commit": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "model": {"name": MODEL, "toml": LSTM.strip()},
        "load": {"dataset": "wmt", "rates": list(plan.rates), "seconds_per_rate": plan.seconds},
        "doors": doors,
        "triton": {"torch_threads_per_instance": 1, "setups": triton},
    }
    result["peaks"] = peaks(result)
    result["peers"] = peers(result)
    return result | {"seconds": time.time() - started}


def checks(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every answer check of a result, by the way it was sent."""
    found = {f"batchmaker {way}": check for way, check in result["doors"]["verify"].items()}
    for name, section in result["triton"]["setups"].items():
        if "verify" in section:
            found[f"triton {name}"] = section["verify"]
    return found


def table(result: dict[str, Any]) -> str:
    """The report: per rate, each way's p50/p90/p99 and server-side CPU per request while it kept up; the peaks
    and their ratios; the skips; the answer checks."""
    lines = [
        "| offered req/s | way | ok/sent | p50 ms | p90 ms | p99 ms | server CPU ms/req | of it, front door |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ways = [(way, row) for way, rows in way_rows(result).items() for row in rows]
    for way, row in sorted(ways, key=lambda item: item[1]["offered_rps"]):  # by rate, then way
        cpu, latency = row["cpu_ms_per_request"], row["latency_ms"]
        door = f"{cpu['frontdoor']:.3f}" if "frontdoor" in cpu else ""
        lines.append(
            f"| {row['offered_rps']:.0f} | {way} | {row['ok']}/{row['sent']} | {latency['p50']:.2f} "
            f"| {latency['p90']:.2f} | {latency['p99']:.2f} | {cpu['server']:.3f} | {door} |"
        )
    lines.append("")
    for row in result["doors"]["rows"]:
        if "added_latency_ms" in row:
            added = row["added_latency_ms"]
            lines.append(
                f"gRPC door at {row['offered_rps']:.0f} req/s adds p50 {added['p50']:+.2f} ms, "
                f"p99 {added['p99']:+.2f} ms; its process used "
                f"{row['grpc']['cpu_ms_per_request']['frontdoor']:.3f} ms CPU per request"
            )
    found = result["peaks"]
    for way, rate in found["requests_per_s"].items():
        sustained_rate = f"{rate:.0f} req/s" if rate is not None else "none of the rates"
        if rate == result["load"]["rates"][-1]:
            sustained_rate += " or more: every rate sent"
        lines.append(f"peak {way}: {sustained_rate} (p90 <= {found['p90_limit_ms']:.0f} ms, nothing refused)")
    lines += [f"{ratio}: {value:.2f}x" for ratio, value in found["ratios"].items()]
    for name, section in result["triton"]["setups"].items():
        lines.append(f"Triton {name}: {section['setup']['text']}")
        if "skipped" in section:
            lines.append(f"Triton {name}: skipped: {section['skipped']}")
    for way, check in checks(result).items():
        state = "ok" if check["ok"] else "WRONG: " + "; ".join(check["wrong"])
        lines.append(f"answers {way}: {check['checked']} checked, max abs error {check['max_abs_error']:.1e} {state}")
    return "\n".join(lines)
