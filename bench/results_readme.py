"""The README's results block: four to six headline numbers from the same JSON as the results page, rewritten
between two marker lines by `./scripts/bench results --readme README.md` so that it keeps in step with the page."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from batchmaker.bench.results import Comparison, comparisons, fault_rows, idle_rows, peers, strongest, workloads

BEGIN = "<!-- begin results: ./scripts/bench results --readme README.md writes this block -->"
END = "<!-- end results -->"


class NoReadmeBlock(Exception):
    """The README has no results block to rewrite."""


def _headline(c: Comparison, descriptions: dict[str, str], what: str) -> str:
    unit = "ms" if c.lower_wins else "req/s"
    return (
        f"{descriptions[c.preset]}: cellular batching's {what} is {c.ratio:.2f}x {c.against}'s "
        f"({c.ours:,.0f} against {c.theirs:,.0f} {unit})."
    )


def headlines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The largest throughput win, the largest latency win, the largest loss, the other systems (each in its
    strongest setup), a lone request on an idle server, and overload and faults: whichever of these the JSON has."""
    found = workloads(results)
    descriptions = {w.preset: w.description.split(" (")[0] for w in found}
    own = [c for c in comparisons(found) if not c.peer]
    lines = []
    peak = [c for c in own if c.metric == "peak" and c.verdict == "wins"]
    if peak:
        lines.append(_headline(max(peak, key=lambda c: c.ratio), descriptions, "peak throughput"))
    p90 = [c for c in own if c.metric == "p90" and c.verdict == "wins"]
    if p90:
        lines.append(_headline(min(p90, key=lambda c: c.ratio), descriptions, "p90 latency at 50% load"))
    losses = [c for c in own if c.verdict == "loses"]
    if losses:
        worst = max(losses, key=lambda c: abs(math.log(c.ratio)))
        what = "p90 latency at 50% load" if worst.lower_wins else "peak throughput"
        lines.append("Where it loses: " + _headline(worst, descriptions, what))
    others = [
        f"{row.cellular_throughput / row.throughput:.2f}x {row.described} on {name} "
        f"({row.cellular_throughput:,.0f} against {row.throughput:,.0f} req/s)"
        for name, result in results.items()
        for row in strongest(peers(result))
    ]
    if others:
        lines.append(
            "Against other systems, each in its strongest setup measured, throughput measured the same way: "
            + "; ".join(others)
            + "."
        )
    idle = idle_rows(results)
    if idle:
        ratios = [r["ratio"]["p50"] for r in idle]
        lines.append(
            f"A lone request on an idle server: served p50 {min(ratios):.1f}x-{max(ratios):.1f}x "
            "the same model run in process."
        )
    faults = fault_rows(results)
    if faults:
        factors = [m["factor"] for m in results.get("overload", {}).get("factors", [])]
        windows = len(results.get("chaos", {}).get("faults", []))
        trials = ([f"offered up to {max(factors):g}x its capacity"] if factors else []) + (
            [f"put through the chaos preset's {windows} fault windows"] if windows else []
        )
        lines.append(
            f"{' and '.join(trials).capitalize()}: {sum(r['requests'] for r in faults):,} requests, "
            f"{sum(r['lost'] for r in faults)} lost, {sum(r['wrong'] for r in faults)} wrong or answered twice."
        )
    return lines


def block(results: dict[str, dict[str, Any]], page_link: str, machine: str, commit: str) -> str:
    """The marked block, markers included."""
    lines = [
        BEGIN,
        (
            f"Measured on {machine} at commit {commit}; every table and plot, and how to reproduce them: "
            f"[{page_link}]({page_link})."
        ),
        "",
    ]
    lines += [f"- {line}" for line in headlines(results)]
    return "\n".join([*lines, END])


def rewrite(readme: Path, new_block: str) -> None:
    """Replace the README's block between BEGIN and END with `new_block`."""
    text = readme.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise NoReadmeBlock(f"{readme} has no results block: put the lines {BEGIN!r} and {END!r} where it goes")
    readme.write_text(text[:start] + new_block + text[end + len(END) :])
