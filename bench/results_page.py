"""The results page (docs/results.md) and the README's results block, written from a directory of bench JSON so
that neither is ever edited by hand nor goes stale: `./scripts/bench all` writes DIR/results.md after its run,
`./scripts/bench results --from DIR [--page PAGE] [--readme README]` writes them from JSON already there."""

from __future__ import annotations

import collections
import math
import os
from pathlib import Path
from typing import Any

from batchmaker.bench import results_readme
from batchmaker.bench.presets import PRESETS
from batchmaker.bench.results import (
    TIE,
    ResultsError,
    Workload,
    commit_of,
    fault_rows,
    idle_rows,
    load,
    peers,
    strongest,
    verdict,
    workloads,
)
from batchmaker.bench.run import ROOT

ALSO_SHOWN = ("idle", "overload", "chaos")  # the presets besides the workloads whose JSON the page shows
WRITTEN_BY_ALL = {name for name, preset in PRESETS.items() if preset.in_all} | set(ALSO_SHOWN)


def shown(path: Path) -> str:
    """A path as a command names it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def link(target: Path, page: Path) -> str:
    """A markdown link's target as seen from the page, so that the page can live anywhere."""
    return Path(os.path.relpath(target.resolve(), page.resolve().parent)).as_posix()


def machine_text(machine: dict[str, Any]) -> str:
    known = ("cpu", "cores", "memory_gib", "platform", "python", "torch")
    extra = "".join(f", {key} {value}" for key, value in machine.items() if key not in known)
    return (
        f"{machine.get('cores', '?')} {machine.get('cpu', '?')} cores, {machine.get('memory_gib', '?')} GiB, "
        f"{machine.get('platform', '?')}; Python {machine.get('python', '?')}, torch {machine.get('torch', '?')}{extra}"
    )


