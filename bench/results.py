"""What a directory of `./scripts/bench` JSON says, in the shape docs/results.md shows it: per workload, cellular
batching against the baseline policies and the peers measured in the same run, the verdict derived from those
ratios, and the rows of the idle, overload and chaos presets.

Any preset's JSON may report other systems measured beside cellular batching as a list `peers`; each entry:

    name                     the system and its version, e.g. "Triton 2.50"
    setting                  how both were driven, e.g. "HTTP, 64 requests outstanding"
    requests_per_s           its throughput
    cellular_requests_per_s  cellular batching's throughput, measured the same way in the same run
    setup                    (optional) how the system was set up, e.g. "dynamic batcher, 2 model instances"
    p90_ms, cellular_p90_ms  (optional) p90 latency of each at the same offered load

A JSON may list one system in several setups; the verdict and the README quote each system's strongest (the
highest throughput), and the page's table of other systems lists them all. The treelstm preset's `dynet`
section is read as one such entry.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchmaker.bench.presets import PRESETS

PEER_KEYS = ("name", "setting", "requests_per_s", "cellular_requests_per_s")  # what every `peers` entry holds
TIE = 1.1  # a ratio within 1/TIE..TIE either way is a tie: the run-to-run spread of one policy is about this


@dataclass(frozen=True)
class Row:
    """One system beside cellular batching in a workload's table, and cellular's numbers measured the same way."""

    system: str
    throughput: float
    p90_ms: float | None
    cellular_throughput: float
    cellular_p90_ms: float | None
    setting: str = ""  # how a peer was driven; empty for the server's own policies
    setup: str = ""  # how a peer was set up, where its JSON says

    @property
    def described(self) -> str:
        """A peer with its setup, or saying that its JSON recorded none (a run from before setups were); a policy
        by its name."""
        if not self.setting:
            return self.system
        return f"{self.system} ({self.setup or 'setup not recorded'})"

    @property
    def throughput_ratio(self) -> float:
        return self.cellular_throughput / self.throughput

    @property
    def p90_ratio(self) -> float | None:
        if self.p90_ms is None or self.cellular_p90_ms is None:
            return None
        return self.cellular_p90_ms / self.p90_ms


@dataclass(frozen=True)
class Workload:
    """One sequence or tree preset: cellular batching's peak and p90 at 50% load, and the rows it is compared with."""

    preset: str
    description: str
    commit: str
    peak: float
    p90_ms: float | None
    rows: list[Row]


@dataclass(frozen=True)
class Comparison:
    """One ratio of cellular batching over another system on a workload; `lower_wins` for latency."""

    preset: str
    against: str
    metric: str
    ratio: float
    ours: float
    theirs: float
    lower_wins: bool
    peer: bool  # another system, not one of the server's own policies

    @property
    def verdict(self) -> str:
        better = self.ratio <= 1 / TIE if self.lower_wins else self.ratio >= TIE
        worse = self.ratio >= TIE if self.lower_wins else self.ratio <= 1 / TIE
        return "wins" if better else "loses" if worse else "tie"

    def text(self) -> str:
        unit = "ms" if self.lower_wins else "req/s"
        return f"{self.preset} {self.ratio:.2f}x {self.against} ({self.ours:,.0f} against {self.theirs:,.0f} {unit})"


class ResultsError(Exception):
    """The directory's JSON cannot make a results page: there is none, a file is not JSON, or an entry lacks a field."""


