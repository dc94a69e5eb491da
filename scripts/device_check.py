"""`scripts/device-check`: check a machine's device end to end, a stage at a time (scripts/device_stages.py).

Each stage runs in a process of its own under its own timeout, so that a hung device fails that stage
and the report still comes; the report (device-check.json) and the stages' output (device-check.log) go
to --out. Exits 1 when a stage fails, 0 when all pass. --cpu runs what needs no GPU, on CPU workers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = {  # stage: seconds it may take (full run, quick run)
    "environment": (60, 60),
    "cuda-tests": (300, 300),
    "counter": (180, 120),
    "served": (480, 300),
    "throughput": (300, 180),
}


def run_stage(stage: str, out: Path, log, timeout: int, flags: list[str]) -> dict:
    """One stage's report: its own, or a failure saying why it has none."""
    began = time.monotonic()
    command = [sys.executable, str(ROOT / "scripts" / "device_stages.py"), stage, "--out", str(out), *flags]
    try:
        done = subprocess.run(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False
        )
        output, failure = done.stdout, None if done.returncode == 0 else f"exited with status {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        output, failure = expired.stdout or b"", f"timed out after {timeout} s"
    text = output.decode(errors="replace")
    log.write(f"== {stage}\n{text}\n")
    print(text, end="" if text.endswith("\n") or not text else "\n")
    path = out / f"{stage}.json"
    report = (
        json.loads(path.read_text())
        if path.exists() and failure is None
        else {"ok": False, "problems": [], "results": {}}
    )
    if failure is not None:
        report["problems"] = [*report["problems"], f"{stage} {failure} (see device-check.log)"]
    report["seconds"] = round(time.monotonic() - began, 1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="device-check", description="Check this machine's GPU (or, with --cpu, what needs none) end to end."
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the report and log go (default: a new temporary folder)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer tasks and requests in every stage")
    parser.add_argument("--cpu", action="store_true", help="run every stage that needs no GPU, on CPU workers")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="device-check-"))
    out.mkdir(parents=True, exist_ok=True)
    flags = [flag for flag, on in (("--quick", args.quick), ("--cpu", args.cpu)) if on]
    reports = {}
    with open(out / "device-check.log", "w") as log:
        for stage, (full, quick) in STAGES.items():
            print(f"device-check: {stage}", flush=True)
            reports[stage] = run_stage(stage, out, log, quick if args.quick else full, flags)
            verdict = "ok" if reports[stage]["ok"] else "FAILED: " + "; ".join(reports[stage]["problems"])
            print(f"device-check: {stage}: {verdict} ({reports[stage]['seconds']} s)", flush=True)
    passed = all(report["ok"] for report in reports.values())
    summary = {"passed": passed, "cpu": args.cpu, "quick": args.quick, "stages": reports}
    (out / "device-check.json").write_text(json.dumps(summary, indent=1))
    print(f"device-check: {'all stages passed' if passed else 'FAILED'}; report in {out / 'device-check.json'}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
