"""The figures of a preset: latency vs throughput (paper Fig. 7, 11, 13-15) and the CDFs of
queueing and computation time at a moderate load (Fig. 9). Needs matplotlib (`pip install
-e .[bench]`); without it the JSON is still written and the plots are skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"cellular": "tab:blue", "padded": "tab:orange", "graph": "tab:green"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def latency_vs_throughput(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, runs in result["policies"].items():
        points = sorted(runs["points"] + list(runs["moderate"].values()), key=lambda p: p["offered_rps"])
        x = [p["achieved_rps"] for p in points]
        p90 = [p["latency_ms"]["p90"] for p in points]
        below = [p["latency_ms"]["p90"] - p["latency_ms"]["p50"] for p in points]
        above = [p["latency_ms"]["p99"] - p["latency_ms"]["p90"] for p in points]
        ax.errorbar(x, p90, yerr=[below, above], marker="o", markersize=3, capsize=2, label=policy,
                    color=COLORS.get(policy))
    ideal = result["kernel"]["ideal"]["requests_per_s"]
    ax.axvline(ideal, color="gray", linestyle="--", linewidth=1, label="raw kernel at b_max")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency p90 (ms), bars p50-p99")
    ax.set_title(result["description"], fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def queueing_and_compute_cdf(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.6), sharey=True)
    for ax, field, title in zip(axes, ("queue_ms", "compute_ms"), ("queueing time", "computation time")):
        for policy, runs in result["policies"].items():
            moderate = runs["moderate"].get("0.5")
            if moderate is None or not moderate["cdf"][field]:
                continue
            values = moderate["cdf"][field]
            levels = [i / (len(values) - 1) for i in range(len(values))]
            ax.plot([max(v, 1e-3) for v in values], levels, label=policy, color=COLORS.get(policy))
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("CDF")
    axes[0].legend(fontsize=8)
    reference = result["reference_policy"]
    fig.suptitle(f"{result['preset']}: at 50% of the {reference} policy's peak throughput", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(result: dict[str, Any], directory: Path) -> list[Path]:
    """Both figures as PNG files beside the JSON; returns their paths (none without matplotlib)."""
    try:
        _pyplot()
    except ImportError:
        return []
    paths = [directory / f"{result['preset']}-latency.png", directory / f"{result['preset']}-cdf.png"]
    latency_vs_throughput(result, paths[0])
    queueing_and_compute_cdf(result, paths[1])
    return paths
