"""The demo's yardstick: what the results page's JSON measured for the model the demo serves, where and whether
on this machine, so that a user can tell a normal run of ./scripts/demo from a slow one."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from batchmaker.bench.results import commit_of
from batchmaker.bench.results_page import machine_text, shown
from batchmaker.bench.run import machine

PRESET = "lstm"  # the benchmark preset of the demo's model: the same LSTM on the same sentences
IDLE_ROW = "LSTM, WMT sentences"  # its row in the idle preset
SAME_MACHINE = ("cpu", "cores", "memory_gib", "platform")
INDENT = " " * 16


def model_differences(result: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """The settings the demo's model and the measured one both name and set differently."""
    (measured,) = tomllib.loads(result["model"]["toml"])["models"].values()
    return [
        f"{key} {params[key]} here, {measured[key]} there"
        for key in sorted(params.keys() & measured.keys())
        if params[key] != measured[key]
    ]


def machine_line(there: dict[str, Any]) -> str:
    here = machine()
    differ = [
        f"{key} {here.get(key)} here, {there.get(key)} there" for key in SAME_MACHINE if here.get(key) != there.get(key)
    ]
    verdict = (
        f"same machine: yes ({', '.join(SAME_MACHINE)} match)"
        if not differ
        else f"same machine: NO ({'; '.join(differ)}), compare with care"
    )
    return f"{INDENT}measured on {machine_text(there)}; {verdict}"


def lines(directory: Path, rate: float, params: dict[str, Any]) -> list[str]:
    """The lines the demo prints beside its own numbers (one saying why when there is no reference to print)."""
    path = directory / f"{PRESET}.json"
    if not path.exists():
        return [
            (
                f"reference       none: {shown(path)} is missing (./scripts/bench {PRESET} --out {shown(directory)} "
                "measures it on this machine)"
            )
        ]
    try:
        return measured(directory, json.loads(path.read_text()), rate, params)
    except (json.JSONDecodeError, KeyError, ValueError) as exc:
        return [f"reference       none: {shown(path)} is not a {PRESET} preset's JSON ({type(exc).__name__}: {exc})"]


def measured(directory: Path, result: dict[str, Any], rate: float, params: dict[str, Any]) -> list[str]:
    """The cellular policy's latency at the load nearest the demo's, its peak, a lone request, and the machine."""
    cellular = result["policies"]["cellular"]
    near = min(cellular["points"] + list(cellular["moderate"].values()), key=lambda p: abs(p["offered_rps"] - rate))
    latency = near["latency_ms"]
    differ = model_differences(result, params)
    found = [
        f"reference       {shown(directory / f'{PRESET}.json')} (commit {commit_of(result)}): the cellular policy, "
        + ("the same model on the same sentences" if not differ else f"ANOTHER model ({'; '.join(differ)})"),
        (
            f"{INDENT}at {near['offered_rps']:.0f} requests/s offered: latency p50 {latency['p50']:.2f}  "
            f"p90 {latency['p90']:.2f}  p99 {latency['p99']:.2f} ms; "
            f"peak {result['summary']['cellular']['peak_throughput']:.0f} requests/s"
        ),
    ]
    idle_path = directory / "idle.json"
    idle = json.loads(idle_path.read_text()) if idle_path.exists() else {}
    row = next((r for r in idle.get("rows", []) if r["row"] == IDLE_ROW), None)
    if row:
        found.append(
            f"{INDENT}a lone request on an idle server: p50 {row['served_ms']['p50']:.2f}  "
            f"p99 {row['served_ms']['p99']:.2f} ms ({shown(idle_path)})"
        )
    return found + [machine_line(result["machine"])]
