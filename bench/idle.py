"""`./scripts/bench idle`: a lone request on an idle server against the same model run in this process.

One server (one CPU worker, one intra-op thread, the cellular policy) serves every model of the
presets at hidden 256. Row by row, requests go one at a time (a closed loop of window 1), and each
is also run through the model's unbatched reference forward in this process (`reference_forward`:
torch.nn.Embedding + torch.nn.LSTM at batch 1 for the LSTM, the greedy decoding loop for Seq2Seq,
the node-at-a-time equations for the TreeLSTM), with one intra-op thread like the worker: served,
then in process, request after request, so both are measured side by side under the same load.
The served latency is the client's, from the send to the decoded reply. Every served reply is
checked against the in-process one. The goal is a served p50 of at most 1.5x the in-process p50.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchmaker.bench.datasets import DATASETS
from batchmaker.bench.presets import GRU, LSTM, SEQ2SEQ, SEQ2SEQ_ATTENTION, TAGGER, TREELSTM
from batchmaker.bench.progress import Progress
from batchmaker.bench.run import git, machine, serve_options, write_config
from batchmaker.bench.sweep import ServedPolicy
from batchmaker.bench.verify import compare_replies
from batchmaker.clients import Client
from batchmaker.clients.loadgen import percentiles
from batchmaker.common.config import load_config
from batchmaker.common.models import build_model

GOAL = 1.5  # served p50 over in-process p50
LONE_LENGTH = 22  # the fixed request's tokens: about the mean WMT sentence
POINTS = (50, 99)
READY_TIMEOUT_S_PER_MODEL = 180  # the server warms every model's cells up before it answers: slow on a busy machine
MODELS = {
    "lstm": LSTM,
    "gru": GRU,
    "tagger": TAGGER,
    "seq2seq": SEQ2SEQ,
    "attention": SEQ2SEQ_ATTENTION.replace("[models.seq2seq", "[models.attention"),
    "treelstm": TREELSTM,
}


def lone_sentence() -> list[dict[str, Any]]:
    """The first bundled sentence of `LONE_LENGTH` tokens, alone: every request of its row is this one."""
    return [next(request for request in DATASETS["wmt"]() if len(request["tokens"]) == LONE_LENGTH)]


@dataclass(frozen=True)
class Row:
    name: str
    model: str  # a key of MODELS
    inputs: Callable[[], list[dict[str, Any]]]


ROWS = (
    Row(f"LSTM, one {LONE_LENGTH}-token request", "lstm", lone_sentence),
    Row("LSTM, WMT sentences", "lstm", DATASETS["wmt"]),
    Row("GRU, WMT sentences", "gru", DATASETS["wmt"]),
    Row("BiLSTM tagger, WMT sentences", "tagger", DATASETS["wmt"]),
    Row("Seq2Seq to EOS, WMT sentences", "seq2seq", DATASETS["wmt"]),
    Row("Seq2Seq with attention, WMT sentences", "attention", DATASETS["wmt"]),
    Row("TreeLSTM, SST trees", "treelstm", DATASETS["sst"]),
)


@dataclass(frozen=True)
class Plan:
    """Requests timed per row, and requests run untimed before them (plans made, caches warm)."""

    requests: int
    warmup: int


QUICK = Plan(requests=12, warmup=3)
FULL = Plan(requests=300, warmup=40)


def sample(row: Row, count: int, seed: int) -> list[dict[str, Any]]:
    """`count` of the row's inputs, drawn at random (repeated when the row has fewer)."""
    inputs = row.inputs()
    return [inputs[i] for i in np.random.default_rng(seed).integers(0, len(inputs), count)]


