"""What `./scripts/bench servers` reports, from its raw runs: throughput and where the CPU went, the
client's CPU per request, and each fault's timeline. Pure functions, so they are tested without servers."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from batchmaker.bench.client_load import OpenLoop, Saturated
from batchmaker.clients.loadgen import percentiles

ROLES = ("client", "supervisor", "manager", "worker")


def throughput(servers: int, run: Saturated) -> dict[str, Any]:
    """Requests/s of a closed-loop run, and the cores each process role used meanwhile (all servers of a role
    together); `other` is the rest of the machine's busy time (other users' work), `steal` the hypervisor's."""
    seconds = run.after.at - run.before.at
    used = {"client": run.after.client - run.before.client}
    for role in ROLES[1:]:
        used[role] = run.after.servers.get(role, 0.0) - run.before.servers.get(role, 0.0)
    other = run.after.machine - run.before.machine - sum(used.values())
    cores = {role: value / seconds for role, value in used.items()}
    cores["other"] = max(0.0, other) / seconds
    cores["steal"] = (run.after.steal - run.before.steal) / seconds
    per_request = {role: value / max(1, run.requests) * 1e6 for role, value in used.items()}
    return {
        "servers": servers,
        "requests": run.requests,
        "seconds": seconds,
        "requests_per_s": run.requests / seconds,
        "latency_ms": run.latency_ms,
        "errors": run.errors,
        "cores": cores,
        "cpu_us_per_request": per_request,
    }


def client_cost(name: str, cpu_seconds: float, due: np.ndarray, received: np.ndarray, failed: int) -> dict[str, Any]:
    """A client's own CPU per request at an open-loop rate, with the latency it saw (from each due time)."""
    latency = (received - due)[np.isfinite(received)] * 1e3
    return {
        "client": name,
        "requests": len(due),
        "failed": failed,
        "cpu_us_per_request": cpu_seconds / max(1, len(due)) * 1e6,
        "latency_ms": percentiles(latency),
    }


def _after(moment: float | None, origin: float) -> float | None:
    return None if moment is None else (moment - origin) * 1e3


def fault(name: str, target: str, servers: int, run: OpenLoop, check: dict[str, Any]) -> dict[str, Any]:
    """The timeline of one fault to `target`, one of `servers`, in ms after the signal: its manager gone, the
    client setting it aside, the last request sent to it, the last resent request answered; what was
    answered, and how often; latency of the requests answered before the signal, and of the others."""
    at = run.fault_at if run.fault_at is not None else float("nan")
    aside = next(((t, why) for t, address, why in run.set_aside if address == target and t >= at), (None, None))
    resent = [index for index, sends in enumerate(run.sends) if len(sends) > 1]
    to_target = [t for sends in run.sends for t, address in sends if address == target]
    latency = (run.received - run.due) * 1e3
    answered_before = run.received < at  # the rest were in flight at the signal, or due after it
    later = latency[~answered_before]
    return {
        "fault": name,
        "server": target,
        "servers": servers,
        "requests": len(run.due),
        "answered": sum(error is None for error in run.errors),
        "failed": dict(Counter(error for error in run.errors if error is not None)),
        "fault_at_s": at,
        "manager_gone_after_ms": _after(run.manager_gone, at),
        "set_aside_after_ms": _after(aside[0], at),
        "set_aside_because": aside[1],
        "last_sent_to_it_after_ms": _after(max(to_target, default=None), at),
        "sent_to_it_after_signal": sum(t >= at for t in to_target),
        "refused_while_draining": sum(address == target for _, address in run.refusals),
        "resent": run.resent,
        "resent_requests": len(resent),
        "last_resent_answered_after_ms": _after(float(np.nanmax(run.received[resent])) if resent else None, at),
        "duplicate_replies_dropped": sum(max(0, count - 1) for count in run.answers),
        "latency_ms_before": percentiles(latency[answered_before]),
        "latency_ms_after": percentiles(later),
        "max_latency_ms_after": float(np.nanmax(later)) if len(later) else float("nan"),
        "check": check,
    }


def problems(result: dict[str, Any]) -> list[str]:
    """What went wrong in a run: requests a client never got answered, and answers unlike the reference's."""
    found = [f"{row['client']}: {row['failed']} requests failed" for row in result["client_cost"] if row["failed"]]
    for row in result["faults"]:
        if row["answered"] != row["requests"]:
            found.append(f"{row['fault']}: {row['requests'] - row['answered']} requests not answered {row['failed']}")
        if not row["check"]["ok"]:
            found.append(f"{row['fault']}: answers differ from the reference: {'; '.join(row['check']['wrong'])}")
    return found


def _ms(value: float | None) -> str:
    return "-" if value is None or not np.isfinite(value) else f"{value:,.0f}"


def _markdown(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    return ["", title, "| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def table(result: dict[str, Any]) -> str:
    cores, load = result["machine"]["cores"], result["load_average"][0]
    lines = [
        f"servers at {result['describe']}: {result['workload']}; {cores} cores, load average {load:.1f} at the start"
    ]
    rows = []
    for row in result["throughput"]:
        errors = f" ({row['errors']})" if row["errors"] else ""
        cores = [f"{row['cores'][role]:.2f}" for role in (*ROLES, "other", "steal")]
        rows.append([str(row["servers"]), f"{row['requests_per_s']:,.0f}{errors}",
                     f"{row['latency_ms']['p50']:.1f}", f"{row['latency_ms']['p99']:.1f}", *cores])
    lines += _markdown(
        f"Throughput, one AsyncClient keeping {result['window']} requests outstanding per server; cores used by "
        "each process role (all servers together), by other work on the machine, and stolen:",
        ["servers", "req/s", "p50 ms", "p99 ms", "client", "supervisors", "managers", "workers", "other", "steal"],
        rows,
    )
    rows = [
        [row["client"], f"{row['cpu_us_per_request']:.0f}", f"{row['latency_ms']['p50']:.1f}",
         f"{row['latency_ms']['p99']:.1f}", str(row["failed"])]
        for row in result["client_cost"]
    ]
    lines += _markdown(
        f"The client's own CPU per request, open loop at {result['steady_rps']:,.0f} req/s:",
        ["client", "CPU us per request", "p50 ms", "p99 ms", "failed"],
        rows,
    )
    rows = []
    for row in result["faults"]:
        check = row["check"]
        rows.append([
            row["fault"], str(row["servers"]), _ms(row["manager_gone_after_ms"]), _ms(row["set_aside_after_ms"]),
            _ms(row["last_sent_to_it_after_ms"]), str(row["sent_to_it_after_signal"]),
            str(row["resent"]), _ms(row["last_resent_answered_after_ms"]), str(row["refused_while_draining"]),
            f"{row['answered']}/{row['requests']}", str(row["duplicate_replies_dropped"]),
            f"{check['checked']} ok" if check["ok"] else f"WRONG: {'; '.join(check['wrong'])}",
            f"{row['latency_ms_before']['p99']:.1f}", f"{row['latency_ms_after']['p99']:.1f}",
            _ms(row["max_latency_ms_after"]),
        ])
    lines += _markdown(
        f"Failover, open loop at {result['steady_rps']:,.0f} req/s through one AsyncClient; times in ms after the "
        "signal, 'sent to it after' and 'resent' in requests:",
        ["fault", "servers", "manager gone", "set aside", "last sent to it", "sent to it after", "resent",
         "last resent answered", "refused (draining)", "answered", "duplicates dropped", "answers checked",
         "p99 ms before", "p99 ms after", "max ms after"],
        rows,
    )
    return "\n".join(lines)