def load(directory: Path) -> dict[str, dict[str, Any]]:
    """Every JSON file of the directory by its name (a preset's, e.g. `lstm`)."""
    found = {}
    for path in sorted(directory.glob("*.json")):
        try:
            found[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{path} is not JSON: {exc}") from exc
    if not found:
        raise ResultsError(f"{directory} holds no benchmark JSON (./scripts/bench all --out {directory} writes it)")
    return found


def commit_of(result: dict[str, Any]) -> str:
    return result.get("describe") or result.get("commit") or "unknown"


def threads(processes: int) -> str:
    """How DyNet ran: one thread, or processes of one thread sharing the trees."""
    return "one thread" if processes == 1 else f"{processes} processes of one thread, each on a share of the trees"


def peers(result: dict[str, Any]) -> list[Row]:
    """The other systems a preset's JSON reports: its `peers` entries, and the treelstm preset's DyNet section."""
    entries = list(result.get("peers", []))
    dynet = result.get("dynet", {})
    if "dynet" in dynet:
        offline, closed = dynet["dynet"], dynet["closed_loop"]
        entries.append(
            {
                "name": f"DyNet {offline['dynet']}",
                "setup": (f"{offline['gates']} gates, " if "gates" in offline else "")
                + f"{offline['batch']} trees a graph",
                "setting": f"offline, agenda autobatching, {threads(offline.get('processes', 1))}; "
                f"cellular batching served closed loop, {closed['window']} trees outstanding"
                + (f", {result['cpu_workers']} workers" if result.get("cpu_workers", 1) > 1 else ""),
                "requests_per_s": offline["trees_per_s"],
                "cellular_requests_per_s": closed["trees_per_s"],
            }
        )
    for entry in entries:
        missing = [key for key in PEER_KEYS if key not in entry]
        if missing:
            raise ResultsError(f"{result.get('preset')}: a peers entry lacks {', '.join(missing)}: {entry}")
    return [
        Row(
            entry["name"],
            entry["requests_per_s"],
            entry.get("p90_ms"),
            entry["cellular_requests_per_s"],
            entry.get("cellular_p90_ms"),
            entry["setting"],
            entry.get("setup", ""),
        )
        for entry in entries
    ]


def strongest(rows: list[Row]) -> list[Row]:
    """Each system's row with the highest throughput, in the order the systems first appear: the setup quoted."""
    best: dict[str, Row] = {}
    for row in rows:
        if row.system not in best or row.throughput > best[row.system].throughput:
            best[row.system] = row
    return list(best.values())


def workloads(results: dict[str, dict[str, Any]]) -> list[Workload]:
    """The sequence and tree presets present, in the order of bench/presets.py, each with cellular batching run."""
    found = []
    for name in PRESETS:
        result = results.get(name)
        if result is None or "cellular" not in result.get("summary", {}):
            continue
        summary = result["summary"]
        ours = summary["cellular"]
        rows = [
            Row(
                policy,
                s["peak_throughput"],
                s["p90_ms_at_50pct_padded_peak"],
                ours["peak_throughput"],
                ours["p90_ms_at_50pct_padded_peak"],
            )
            for policy, s in summary.items()
            if policy != "cellular"
        ]
        found.append(
            Workload(
                name,
                result["description"],
                commit_of(result),
                ours["peak_throughput"],
                ours["p90_ms_at_50pct_padded_peak"],
                rows + strongest(peers(result)),
            )
        )
    return found


def peer_runs(results: dict[str, dict[str, Any]]) -> list[Workload]:
    """The runs that measure only other systems beside cellular batching (`http`), each with its peers' strongest
    setups, so that the verdict counts their throughput as it counts the workloads' peers (not their p90s, taken
    at each way's own peak rather than at one load)."""
    found = []
    for name, result in results.items():
        rows = [dataclasses.replace(row, p90_ms=None) for row in strongest(peers(result))]
        if rows and "cellular" not in result.get("summary", {}):
            first = rows[0]
            description = result.get("description", name)
            found.append(
                Workload(name, description, commit_of(result), first.cellular_throughput, first.cellular_p90_ms, rows)
            )
    return found


def comparisons(found: list[Workload]) -> list[Comparison]:
    """Every peak and p90 ratio of cellular batching over another system measured in the same run."""
    out = []
    for workload in found:
        for row in workload.rows:
            measured = [("peak", row.throughput_ratio, row.cellular_throughput, row.throughput, False)]
            if row.p90_ratio is not None:
                measured.append(("p90", row.p90_ratio, row.cellular_p90_ms, row.p90_ms, True))
            out += [
                Comparison(workload.preset, row.system, metric, ratio, ours, theirs, lower_wins, peer=bool(row.setting))
                for metric, ratio, ours, theirs, lower_wins in measured
            ]
    return out


def _listed(items: list[Comparison]) -> str:
    return "; ".join(c.text() for c in items) if items else "none in this run"


def idle_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return results.get("idle", {}).get("rows", [])


def _path_cost(low: float, high: float) -> str:
    """The milliseconds the served path adds over the run in process, from `low` to `high`: negative where
    serving beat it (a decoder whose steps the server batches with nothing yet runs its own kernels)."""
    if low >= 0:
        return f"the server's own path adding {low:.1f}-{high:.1f} ms"
    if high < 0:
        return f"the server's own path taking {-high:.1f}-{-low:.1f} ms off"
    return f"the server's own path from taking {-low:.1f} ms off to adding {high:.1f} ms"


def idle_line(rows: list[dict[str, Any]]) -> str:
    """A lone request on an idle server, served against the same model run in process, from the idle preset."""
    if not rows:
        return "**Idle:** not measured here (`./scripts/bench idle` measures a lone request on an idle server)."
    ordered = sorted(rows, key=lambda r: r["ratio"]["p50"])
    extra = [r["served_ms"]["p50"] - r["in_process_ms"]["p50"] for r in rows]
    best, worst = ordered[0], ordered[-1]
    return (
        f"**Idle:** with no other request to batch with, batching cannot help: a lone request's served p50 is "
        f"{best['ratio']['p50']:.1f}x-{worst['ratio']['p50']:.1f}x the same model run in process "
        f"({best['row']}: {best['served_ms']['p50']:.1f} against {best['in_process_ms']['p50']:.1f} ms; "
        f"{worst['row']}: {worst['served_ms']['p50']:.1f} against {worst['in_process_ms']['p50']:.1f} ms), "
        f"{_path_cost(min(extra), max(extra))}."
    )


def verdict(results: dict[str, dict[str, Any]]) -> list[str]:
    """Five lines: where cellular batching wins on throughput, on latency, where it loses, where it does not
    matter, and a lone request on an idle server; every claim is a ratio of the tables."""
    found = comparisons(workloads(results) + peer_runs(results))
    peak = sorted((c for c in found if c.metric == "peak"), key=lambda c: -c.ratio)
    p90 = sorted((c for c in found if c.metric == "p90"), key=lambda c: c.ratio)
    everything = peak + p90
    return [
        f"**Wins on peak throughput:** {_listed([c for c in peak if c.verdict == 'wins'])}.",
        f"**Wins on p90 latency at 50% load:** {_listed([c for c in p90 if c.verdict == 'wins'])}.",
        f"**Loses:** {_listed([c for c in everything if c.verdict == 'loses'])}.",
        (
            f"**Does not matter** (within {TIE - 1:.0%} either way): "
            f"{_listed([c for c in everything if c.verdict == 'tie'])}."
        ),
        idle_line(idle_rows(results)),
    ]


def fault_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Overload factors and chaos faults as one kind of row: requests, answered, refused or failed, lost, wrong."""
    rows = []
    for m in results.get("overload", {}).get("factors", []):
        rows.append(
            {
                "condition": f"overload {m['factor']:g}x capacity ({m['offered_rps']:,.0f} req/s, {m['seconds']:g} s)",
                "requests": m["sent"],
                "answered": m["accepted"],
                "refused": m["refused"] + sum(m["other_errors"].values()),
                "lost": m["lost"],
                "wrong": len(m["verify"]["wrong"]) + m["duplicate_replies"],
                "p99_ms": m["latency_ms"]["p99"],
            }
        )
    chaos = results.get("chaos", {})
    for fault in chaos.get("faults", []):
        rows.append(
            {
                "condition": f"chaos: {fault['fault']}" + (f" ({fault['target']})" if fault.get("target") else ""),
                "requests": fault["requests"],
                "answered": fault["ok"],
                "refused": sum(fault["errors"].values()),
                "lost": fault["lost"],
                "wrong": fault["wrong"] + fault["answered_twice"],
                "p99_ms": None,
            }
        )
    return rows