def shown_results(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    names = [w.preset for w in workloads(results)] + [name for name in ALSO_SHOWN if name in results]
    return {name: results[name] for name in names}


def commits(results: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The presets the page shows, by the commit each was measured at, the most common commit first."""
    by_commit: dict[str, list[str]] = collections.defaultdict(list)
    for name, result in shown_results(results).items():
        by_commit[commit_of(result)].append(name)
    return dict(sorted(by_commit.items(), key=lambda item: -len(item[1])))


def machines(results: dict[str, dict[str, Any]]) -> str:
    """The machines the page's presets ran on (one, when they come from one run)."""
    return "; ".join(sorted({machine_text(r["machine"]) for r in shown_results(results).values() if "machine" in r}))


def commit_text(results: dict[str, dict[str, Any]]) -> str:
    """The most common commit, and any other with the presets measured at it."""
    (first, _), *others = commits(results).items()
    return f"`{first}`" + "".join(f" ({', '.join(names)}: `{commit}`)" for commit, names in others)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1f}"


def table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> list[str]:
    """A markdown table, its first `text_columns` left-aligned and the numbers after them right-aligned."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * text_columns + "---:|" * (len(header) - text_columns),
        *("| " + " | ".join(cells) + " |" for cells in rows),
        "",
    ]


def workload_section(workload: Workload, directory: Path, page: Path) -> list[str]:
    header = ["system", "peak req/s", "p90 ms at 50% load", "cellular peak ÷ this", "cellular p90 ÷ this"]
    rows = [["**cellular**", f"{workload.peak:,.0f}", _ms(workload.p90_ms), "", ""]]
    rows += [
        [row.system, f"{row.throughput:,.0f}", _ms(row.p90_ms), _ratio(row.throughput_ratio), _ratio(row.p90_ratio)]
        for row in workload.rows
    ]
    notes = [
        f"- {row.described}: {row.setting}: {row.throughput:,.0f} against cellular batching's "
        f"{row.cellular_throughput:,.0f} req/s."
        for row in workload.rows
        if row.setting
    ]
    plots = [directory / f"{workload.preset}-{kind}.png" for kind in ("latency", "cdf")]
    figures = [f"![{path.stem}]({link(path, page)})" for path in plots if path.exists()]
    json_link = f"[{workload.preset}.json]({link(directory / f'{workload.preset}.json', page)})"
    return [
        f"### {workload.preset}: {workload.description}",
        "",
        f"Commit `{workload.commit}`, {json_link}.",
        "",
        *table(header, rows),
        *([*notes, ""] if notes else []),
        *([" ".join(figures), ""] if figures else []),
    ]


def peers_section(results: dict[str, dict[str, Any]], directory: Path, page: Path) -> list[str]:
    """Every other system in every setup measured, each JSON's strongest setup of a system in bold."""
    found = [(name, row) for name, result in results.items() for row in peers(result)]
    if not found:
        return ["No JSON here reports another system measured beside cellular batching.", ""]
    quoted = {(name, row) for name, result in results.items() for row in strongest(peers(result))}
    setups = collections.Counter((name, row.system) for name, row in found)
    several = {(name, row) for name, row in quoted if setups[name, row.system] > 1}  # the strongest of several
    header = ["JSON", "system", "setup", "how", "its req/s", "cellular req/s", "cellular ÷ it"]
    header.append("p90 ms, it / cellular")
    rows = [
        [
            f"[{name}.json]({link(directory / f'{name}.json', page)})",
            f"**{row.system}**" if (name, row) in several else row.system,
            row.setup or "not recorded",
            row.setting,
            f"{row.throughput:,.0f}",
            f"{row.cellular_throughput:,.0f}",
            _ratio(row.throughput_ratio),
            f"{_ms(row.p90_ms)} / {_ms(row.cellular_p90_ms)}" if row.p90_ms is not None else "-",
        ]
        for name, row in found
    ]
    lines = table(header, rows, text_columns=4)
    if several:
        note = (
            "Where a JSON measured a system in several setups, its strongest (in bold: the highest req/s) is the one "
            "the verdict and the README quote."
        )
        lines += [note, ""]
    return lines


def idle_section(results: dict[str, dict[str, Any]]) -> list[str]:
    found = idle_rows(results)
    if not found:
        return ["Not measured here: `./scripts/bench idle` writes idle.json.", ""]
    header = ["workload", "served p50 / p99 ms", "in process p50 / p99 ms", "served ÷ in process, p50", "p99"]
    rows = [
        [
            r["row"],
            f"{r['served_ms']['p50']:.2f} / {r['served_ms']['p99']:.2f}",
            f"{r['in_process_ms']['p50']:.2f} / {r['in_process_ms']['p99']:.2f}",
            f"{r['ratio']['p50']:.1f}x",
            f"{r['ratio']['p99']:.1f}x",
        ]
        for r in found
    ]
    return table(header, rows)


def faults_section(results: dict[str, dict[str, Any]]) -> list[str]:
    found = fault_rows(results)
    if not found:
        return ["Not measured here: `./scripts/bench overload` and `./scripts/bench chaos` write them.", ""]
    header = ["condition", "requests", "answered", "refused or failed", "lost", "wrong or answered twice",
              "accepted p99 ms"]  # fmt: skip
    rows = [
        [r["condition"], f"{r['requests']:,}", f"{r['answered']:,}", f"{r['refused']:,}", str(r["lost"]),
         str(r["wrong"]), _ms(r["p99_ms"])]
        for r in found
    ]  # fmt: skip
    lines = table(header, rows)
    overload = results.get("overload")
    if overload:
        before, after = overload["capacity"]["requests_per_s"], overload["capacity_after"]["requests_per_s"]
        lines += [
            (
                f"Overload serves {overload['config']} as it is, its capacity measured at {before:,.0f} req/s "
                f"before the loads and {after:,.0f} after."
            ),
            "",
        ]
    chaos = results.get("chaos")
    if chaos:
        lines += [
            (
                f"Chaos sends {chaos['rate_rps']:g} requests/s for {chaos['seconds_of_load']:g} s to several "
                f"servers behind one client, one fault every {chaos['window_s']:g} s."
            ),
            "",
        ]
    return lines


def reproduce_section(
    results: dict[str, dict[str, Any]], directory: Path, page: Path, readme: Path | None
) -> list[str]:
    out = shown(directory)
    lines = ["Each preset at the commit it was measured at (`all` runs every preset it names in one go):", "", "```"]
    for commit, names in commits(results).items():
        runs = [f"./scripts/bench {name} --out {out}" for name in names if name not in WRITTEN_BY_ALL]
        if WRITTEN_BY_ALL <= set(names):
            runs.insert(0, f"./scripts/bench all --out {out}")
        else:
            runs += [f"./scripts/bench {name} --out {out}" for name in names if name in WRITTEN_BY_ALL]
        lines.append(" && ".join([f"git checkout {commit}", *runs]))
    shown_names = shown_results(results)
    for name, result in results.items():  # presets that only measure other systems (`http`)
        if name not in shown_names and peers(result):
            lines.append(f"git checkout {commit_of(result)} && ./scripts/bench {name} --out {out}")
    lines += [
        "```",
        "",
        "then this page, from a checkout that has `./scripts/bench results`:",
        "",
        "```",
        command(directory, page, readme),
        "```",
        "",
    ]
    measuring = [
        f"`{name}` ({', '.join(row.system for row in strongest(peers(result)))})"
        for name, result in results.items()
        if peers(result)
    ]
    if measuring:
        note = (
            "Other systems are measured only where they are installed, each in an environment of its own "
            f"(BENCHMARKS.md says how), and a run without one records it as skipped: {'; '.join(measuring)}."
        )
        lines += [note, ""]
    return lines


def command(directory: Path, page: Path, readme: Path | None) -> str:
    return f"./scripts/bench results --from {shown(directory)} --page {shown(page)}" + (
        f" --readme {shown(readme)}" if readme else ""
    )


def render(results: dict[str, dict[str, Any]], directory: Path, page: Path, readme: Path | None = None) -> str:
    """The whole page; `page` is where it will be written (its links are relative to it)."""
    lines = [
        "# Results",
        "",
        f"<!-- Written by `{command(directory, page, readme)}`; edit bench/results_page.py, not this page. -->",
        "",
        (
            "Cellular batching against the server's other batching policies (`padded` for sequences, `graph` for "
            "trees: the baselines of the paper) on the same workers and cells, and against other systems measured in "
            f"the same run, from the JSON of `./scripts/bench` in [{shown(directory)}]({link(directory, page)}/). "
            "Every ratio is between systems measured in one run. Load is 50% of the baseline policy's peak."
        ),
        "",
        f"**Machine:** {machines(results)}.",
        "",
        f"**Commit:** {commit_text(results)}.",
        "",
    ]
    quick = [name for name, result in shown_results(results).items() if result.get("quick")]
    if quick:
        lines += [
            (
                f"**Smoke run:** {', '.join(quick)} ran with `--quick`, seconds a load: their numbers show the "
                "server works, not how fast it is."
            ),
            "",
        ]
    lines += ["## Where cellular batching wins, loses and does not matter", ""]
    lines += [f"- {line}" for line in verdict(results)]
    lines += [
        "",
        (
            f"Ratios are cellular batching's over the other system's: a peak ratio of {TIE:g} or more and a p90 "
            f"ratio of {1 / TIE:.2f} or less count as wins."
        ),
        "",
        "## Workloads",
        "",
    ]
    for workload in workloads(results):
        lines += workload_section(workload, directory, page)
    lines += ["## Other systems", ""] + peers_section(results, directory, page)
    lines += ["## A lone request on an idle server", ""] + idle_section(results)
    lines += ["## Overload and faults", ""] + faults_section(results)
    lines += ["## Reproduce", ""] + reproduce_section(results, directory, page, readme)
    return "\n".join(lines).rstrip() + "\n"


def readme_block(results: dict[str, dict[str, Any]], page: Path, readme: Path) -> str:
    return results_readme.block(results, link(page, readme), machines(results), commit_text(results))


def write(directory: Path, page: Path, readme: Path | None = None) -> None:
    """The page from the JSON in `directory`, and the README's block when a README is named."""
    results = load(directory)
    if not shown_results(results):
        raise ResultsError(
            f"{directory} holds no JSON of the presets the page shows ({', '.join([*PRESETS, *ALSO_SHOWN])})"
        )
    if readme is not None:  # checked before the page is written, so a README without a block changes nothing
        results_readme.rewrite(readme, readme_block(results, page, readme))
    page.write_text(render(results, directory, page, readme))