def measure_row(client: Client, row: Row, forward: Callable[[Any], dict[str, Any]], plan: Plan, seed: int) -> dict:
    """The row's requests one at a time, each served and then run in process; latencies and the check."""
    for inputs in sample(row, plan.warmup, seed + 1):
        client.infer(row.model, inputs)
        forward(inputs)
    served, in_process, server_total, expected, outputs = [], [], [], [], []
    for inputs in sample(row, plan.requests, seed):
        start = time.perf_counter()
        reply = client.infer(row.model, inputs)
        served.append(time.perf_counter() - start)
        start = time.perf_counter()
        want = forward(inputs)
        in_process.append(time.perf_counter() - start)
        server_total.append(reply.timing["total_us"] / 1e6)
        expected.append(want)
        outputs.append(reply.outputs)
    served_ms = percentiles(np.array(served) * 1e3, POINTS)
    in_process_ms = percentiles(np.array(in_process) * 1e3, POINTS)
    return {
        "row": row.name,
        "model": row.model,
        "requests": plan.requests,
        "served_ms": served_ms,
        "in_process_ms": in_process_ms,
        "server_total_ms": percentiles(np.array(server_total) * 1e3, POINTS),
        "ratio": {key: served_ms[key] / in_process_ms[key] for key in served_ms},
        "goal_met": served_ms["p50"] <= GOAL * in_process_ms["p50"],
        "verify": compare_replies(expected, outputs),
    }


def run(quick: bool, out: Path, rows: tuple[Row, ...] = ROWS, running_batch: str | None = None) -> dict[str, Any]:
    """Every row on one server serving the rows' models; writes OUT/idle.json. `running_batch`: who decides each
    step (None: the default)."""
    plan = QUICK if quick else FULL
    started = time.time()
    load_before = os.getloadavg()
    models_toml = "".join(MODELS[name] for name in dict.fromkeys(row.model for row in rows))
    torch.set_num_threads(1)  # like the worker (threads_per_worker = 1)
    progress = Progress(len(rows) + 1)
    with tempfile.TemporaryDirectory(prefix="batchmaker-idle-") as tmp:
        config_path = write_config(models_toml, Path(tmp))
        config = load_config(config_path)
        forwards = {}
        for name in config.models:
            model = build_model(config.models[name])
            forwards[name] = model.reference_forward(model.load_weights())
        progress.note("starting the server")
        ready_timeout = READY_TIMEOUT_S_PER_MODEL * len(config.models)
        options = serve_options("cellular", running_batch)
        with ServedPolicy(
            config_path, config.server.address, "cellular", rows[0].model, *options, ready_timeout=ready_timeout
        ) as served:
            running_batch = served.stats()["running_batch"]
            progress.advance()
            results = []
            with Client(served.address, timeout=120) as client:
                for seed, row in enumerate(rows):
                    progress.note(row.name)
                    results.append(measure_row(client, row, forwards[row.model], plan, seed))
                    progress.advance()
    progress.close()
    result = {
        "preset": "idle",
        "quick": quick,
        "commit": git("rev-parse", "HEAD"),
        "describe": git("describe", "--always", "--dirty"),
        "machine": machine(),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "plan": {"requests": plan.requests, "warmup": plan.warmup},
        "running_batch": running_batch,
        "goal": f"served p50 <= {GOAL}x in-process p50",
        "models": models_toml.strip(),
        "rows": results,
        "seconds": time.time() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "idle.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict[str, Any]) -> str:
    header = (
        f"idle at {result['describe']}: one request at a time, served and in process side by side "
        f"({result['plan']['requests']} requests a row; each step decided by the "
        f"{result.get('running_batch', 'manager')}; load average {result['load_average']['before'][0]:.1f}); "
        f"goal: served p50 <= {GOAL}x in process"
    )
    lines = [
        header,
        (
            f"| workload | served p50 / p99, ms | in process p50 / p99, ms | served / in process p50 | p99 "
            f"| goal {GOAL}x | answers |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        served, local, ratio, check = row["served_ms"], row["in_process_ms"], row["ratio"], row["verify"]
        ok = (
            f"{check['checked']} ok"
            if check["ok"]
            else f"WRONG: max abs error {check['max_abs_error']:.1e} {'; '.join(check['wrong'])}"
        )
        lines.append(
            f"| {row['row']} | {served['p50']:.2f} / {served['p99']:.2f} | {local['p50']:.2f} / {local['p99']:.2f} | "
            f"{ratio['p50']:.1f}x | {ratio['p99']:.1f}x | {'met' if row['goal_met'] else 'missed'} | {ok} |"
        )
    return "\n".join(lines)


def main(quick: bool, out: Path, running_batch: str | None = None) -> bool:
    """Run, print the table; False if any served answer differs from the reference."""
    result = run(quick, out, running_batch=running_batch)
    print(table(result))
    return all(row["verify"]["ok"] for row in result["rows"])
