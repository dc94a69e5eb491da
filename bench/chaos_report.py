"""What `./scripts/bench chaos` found, fault by fault: the tally of the requests due in each fault's
window, the side clients' own counts, the managers' memory, and what makes the run a failure."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from batchmaker.clients.servers import RETRYABLE_CODES

OK = "ok"
LOST = "LOST"  # never answered within the client's timeout, or failed without an answer
RSS_GROWTH_GOAL = 0.05  # a manager that lived through the run grows its resident memory by less than this


@dataclass(frozen=True)
class Request:
    """One request of the main load: the fault window it was due in, how it ended (OK, an error code or
    LOST), the replies beyond one that a server sent it, and whether an ok answer differed from the reference."""

    window: int
    outcome: str
    answered_twice: int = 0
    wrong: bool = False


def tally(faults: list[str], requests: list[Request]) -> list[dict[str, Any]]:
    """Per window (faults[0] is the quiet start): requests ok, errors by code, lost, answered twice, wrong."""
    rows = []
    for window, name in enumerate(faults):
        mine = [r for r in requests if r.window == window]
        outcomes = collections.Counter(r.outcome for r in mine)
        errors = {code: n for code, n in sorted(outcomes.items()) if code not in (OK, LOST)}
        rows.append({
            "fault": name,
            "requests": len(mine),
            "ok": outcomes[OK],
            "errors": errors,
            "non_retryable": sum(n for code, n in errors.items() if code not in RETRYABLE_CODES),
            "lost": outcomes[LOST],
            "answered_twice": sum(r.answered_twice > 0 for r in mine),
            "wrong": sum(r.wrong for r in mine),
        })
    return rows


def replies_beyond_sends(sends: list[str], replies: collections.Counter[str]) -> int:
    """Replies a request got beyond one per send, counted per server address: a server that answers one
    request twice. (Answers from two servers to a request resent to both are not: the client keeps the first.)"""
    sent = collections.Counter(sends)
    return sum(max(0, count - sent[address]) for address, count in replies.items())


def rss_growth(start: dict[str, int], end: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per manager (keyed by address and pid) alive at both samples: resident MiB at each and the growth."""
    return {
        key: {"start_mib": start[key] / 2**20, "end_mib": end[key] / 2**20, "growth": end[key] / start[key] - 1}
        for key in start
        if key in end and start[key] > 0
    }


def problems(result: dict[str, Any]) -> list[str]:
    """The goals missed: a request lost, answered twice, answered wrong or failed with a non-retryable
    error; a side client not answered; a manager whose memory grew by RSS_GROWTH_GOAL or more."""
    found = []
    for row in result["faults"]:
        bad = {key: row[key] for key in ("lost", "answered_twice", "wrong", "non_retryable") if row[key]}
        if bad:
            found.append(f"{row['fault']}: " + ", ".join(f"{n} {key.replace('_', ' ')}" for key, n in bad.items()))
    for name, side in result["side_clients"].items():
        if side["answered"] < side["expected"]:
            found.append(f"{name}: {side['answered']} of {side['expected']} requests answered")
    for key, memory in result["manager_rss"].items():
        if memory["growth"] >= RSS_GROWTH_GOAL:
            found.append(f"manager {key}: resident memory grew {memory['growth']:.1%}")
    if not result["manager_rss"]:
        found.append("no manager lived through the run: its memory could not be compared")
    return found


def table(result: dict[str, Any]) -> str:
    lines = [
        "| fault | target | requests | ok | errors | lost | answered twice | wrong |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for row in result["faults"]:
        errors = ", ".join(f"{code} {n}" for code, n in row["errors"].items()) or "none"
        lines.append(
            f"| {row['fault']} | {row.get('target', '')} | {row['requests']} | {row['ok']} | {errors} | {row['lost']} "
            f"| {row['answered_twice']} | {row['wrong']} |"
        )
    for name, side in result["side_clients"].items():
        lines.append(f"{name}: sent {side['sent']}, answered {side['answered']} (expected {side['expected']})")
    for key, memory in result["manager_rss"].items():
        lines.append(
            f"manager {key}: resident {memory['start_mib']:.1f} MiB -> {memory['end_mib']:.1f} MiB "
            f"({memory['growth']:+.1%})"
        )
    return "\n".join(lines)
