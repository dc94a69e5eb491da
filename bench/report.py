"""The summary of a preset's run, its targets, and the table `./scripts/bench` prints."""

from __future__ import annotations

import math
from typing import Any

CHAIN_PRESETS = ("lstm", "fixed", "longtail")  # one cell per step, so a request's steps are its cells
SUSTAINED_P90_MS = 100.0  # "sustained" throughput: the highest achieved with p90 latency within this
# presets judged by p90 and peak against padding: the peak goal
PEAK_OVER_PADDED = {"lstm": 1.25, "tagger": 1.3, "attention": 1.3}


def sustained(points: list[dict[str, Any]]) -> float:
    """The highest throughput achieved with p90 latency within SUSTAINED_P90_MS (0 if none was)."""
    return max((p["achieved_rps"] for p in points if p["latency_ms"]["p90"] <= SUSTAINED_P90_MS), default=0.0)


def summarize(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per policy: peak throughput, sustained throughput, p90 at 25% / 50% of the reference
    policy's peak, batch sizes, queueing p99 at 50%, and the fractions of the raw kernels'
    throughput (served cells, plain torch.nn cells) reached at the peak."""
    ideal = result["kernel"]["ideal"]["requests_per_s"]
    torch_nn = result["torch_nn_kernel"]["ideal"]["requests_per_s"]
    summary = {}
    for policy, runs in result["policies"].items():
        everything = runs["points"] + list(runs["moderate"].values())
        peak = max(everything, key=lambda p: p["achieved_rps"])
        moderate = runs["moderate"]
        half = moderate.get("0.5")
        summary[policy] = {
            "peak_throughput": peak["achieved_rps"],
            "sustained_throughput": sustained(everything),
            "p90_ms_at_25pct_padded_peak": moderate["0.25"]["latency_ms"]["p90"] if "0.25" in moderate else math.nan,
            "p90_ms_at_50pct_padded_peak": half["latency_ms"]["p90"] if half else math.nan,
            "queue_p99_ms_at_50pct_padded_peak": half["queue_ms"]["p99"] if half else math.nan,
            "mean_batch_size": peak["mean_batch_size"],
            "mean_batch_size_at_50pct_padded_peak": half["mean_batch_size"] if half else math.nan,
            "kernel_fraction": peak["achieved_rps"] / ideal,
            "torch_nn_kernel_fraction": peak["achieved_rps"] / torch_nn,
        }
    return summary


def fraction(value: float | None) -> str:
    """A table cell for a share such as the kernels' busy time: n/a where it was not measured."""
    return "n/a" if value is None else f"{value:.2f}"


def finite(value: Any) -> Any:
    """JSON has no NaN: missing measurements are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def target(what: str, measured: float, goal: float, at_most: bool = False) -> dict[str, Any]:
    met = measured <= goal if at_most else measured >= goal
    return {"what": what, "measured": measured, "target": goal, "at_most": at_most, "met": bool(met)}


def against_padded(cellular: dict[str, float], padded: dict[str, float], peak_goal: float) -> list[dict[str, Any]]:
    """Cellular beside padded on the same chains: p90 at half of padded's peak at most half of padded's,
    and a higher peak."""
    return [
        target("cellular p90 / padded p90 at 50% of padded peak",
               cellular["p90_ms_at_50pct_padded_peak"] / padded["p90_ms_at_50pct_padded_peak"], 0.5, at_most=True),
        target("cellular peak / padded peak", cellular["peak_throughput"] / padded["peak_throughput"], peak_goal),
    ]


def targets(result: dict[str, Any], summary: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """The goals this preset is measured against (ratios of policies measured side by side)."""
    name = result["preset"]
    cellular = summary.get("cellular")
    if cellular is None:
        return []
    found = []
    padded, graph = summary.get("padded"), summary.get("graph")
    if name == "fixed":
        found.append(target("cellular peak / raw kernel", cellular["kernel_fraction"], 0.9))
    if name in PEAK_OVER_PADDED and padded:
        found += against_padded(cellular, padded, PEAK_OVER_PADDED[name])
    if name == "lstm":
        torch_nn = result["torch_nn_kernel"]["ideal"]["requests_per_s"]
        found.append(target(f"cellular sustained (p90 <= {SUSTAINED_P90_MS:.0f} ms) / torch.nn kernel",
                             cellular["sustained_throughput"] / torch_nn, 1.6))
    if name == "seq2seq" and padded:
        found.append(target("cellular peak / padded peak",
                            cellular["peak_throughput"] / padded["peak_throughput"], 1.8))
    if name == "treelstm":
        found.append(target(f"cellular sustained trees/s (p90 <= {SUSTAINED_P90_MS:.0f} ms)",
                             cellular["sustained_throughput"], 1700))
    if name == "treelstm" and graph:
        found.append(target("cellular peak / graph peak", cellular["peak_throughput"] / graph["peak_throughput"], 1.8))
        found.append(target("cellular p90 / graph p90 at 50% of graph peak",
                             cellular["p90_ms_at_50pct_padded_peak"] / graph["p90_ms_at_50pct_padded_peak"], 0.75,
                             at_most=True))
    if name in CHAIN_PRESETS:
        half = result["policies"]["cellular"]["moderate"].get("0.5")
        if half:
            # A step is one task of the raw kernel at the largest batch size: what a request that arrives
            # must wait for at most, per task issued ahead of it.
            step_ms = max(cell["seconds_per_call"] for cell in result["kernel"]["cells"].values()) * 1e3
            tasks = result["max_tasks_to_submit"]
            bound = tasks * step_ms * 1.5
            found.append(target(f"cellular queueing p99 at 50% load, ms (bound: {tasks} x {step_ms:.3f} ms step x 1.5)",
                                 half["queue_ms"]["p99"], bound, at_most=True))
    return found


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per policy."""
    reference = result["reference_policy"]
    lines = [
        (
            f"| policy | peak req/s | p90 ms at 25% of {reference} peak | p90 ms at 50% | queueing p99 ms at 50% "
            f"| mean batch at peak | of raw kernel | of torch.nn kernel |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, s in result["summary"].items():
        lines.append(
            f"| {policy} | {s['peak_throughput']:.0f} | {s['p90_ms_at_25pct_padded_peak']:.1f} "
            f"| {s['p90_ms_at_50pct_padded_peak']:.1f} | {s['queue_p99_ms_at_50pct_padded_peak']:.1f} "
            f"| {s['mean_batch_size']:.1f} | {s['kernel_fraction']:.2f} | {s['torch_nn_kernel_fraction']:.2f} |"
        )
    batch = max(cell["batch"] for cell in result["kernel"]["cells"].values())
    for label, key in (("raw kernel (served cells)", "kernel"), ("raw kernel (torch.nn cells)", "torch_nn_kernel")):
        rate = result[key]["ideal"]["requests_per_s"]
        of_served = rate / result["kernel"]["ideal"]["requests_per_s"]
        of_torch_nn = rate / result["torch_nn_kernel"]["ideal"]["requests_per_s"]
        lines.append(f"| {label} | {rate:.0f} | | | | {batch} | {of_served:.2f} | {of_torch_nn:.2f} |")
    return "\n".join(lines)


def target_lines(result: dict[str, Any]) -> list[str]:
    return [
        f"{'met   ' if t['met'] else 'MISSED'} {t['what']}: {t['measured']:.3g} "
        f"({'<=' if t['at_most'] else '>='} {t['target']:.3g})"
        for t in result["targets"]
    ]
